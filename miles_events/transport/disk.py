"""The ``disk`` transport: bulk data as files under the run directory.

A tensor set is a directory of safetensors files, ``<run_dir>/transport/<run_id>/<key>/``;
raw bytes are one file beside it. ``DiskReader.path(ref)`` is where a reference's data
lies, so the handle is a path: a reader in any process that sees the run directory (an
inference server's ``update_weights_from_disk``) opens it itself. Writes go to a hidden
name and are renamed into place, so a reader never sees a half-written set.
"""

from __future__ import annotations

import os
import shutil
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
from schemas.data import DataRef

if TYPE_CHECKING:  # torch is imported by what puts or gets tensors, not by every reader of events
    import torch

    from schemas.config import Config

TRANSPORT_DIR = "transport"
TENSORS_FILE = "model.safetensors"


class DiskFiles:
    """The run's directory of staged data, ``<run_dir>/transport/<run_id>/``: what both ends
    of the disk transport read and write."""

    def __init__(self, run_id: str, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / TRANSPORT_DIR / run_id
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if "/" in key or key.startswith(".") or not key:
            raise ValueError(f"bad data key {key!r}")
        return self.root / key

    def partial(self, key: str) -> Path:
        return self.path(key).with_name(f".{key}.partial")

    def install(self, key: str, partial: Path) -> Path:
        final = self.path(key)
        remove_later(final)  # gone now; its bytes are freed off this thread
        os.replace(partial, final)
        return final

    def gone(self, key: str) -> KeyError:
        return KeyError(f"disk data {key!r} is gone (freed, or never written under {self.root})")

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            self.root.parent.rmdir()  # the transport dir, once no run uses it
        except OSError:
            pass


class DiskStager(Stager):
    name = "disk"

    def __init__(self, files: DiskFiles) -> None:
        self.files = files

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        partial = self.files.partial(key)
        remove_later(partial)
        partial.mkdir()
        contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        _safetensors().save_file(contiguous, str(partial / TENSORS_FILE), TENSORS_METADATA)
        size = (partial / TENSORS_FILE).stat().st_size
        self.files.install(key, partial)
        return DataRef(self.name, key, owner, size)

    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef:
        partial = self.files.partial(key)
        partial.write_bytes(data)
        self.files.install(key, partial)
        return DataRef(self.name, key, owner, len(data))

    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        partial = self.files.partial(key)
        save_state(state, partial)
        size = partial.stat().st_size
        self.files.install(key, partial)
        return DataRef(self.name, key, owner, size)

    def free(self, ref: DataRef) -> None:
        remove_later(self.files.path(ref.key))  # gone now; its bytes are freed off this thread


class DiskReader(Reader):
    name = "disk"

    def __init__(self, files: DiskFiles) -> None:
        self.files = files

    def path(self, ref: DataRef) -> Path:
        """Where ``ref``'s data lies: a directory of safetensors files, or a file of bytes."""
        return self.files.path(ref.key)

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        directory = self.path(ref)
        if not directory.is_dir():
            raise self.files.gone(ref.key)
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors.update(_safetensors().load_file(str(file)))
        return tensors

    def tensors_file(self, ref: DataRef) -> Path | None:
        files = sorted(self.path(ref).glob("*.safetensors"))
        return files[0] if len(files) == 1 else None

    def get_bytes(self, ref: DataRef) -> bytes:
        try:
            return self.path(ref).read_bytes()
        except FileNotFoundError:
            raise self.files.gone(ref.key) from None

    def get_state(self, ref: DataRef) -> Any:
        path = self.state_file(ref)
        if not path.is_file():
            raise self.files.gone(ref.key)
        return load_state(path)

    def state_file(self, ref: DataRef) -> Path:
        return self.path(ref)


class DiskTransport(FilesTransport):
    name = "disk"
    reader: DiskReader

    def __init__(self, run_id: str, run_dir: Path) -> None:
        self.files = DiskFiles(run_id, run_dir)
        super().__init__(run_id, DiskStager(self.files), DiskReader(self.files))

    @classmethod
    def open(cls, run_id: str, run_dir: Path | None = None, config: Config | None = None) -> DiskTransport:
        if run_dir is None:
            raise ValueError("the disk transport needs the run directory")
        return cls(run_id, run_dir)
