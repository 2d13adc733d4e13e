"""The data plane: bulk data (rollout batches, weights, train state) travels here, and
events carry a ``DataRef`` to it.

One seam, small implementations: ``InProcessTransport`` keeps objects in this process (the
local runtime), ``ShmTransport`` writes them under ``/dev/shm`` so any process on the host
maps them (the ray runtime), ``DiskTransport`` (``disk.py``) writes them under the run
directory, where a handle is a path any reader can open itself, and ``CudaIpcTransport``
(``cuda_ipc.py``) shares weights staged on a GPU with the processes on the same host by CUDA
IPC handles, without a copy. Weights are staged as flat buckets (``put_buckets``), one
buffer per dtype. Whoever consumes a
reference publishes ``DataReleased``; the owner then calls ``free``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_events.checkpoint.format import load_state, save_state
from miles_events.transport.reaper import remove_later
from miles_events.util.file_modes import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from miles_events.util.registry import registered
from schemas.data import DataRef

if TYPE_CHECKING:  # torch is imported by what puts or gets tensors, not by every reader of events
    import torch

    from miles_events.device.buckets import Buckets


def _safetensors() -> Any:
    """``safetensors.torch``, imported when tensors are first put or got: a process that only
    passes references on (the driver of the ray runtime) never loads torch."""
    import safetensors.torch

    return safetensors.torch


class Transport(ABC):
    name: str

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    @classmethod
    def open(cls, run_id: str, run_dir: Path | None = None) -> Transport:
        """The transport of run ``run_id``, whose directory is ``run_dir``."""
        return cls(run_id)

    @abstractmethod
    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        """Stage a copy of ``tensors``: later changes to the originals do not reach readers."""

    @abstractmethod
    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]: ...

    def put_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        """Stage tensors already packed in flat buckets (``miles_events.device.buckets``), which
        the caller hands over and no longer writes. A transport that can pass the buckets on
        as they are (in process, CUDA IPC) keeps them; the others store their tensors as
        ``put_tensors`` does, from one device-to-host copy per bucket."""
        return self.put_tensors(key, buckets.to("cpu").tensors(), owner)

    def get_buckets(self, ref: DataRef) -> Buckets | None:
        """The buckets behind ``ref`` as staged by ``put_buckets``, where this transport keeps
        them as buckets (a reader whose own weights share their layout loads each with one
        copy); None where it does not."""
        return None

    def done_reading(self, ref: DataRef, device: torch.device) -> None:
        """Every read of ``ref``'s data by this process is queued on ``device``'s current
        stream (a GPU's copies may still be running): its producer may write the data's
        buffers again once those have run. Here, where a producer cannot see a reader's
        GPU work, this waits for it; a transport whose producer can (``cuda_ipc``) leaves it
        queued and tells the producer what to wait for (``reads_of``)."""
        if device.type == "cuda":
            import torch

            torch.cuda.current_stream(device).synchronize()

    def reads_of(self, ref: DataRef) -> tuple[Any, ...]:
        """What the readers of ``ref`` (its producer's own buffers, not freed yet) said they
        queued (``done_reading``) and may still be running: events to ``query`` before the
        buffers are written again. None here: every reader waited for its reads."""
        return ()

    def tensors_file(self, ref: DataRef) -> Path | None:
        """The one safetensors file holding ``ref``'s tensors, where this transport keeps
        them in one (a reader that only copies them, as the Saver, needs no torch then);
        None where it does not."""
        return None

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef: ...

    @abstractmethod
    def get_bytes(self, ref: DataRef) -> bytes: ...

    @abstractmethod
    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        """Stage a torch state (an optimizer's or the RNG's state dict: tensors, numbers and
        strings in dicts and lists), which the caller hands over and no longer writes. A
        transport that keeps files writes it with ``torch.save`` straight into its file:
        pickled into memory first, a state of a gigabyte would hold the interpreter lock for
        a second, stalling every actor thread beside the save."""

    @abstractmethod
    def get_state(self, ref: DataRef) -> Any:
        """The state staged by ``put_state`` (tensors on the CPU)."""

    def state_file(self, ref: DataRef) -> Path | None:
        """The ``torch.save`` file of ``ref``'s state, where this transport keeps one (a
        reader that only copies it, as the Saver, needs no torch then); None where it does
        not."""
        return None

    @abstractmethod
    def free(self, ref: DataRef) -> None:
        """Drop the data; freeing twice is allowed."""

    def close(self) -> None:
        """Drop everything of this run held by this transport."""


# Objects of the in-process transport, by run id then key. Module-level so that every
# actor of a local run (one process) sees the same store.
_IN_PROCESS: dict[str, dict[str, object]] = {}


class InProcessTransport(Transport):
    name = "inprocess"

    def _store(self) -> dict[str, object]:
        return _IN_PROCESS.setdefault(self.run_id, {})

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        copy = {name: t.detach().clone() for name, t in tensors.items()}
        self._store()[key] = copy
        return DataRef(self.name, key, owner, sum(t.numel() * t.element_size() for t in copy.values()))

    def put_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        # Handed over, not copied: the caller packed them for this publication alone.
        self._store()[key] = buckets
        return DataRef(self.name, key, owner, buckets.num_bytes)

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        value = self._get(ref)
        if isinstance(value, dict):
            return value
        buckets = self.get_buckets(ref)  # the only other kind of tensors kept
        assert buckets is not None
        return buckets.tensors()

    def get_buckets(self, ref: DataRef) -> Buckets | None:
        from miles_events.device.buckets import Buckets

        value = self._get(ref)
        return value if isinstance(value, Buckets) else None

    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef:
        self._store()[key] = bytes(data)
        return DataRef(self.name, key, owner, len(data))

    def get_bytes(self, ref: DataRef) -> bytes:
        value = self._get(ref)
        assert isinstance(value, bytes)
        return value

    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        # Handed over as it is: nothing in this process needs it serialised.
        self._store()[key] = _StagedState(state)
        return DataRef(self.name, key, owner, _state_bytes(state))

    def get_state(self, ref: DataRef) -> Any:
        value = self._get(ref)
        assert isinstance(value, _StagedState)
        return value.state

    def _get(self, ref: DataRef) -> object:
        try:
            return self._store()[ref.key]
        except KeyError:
            raise KeyError(f"in-process data {ref.key!r} is gone (freed, or from another process)") from None

    def free(self, ref: DataRef) -> None:
        self._store().pop(ref.key, None)

    def close(self) -> None:
        _IN_PROCESS.pop(self.run_id, None)


@dataclass(frozen=True)
class _StagedState:
    """A state kept in process (told apart from the other objects kept)."""

    state: Any


def _state_bytes(state: Any) -> int:
    from miles_events.device.host_copy import map_tensors

    sizes: list[int] = []

    def measure(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    map_tensors(state, measure)
    return sum(sizes)


TENSORS_METADATA = {"format": "pt"}
"""The header metadata of every safetensors file a transport writes, as Hugging Face writes
it: a staged file is a checkpoint's weights file as it is."""

SHM_PREFIX = "miles-events-"
"""The shared-memory directory of run ``r`` is ``<shm_root>/miles-events-<r>``."""


def shm_root() -> Path:
    base = Path("/dev/shm")
    return base if base.is_dir() and os.access(base, os.W_OK) else Path(tempfile.gettempdir())


class ShmTransport(Transport):
    """Files in shared memory: one safetensors file per tensor set, raw bytes otherwise.

    Writes go to a temporary name and are renamed into place, so a reader never sees a
    half-written file.
    """

    name = "shm"

    def __init__(self, run_id: str, root: Path | None = None) -> None:
        super().__init__(run_id)
        self.root = (root or shm_root()) / f"{SHM_PREFIX}{run_id}"
        # Only this user may read the run's data (optimizer and RNG state pass through here).
        self.root.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.root, PRIVATE_DIR_MODE)

    def _path(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise ValueError(f"bad data key {key!r}")
        return self.root / key

    def _publish(self, key: str, write: Callable[[Path], object]) -> Path:
        final = self._path(key)
        partial = final.with_name(f".{key}.partial")
        write(partial)
        os.chmod(partial, PRIVATE_FILE_MODE)
        os.replace(partial, final)
        return final

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        path = self._publish(key, lambda p: _safetensors().save_file(contiguous, str(p), TENSORS_METADATA))
        return DataRef(self.name, key, owner, path.stat().st_size)

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = _safetensors().load_file(str(self._path(ref.key)))
        return tensors

    def tensors_file(self, ref: DataRef) -> Path:
        return self._path(ref.key)

    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef:
        self._publish(key, lambda p: p.write_bytes(data))
        return DataRef(self.name, key, owner, len(data))

    def get_bytes(self, ref: DataRef) -> bytes:
        return self._path(ref.key).read_bytes()

    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        path = self._publish(key, lambda p: save_state(state, p))
        return DataRef(self.name, key, owner, path.stat().st_size)

    def get_state(self, ref: DataRef) -> Any:
        return load_state(self._path(ref.key))

    def state_file(self, ref: DataRef) -> Path:
        return self._path(ref.key)

    def free(self, ref: DataRef) -> None:
        # Gone for readers now; its pages are freed off this thread (a save's staged
        # optimizer state is gigabytes: seconds of an event loop's time).
        remove_later(self._path(ref.key))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


TRANSPORTS: dict[str, str] = {
    "inprocess": "miles_events.transport.base:InProcessTransport",
    "shm": "miles_events.transport.base:ShmTransport",
    "disk": "miles_events.transport.disk:DiskTransport",
    "cuda_ipc": "miles_events.transport.cuda_ipc:CudaIpcTransport",
}
"""Transport name -> ``"module:Class"``, imported when a run opens it."""


def open_transport(name: str, run_id: str, run_dir: Path | None = None) -> Transport:
    cls: type[Transport] = registered(TRANSPORTS, name, "transport")
    return cls.open(run_id, run_dir)
