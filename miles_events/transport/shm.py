"""The ``shm`` transport: files in shared memory (the ray runtime's default), one safetensors
file per tensor set, a ``torch.save`` file per state, raw bytes otherwise.

Both ends work on the run's directory (``ShmFiles``): writes go to a temporary name and are
renamed into place, so a reader never sees a half-written file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_events.checkpoint.format import load_state, save_state
from miles_events.transport.base import (
    TENSORS_METADATA,
    FilesTransport,
    Reader,
    Stager,
    _safetensors,
)
from miles_events.transport.reaper import remove_later
from miles_events.util.file_modes import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from schemas.data import DataRef

if TYPE_CHECKING:
    import torch

SHM_PREFIX = "miles-events-"
"""The shared-memory directory of run ``r`` is ``<shm_root>/miles-events-<r>``."""


def shm_root() -> Path:
    base = Path("/dev/shm")
    return base if base.is_dir() and os.access(base, os.W_OK) else Path(tempfile.gettempdir())


class ShmFiles:
    """The run's shared-memory directory, private to its user (optimizer and RNG state pass
    through here): what both ends of a shared-memory transport read and write."""

    def __init__(self, run_id: str, root: Path | None = None) -> None:
        self.root = (root or shm_root()) / f"{SHM_PREFIX}{run_id}"
        self.root.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.root, PRIVATE_DIR_MODE)

    def path(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise ValueError(f"bad data key {key!r}")
        return self.root / key

    def publish(self, key: str, write: Callable[[Path], object]) -> Path:
        """The file ``key``, written by ``write`` under a partial name and renamed into place."""
        final = self.path(key)
        partial = final.with_name(f".{key}.partial")
        write(partial)
        os.chmod(partial, PRIVATE_FILE_MODE)
        os.replace(partial, final)
        return final

    def write_hidden(self, data: bytes, new_name: Callable[[], str]) -> Path:
        """A new hidden file of the directory holding ``data``, private to its user, under a
        name ``new_name`` gives that no other file has (created, never opened for writing
        again: keys link to it)."""
        while True:
            path = self.root / new_name()
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE_MODE)
            except FileExistsError:
                continue
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(data)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            return path

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class ShmStager(Stager):
    name = "shm"

    def __init__(self, files: ShmFiles, name: str = "shm") -> None:
        self.files = files
        self.name = name
        """The transport its references name (``cuda_ipc`` stages all but GPU buckets here)."""

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        path = self.files.publish(
            key, lambda p: _safetensors().save_file(contiguous, str(p), TENSORS_METADATA)
        )
        return DataRef(self.name, key, owner, path.stat().st_size)

    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef:
        self.files.publish(key, lambda p: p.write_bytes(data))
        return DataRef(self.name, key, owner, len(data))

    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        path = self.files.publish(key, lambda p: save_state(state, p))
        return DataRef(self.name, key, owner, path.stat().st_size)

    def free(self, ref: DataRef) -> None:
        # Gone for readers now; its pages are freed off this thread (a save's staged
        # optimizer state is gigabytes: seconds of an event loop's time).
        remove_later(self.files.path(ref.key))


class ShmReader(Reader):
    name = "shm"

    def __init__(self, files: ShmFiles) -> None:
        self.files = files

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = _safetensors().load_file(str(self.files.path(ref.key)))
        return tensors

    def tensors_file(self, ref: DataRef) -> Path | None:
        return self.files.path(ref.key)

    def get_bytes(self, ref: DataRef) -> bytes:
        return self.files.path(ref.key).read_bytes()

    def get_state(self, ref: DataRef) -> Any:
        return load_state(self.files.path(ref.key))

    def state_file(self, ref: DataRef) -> Path:
        return self.files.path(ref.key)


class ShmTransport(FilesTransport):
    name = "shm"

    def __init__(self, run_id: str, root: Path | None = None) -> None:
        self.files = ShmFiles(run_id, root)
        super().__init__(run_id, ShmStager(self.files), ShmReader(self.files))
