"""Which checkpoint a run continues from: ``run.resume``'s choice (the one ``latest``
names, else the newest, of this run's lineage, that verifies), ``run.load``'s marker, and
moving checkpoints out of the way (``set_aside``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import msgspec

from miles_events.checkpoint.format import (
    CHECKPOINTS_DIR,
    FINAL_NAME,
    ITERATION_FILE,
    TRAINER_STATE_FILE,
    CheckpointError,
    checkpoint_name,
    checkpoint_rollout_id,
    complete_checkpoints,
    latest_pointer,
    verify_checkpoint,
)
from schemas.checkpoint import TrainerState

log = logging.getLogger(__name__)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every checkpoint directory under ``<run_dir>/checkpoints``, complete or not: the one
    ``latest`` names first, then by rollout id, newest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = sorted(
        (p for p in root.iterdir() if FINAL_NAME.match(p.name) and p.is_dir()),
        key=lambda p: checkpoint_rollout_id(p) or 0,
        reverse=True,
    )
    pointed = latest_pointer(root)
    return sorted(found, key=lambda p: p.name != pointed) if pointed is not None else found


def _saved_state(path: Path) -> TrainerState | None:
    try:
        return msgspec.json.decode((path / TRAINER_STATE_FILE).read_bytes(), type=TrainerState)
    except (OSError, msgspec.DecodeError):
        return None


def saved_lineage(path: Path) -> str:
    """The lineage a checkpoint records ("" when unknown or unreadable)."""
    state = _saved_state(path)
    return state.lineage if state is not None else ""


@dataclass
class ResumeChoice:
    """What ``choose_resume_checkpoint`` found."""

    checkpoint: Path | None
    """The checkpoint to resume from; None when none qualifies."""
    lineage: str
    """The lineage resumed ("" when unknown)."""
    skipped: list[tuple[Path, str]]
    """Checkpoints passed over before it, and why (does not verify, another lineage)."""
    found: list[Path]
    """Every checkpoint directory there."""


def choose_resume_checkpoint(run_dir: Path) -> ResumeChoice:
    """The checkpoint a resumed run continues from: the one ``latest`` names, else the
    newest; the first of those that verifies and belongs to the lineage of the newest
    checkpoint whose state reads (a checkpoint of another run is never resumed from)."""
    found = checkpoint_dirs(run_dir)
    lineage = ""
    skipped: list[tuple[Path, str]] = []
    for candidate in found:
        state = _saved_state(candidate)
        if state is not None and state.lineage:
            if not lineage:
                lineage = state.lineage
            elif state.lineage != lineage:
                skipped.append((candidate, f"another run's (lineage {state.lineage}, resuming {lineage})"))
                continue
        try:
            verify_checkpoint(candidate)
        except CheckpointError as exc:
            log.warning("skipping checkpoint that does not verify: %s", exc)
            skipped.append((candidate, str(exc).removeprefix(f"checkpoint {candidate}").lstrip(": ")))
            continue
        return ResumeChoice(candidate, lineage, skipped, found)
    return ResumeChoice(None, lineage, skipped, found)


def latest_checkpoint(run_dir: Path, verify: bool = True) -> Path | None:
    """The checkpoint to resume from, or None when the run has no complete one.

    ``latest`` names the checkpoint saved last; when it is gone or fails verification the
    complete checkpoint with the highest rollout id is used instead, so a torn or corrupted
    last save falls back to the previous one (``choose_resume_checkpoint``). ``verify=False``
    trusts the manifests' presence and skips hashing.
    """
    if verify:
        return choose_resume_checkpoint(run_dir).checkpoint
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return None
    pointed = latest_pointer(root)
    ordered = complete_checkpoints(root)
    if pointed is not None:
        ordered = sorted(ordered, key=lambda p: p.name != pointed)
    return ordered[0] if ordered else None


def set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``<name>.<why>`` (``-2``, ``-3``, ... if taken) so that nothing
    later writes over it; returns the new path."""
    target = path.with_name(f"{path.name}.{why}")
    n = 2
    while target.exists():
        target = path.with_name(f"{path.name}.{why}-{n}")
        n += 1
    path.rename(target)
    return target


def marked_checkpoint(root: Path) -> tuple[Path, int]:
    """The checkpoint a checkpoint root's ``latest_checkpointed_iteration.txt`` names (as
    Megatron and miles load ``--load``), verified; returns it with the iteration.

    Raises ``CheckpointError`` (one line) when the marker is missing or not an integer, or
    the checkpoint it names is missing or does not verify.
    """
    root = Path(root)
    marker = root / ITERATION_FILE
    try:
        text = marker.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise CheckpointError(
            f"{root}: no {ITERATION_FILE} (not a checkpoint root the Saver wrote)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{marker}: cannot read: {exc}") from None
    if not text.isdigit():
        raise CheckpointError(f"{marker}: {text[:40]!r} is not an iteration number")
    iteration = int(text)
    path = root / checkpoint_name(iteration)
    if not path.is_dir():
        raise CheckpointError(f"{marker} names iteration {iteration}, but {path} does not exist")
    verify_checkpoint(path)
    return path, iteration
