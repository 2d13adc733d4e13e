"""The seed's proof that a rollout-only run serves its checkpoint (``train.py``'s
``_verify_checkpoint_rollout_publication``), one step at a time, and its evidence file.

The steps, each fed what the engines reported at that moment:

1. ``base``: checksums and versions before the first publication (the bootstrap);
2. ``served``: after it. Every engine went from ``"default"`` to ``"1"``, and at least
   one selected tensor changed;
3. snapshot, then reset_tensors (both must succeed on every engine), then ``reset``:
   at least one tensor changed;
4. the same weights are published again; ``republished_versions``: every version went up
   by exactly one; compare (must succeed, no quantisation error allowed);
5. ``republished``: the checksums equal the served ones.

Each failure raises ``RuntimeError`` with the seed's message. ``evidence`` then gives the
record ``write_evidence`` puts on disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from miles_events.rl.publication_checks import (
    CanonicalChecksums,
    changed_checksum_count,
    checksum_digest,
    require_initial_version_publication,
    require_version_increment,
)
from miles_events.util.durable import fsync_path
from miles_events.util.file_modes import PRIVATE_FILE_MODE
from schemas.evidence import CheckpointRolloutEvidence


@dataclass
class CheckpointRolloutProof:
    base: CanonicalChecksums = ()
    bootstrap_versions: tuple[str, ...] = ()
    served: CanonicalChecksums = ()
    served_versions: tuple[str, ...] = ()
    changed: int = 0
    reset: CanonicalChecksums = ()
    reset_changed: int = 0
    republished_versions: tuple[str, ...] = ()

    def record_base(self, checksums: CanonicalChecksums, versions: Sequence[str]) -> None:
        self.base, self.bootstrap_versions = checksums, tuple(versions)

    def record_served(self, checksums: CanonicalChecksums, versions: Sequence[str]) -> None:
        self.served, self.served_versions = checksums, tuple(versions)
        require_initial_version_publication(self.bootstrap_versions, self.served_versions)
        self.changed = changed_checksum_count(self.base, self.served)
        if self.changed == 0:
            raise RuntimeError(
                "checkpoint-backed rollout publication left every language tensor identical to the HF bootstrap"
            )

    def record_reset(self, checksums: CanonicalChecksums) -> None:
        self.reset = checksums
        self.reset_changed = changed_checksum_count(self.served, self.reset)
        if self.reset_changed == 0:
            raise RuntimeError("inference weight reset left every selected language tensor unchanged")

    def record_republished_versions(self, versions: Sequence[str]) -> None:
        self.republished_versions = tuple(versions)
        require_version_increment(
            self.served_versions, self.republished_versions, action="checkpoint republication"
        )

    def record_republished(self, checksums: CanonicalChecksums) -> None:
        if checksums != self.served:
            raise RuntimeError("checkpoint-backed rollout weights changed across exact republication")

    def evidence(
        self, *, effective_load: str, ref_load: str, checkpoint_iteration: int
    ) -> CheckpointRolloutEvidence:
        return CheckpointRolloutEvidence(
            effective_load=str(Path(effective_load).resolve()),
            ref_load=str(Path(ref_load).resolve()),
            checkpoint_iteration=checkpoint_iteration,
            engine_count=len(self.served),
            language_tensor_count=sum(len(engine) for engine in self.served),
            changed_language_tensor_count=self.changed,
            reset_changed_language_tensor_count=self.reset_changed,
            base_language_checksum_sha256=checksum_digest(self.base),
            served_language_checksum_sha256=checksum_digest(self.served),
            reset_language_checksum_sha256=checksum_digest(self.reset),
            bootstrap_weight_versions=list(self.bootstrap_versions),
            served_weight_versions=list(self.served_versions),
            republished_weight_versions=list(self.republished_versions),
        )


def evidence_bytes(evidence: CheckpointRolloutEvidence) -> bytes:
    """The file's bytes as the seed writes them: compact JSON, keys sorted, ASCII, newline."""
    payload = msgspec.to_builtins(evidence)
    return (json.dumps(payload, sort_keys=True, separators=(",", ":")) + "\n").encode()


def write_evidence(path: str | os.PathLike[str], evidence: CheckpointRolloutEvidence) -> None:
    """Create ``path`` (never replacing a file: ``FileExistsError``), mode 0600, write the
    evidence, flush and fsync it, then fsync its directory so the name lasts too."""
    path = Path(path)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    with os.fdopen(descriptor, "wb") as stream:
        stream.write(evidence_bytes(evidence))
        stream.flush()
        os.fsync(stream.fileno())
    fsync_path(path.parent)
