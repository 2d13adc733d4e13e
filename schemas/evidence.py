"""The proof that a rollout-only run serves its checkpoint, as the seed writes it.

``CheckpointRolloutEvidence`` is the JSON object of the seed's
``_write_checkpoint_rollout_evidence``: the same schema name and the same fields. The
checksum digests are sha256 over the canonical checksums (per engine the sorted
``(f"rank{r}/{name}", checksum)`` pairs of every selected tensor, engines sorted) of three
moments: the bootstrap before the first publication (``base``), after it (``served``) and
after every engine reset its tensors (``reset``).
"""

from __future__ import annotations

from typing import Final

import msgspec

CHECKPOINT_ROLLOUT_EVIDENCE_SCHEMA = "miles.checkpoint-backed-rollout-publication.v1"
CHECKPOINT_ROLLOUT_SELECTOR: Final = "target"
CHECKPOINT_ROLLOUT_SKIP_LIST = ("visual",)


class CheckpointRolloutEvidence(msgspec.Struct, frozen=True, kw_only=True):
    schema: str = CHECKPOINT_ROLLOUT_EVIDENCE_SCHEMA
    effective_load: str
    """The checkpoint root loaded (``run.load``, else ``run.ref_load``), absolute."""
    ref_load: str
    """The reference model: ``run.ref_load``, else the base model's directory, absolute."""
    checkpoint_iteration: int
    """What ``<effective_load>/latest_checkpointed_iteration.txt`` says."""
    selector: str = CHECKPOINT_ROLLOUT_SELECTOR
    skip_tensor_substrings: list[str] = msgspec.field(
        default_factory=lambda: list(CHECKPOINT_ROLLOUT_SKIP_LIST)
    )
    engine_count: int
    language_tensor_count: int
    """Selected tensors over every engine (each rank's counted)."""
    changed_language_tensor_count: int
    """Tensors the first publication changed from the bootstrap."""
    reset_changed_language_tensor_count: int
    """Tensors the reset changed from what was served."""
    base_language_checksum_sha256: str
    served_language_checksum_sha256: str
    reset_language_checksum_sha256: str
    bootstrap_weight_versions: list[str]
    served_weight_versions: list[str]
    republished_weight_versions: list[str]
    trained_snapshot_reset_republication_equal: bool = True
