"""Making what a run writes last across a crash: a file's or a directory's data on disk."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str] | Path) -> None:
    """fsync the file or directory at ``path`` (a directory: the names in it, so that a file
    created or renamed there is still there after a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
