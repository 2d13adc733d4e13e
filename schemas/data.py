"""References to bulk data. Events are small: batches and weights travel through a
transport and the event carries this handle."""

from __future__ import annotations

import msgspec


class DataRef(msgspec.Struct, frozen=True):
    transport: str
    """Which transport holds the data: ``"inprocess"``, ``"shm"`` or ``"disk"``."""
    key: str
    """The transport's name for it; unique within a run."""
    owner: str
    """The actor that created it and frees it on ``DataReleased``."""
    num_bytes: int = 0
