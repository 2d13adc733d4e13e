"""What a checkpoint holds besides the Hugging Face files, and its manifest."""

from __future__ import annotations

import msgspec


class DataCursor(msgspec.Struct, frozen=True, kw_only=True):
    next_rollout_id: int
    epoch: int
    offset: int
    """Prompts of the current epoch already consumed."""


class TrainerState(msgspec.Struct, frozen=True, kw_only=True):
    """Small state saved beside the weights in ``trainer_state.json``."""

    rollout_id: int
    """The last rollout trained into these weights."""
    weight_version: str
    """Versions published so far; a resumed run's first publication is this plus one."""
    num_optimizer_steps: int
    data: DataCursor
    seed: int
    run_id: str
    """The run that saved it."""
    lineage: str = ""
    """The run id of the fresh run this one continues (itself on a fresh run; inherited on
    resume): a resume never crosses into another lineage. "" in checkpoints written before
    lineages were recorded (compatible with any)."""


class ManifestEntry(msgspec.Struct, frozen=True):
    path: str
    sha256: str
    num_bytes: int


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    schema: str = "miles-events.checkpoint.v1"
    rollout_id: int
    weight_version: str
    files: list[ManifestEntry]
