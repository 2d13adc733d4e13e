"""Pruning: the oldest complete checkpoints beyond ``saver.keep_last``, and the work
directories writers that died left behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from miles_events.checkpoint.format import CHECKPOINTS_DIR, WORK_NAME, complete_checkpoints, latest_pointer


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dir(path: Path) -> None:
    # Hide it first, so that a crash half-way never leaves a checkpoint-looking dir.
    doomed = path.with_name(f".{path.name}.deleting-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Remove the oldest complete checkpoints beyond ``keep_last`` (0 keeps all).

    The checkpoint ``latest`` points at is never removed. Work dirs left by writers that
    died (``.partial``, ``.old``, ``.deleting``) are removed too. Returns what was removed.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for entry in sorted(root.iterdir()):
        match = WORK_NAME.match(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    if keep_last > 0:
        pointed = latest_pointer(root)
        for old in complete_checkpoints(root)[keep_last:]:
            if old.name == pointed:
                continue
            _remove_dir(old)
            removed.append(old)
    return removed
