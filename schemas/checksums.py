"""What an engine answers to SGLang's ``/weights_checker`` actions, typed.

``EngineChecksumReport`` is the ``checksum`` reply in SGLang's shape (unknown fields are
ignored, and both shapes of ``parallelism_info`` decode); ``WeightsCheckResult`` is the
reply to ``snapshot``, ``reset_tensors`` and ``compare``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Selector = Literal["all", "target", "draft"]
"""Which model's tensors a weight-checker action covers."""
CheckAction = Literal["checksum", "snapshot", "reset_tensors", "compare"]
"""SGLang's ``/weights_checker`` actions."""
TensorCheckAction = Literal["snapshot", "reset_tensors", "compare"]
"""The weight-checker actions besides ``checksum``."""


class ParallelismInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank of an engine sits."""

    rank: int = 0
    """The GPU rank within the engine."""
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    role: str = ""
    """Set where SGLang reports a list of these, one per role."""


class RankChecksums(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's tensors: name -> 16-hex-digit fingerprint, and their SGLang digest."""

    checksums: dict[str, str]
    per_gpu_checksum: str = ""
    """SGLang's digest of ``checksums``; "" where a reply leaves it out (miles reads none)."""
    parallelism_info: ParallelismInfo | list[ParallelismInfo] = msgspec.field(default_factory=ParallelismInfo)
    """A dict in some SGLang versions, a list of dicts with a ``role`` in others."""


class EngineChecksumReport(msgspec.Struct, frozen=True, kw_only=True):
    """The ``checksum`` action's reply: every rank of one engine (``ordered_ranks`` in
    ``miles_events.rl.checksum`` checks them and puts them in rank order)."""

    success: bool
    message: str = ""
    ranks: list[RankChecksums] = []
    per_engine_checksum: str = ""
    """sha256 over the ranks' ``per_gpu_checksum``, in rank order."""


class WeightsCheckResult(msgspec.Struct, frozen=True, kw_only=True):
    """The reply to ``snapshot``, ``reset_tensors`` or ``compare``."""

    success: bool
    message: str
    action: str
    weight_version: str = "default"
    """The version the engine serves after the action."""
    num_tensors: int = 0
    """Tensors the action covered (selected and not skipped)."""
    mismatched: list[str] = []
    """``compare``: tensors that differ from the snapshot."""
    missing: list[str] = []
    """``compare``: selected tensors the snapshot does not hold."""


class ChecksumManifest(msgspec.Struct, frozen=True, kw_only=True):
    """The per-tensor checksums of one side of a publication, kept once per digest under
    ``<run_dir>/checksums/`` (events carry only the digest and this file's path)."""

    digest: str
    """``per_gpu_checksum`` of ``checksums``: the manifest's name."""
    checksums: dict[str, str]
    """Tensor name -> 16-hex-digit fingerprint."""
