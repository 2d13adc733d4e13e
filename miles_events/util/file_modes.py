"""One rule for the modes of the files a run writes.

Files a run keeps in its run directory (event log, configs, checksum manifests, the base
model, checkpoints) follow the umask, as any tool's output does: ``0o666 & ~umask``
(0644 with the usual 022), whichever library wrote them (safetensors writes 0600 itself, so
its files are set to the rule). Data in flight between a run's processes (the
shared-memory data plane) and the rollout-only evidence are private: files 0600 in
directories 0700.
"""

from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


KEPT_FILE_MODE = 0o666 & ~_umask()
"""The mode of every file a run keeps (the process's umask applied to 0o666)."""
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def keep(path: Path) -> Path:
    """Give a kept file the rule's mode (for files a library created with its own)."""
    os.chmod(path, KEPT_FILE_MODE)
    return path


def nearest_existing(path: Path) -> Path:
    """``path`` made absolute, or the nearest of its parents that exists (what creating it
    would write into)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    return existing


def why_unwritable(path: Path) -> str | None:
    """Why a run could not create or write the directory ``path``, asking without writing:
    it, or the nearest part of it that exists, must be a directory this process may write
    into (a read-only file system says no here, even to root). None when it can."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"{existing} is on a read-only file system"
        return f"{existing} is not writable"
    return None
