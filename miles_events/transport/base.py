"""The data plane's seams: bulk data (rollout batches, weights, train state) travels through
a transport, and events carry a ``DataRef`` to it.

A transport has two ends, as a sender and a receiver: the ``Stager`` (the producer's end:
it stages data, learns what its readers queued, and frees what it staged) and the
``Reader`` (the consumer's end: it reads what a reference names and says when it is done).
Each end is typed by the kind of data it moves: bytes (rollout batches), buckets (weights,
as tensors or flat buckets) and state (optimizer and RNG state dicts). ``Transport`` is a
run's data plane: its name and the two ends, opened on the same storage.

One file per transport: ``inprocess.py`` keeps objects in this process (the local runtime),
``shm.py`` writes them under ``/dev/shm`` so any process on the host maps them (the ray
runtime), ``disk.py`` writes them under the run directory, where a handle is a path any
reader can open itself, ``cuda_ipc.py`` shares weights staged on a GPU with the
processes on the same host by CUDA IPC handles, without a copy, and ``collective.py``
broadcasts weights to each engine over a process group (NCCL, gloo), across GPUs and hosts. Whoever consumes a
reference publishes ``DataReleased``; the owner then calls its stager's ``free``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles_events.util.registry import registered
from schemas.data import BucketLayout, DataRef

if TYPE_CHECKING:  # torch is imported by what puts or gets tensors, not by every reader of events
    import torch

    from miles_events.device.buckets import Buckets
    from schemas.config import Config


def _safetensors() -> Any:
    """``safetensors.torch``, imported when tensors are first put or got: a process that only
    passes references on (the driver of the ray runtime) never loads torch."""
    import safetensors.torch

    return safetensors.torch


TENSORS_METADATA = {"format": "pt"}
"""The header metadata of every safetensors file a transport writes, as Hugging Face writes
it: a staged file is a checkpoint's weights file as it is."""


@dataclass
class BucketStream:
    """The buckets of one set of weights as they arrive (``BucketReader.stream_buckets``):
    ``layouts`` at once, then ``receive`` (or ``assemble``) once, chunk by chunk. A stream
    not received is ``close``d: its reader gives up what it holds for it."""

    key: str
    layouts: tuple[BucketLayout, ...]
    _chunks: Callable[[Callable[[int, int, int], torch.Tensor]], None]
    _abandon: Callable[[], None] = lambda: None
    _done: bool = False

    def receive(self, into: Callable[[int, int, int], torch.Tensor]) -> None:
        """Receive every chunk: ``into(bucket, start, end)`` gives the uint8 tensor (any
        device) that the bucket's bytes ``[start, end)`` land in, as they land."""
        self._done = True
        self._chunks(into)

    def close(self) -> None:
        """After ``receive``, nothing; before it, the stream is given up."""
        if not self._done:
            self._done = True
            self._abandon()

    def assemble(self, device: torch.device | str = "cpu") -> Buckets:
        """Every bucket whole, in new buffers on ``device``."""
        from miles_events.device.buckets import Buckets, byte_view

        try:
            buckets = Buckets.allocate(self.layouts, device)
            views = [byte_view(buffer) for buffer in buckets.buffers]
            self.receive(lambda bucket, start, end: views[bucket][start:end])
        finally:
            self.close()
        return buckets


# --- the producer's end, by kind -------------------------------------------------------------


class BytesStager(ABC):
    @abstractmethod
    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef: ...


class BucketStager(ABC):
    @abstractmethod
    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        """Stage a copy of ``tensors``: later changes to the originals do not reach readers."""

    def put_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        """Stage tensors already packed in flat buckets (``miles_events.device.buckets``), which
        the caller hands over and no longer writes. A transport that can pass the buckets on
        as they are (in process, CUDA IPC) keeps them; the others store their tensors as
        ``put_tensors`` does, from one device-to-host copy per bucket."""
        return self.put_tensors(key, buckets.to("cpu").tensors(), owner)

    def publish_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        """Stage weights for the engines to load (a publication), as ``put_buckets`` does,
        where the transport does not send them to the engines itself (``collective`` does)."""
        return self.put_buckets(key, buckets, owner)

    def reads_of(self, ref: DataRef) -> tuple[Any, ...]:
        """What the readers of ``ref`` (this end's own buffers, not freed yet) said they
        queued (``BucketReader.done_reading``) and may still be running: events to ``query``
        before the buffers are written again. None here: every reader waited for its reads."""
        return ()


class StateStager(ABC):
    @abstractmethod
    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        """Stage a torch state (an optimizer's or the RNG's state dict: tensors, numbers and
        strings in dicts and lists), which the caller hands over and no longer writes. A
        transport that keeps files writes it with ``torch.save`` straight into its file:
        pickled into memory first, a state of a gigabyte would hold the interpreter lock for
        a second, stalling every actor thread beside the save."""


class Stager(BytesStager, BucketStager, StateStager):
    """The producer's end: stages every kind of data, and frees what it staged."""

    name: str

    @abstractmethod
    def free(self, ref: DataRef) -> None:
        """Drop the data; freeing twice is allowed."""

    def close(self) -> None:
        """Drop what this end holds (the transport's ``close`` removes the run's data)."""


# --- the consumer's end, by kind -------------------------------------------------------------


class BytesReader(ABC):
    @abstractmethod
    def get_bytes(self, ref: DataRef) -> bytes: ...


class BucketReader(ABC):
    @abstractmethod
    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]: ...

    def get_buckets(self, ref: DataRef) -> Buckets | None:
        """The buckets behind ``ref`` as staged by ``put_buckets``, where this transport keeps
        them as buckets (a reader whose own weights share their layout loads each with one
        copy); None where it does not."""
        return None

    def stream_buckets(
        self, ref: DataRef, reader: str = "", device: torch.device | None = None
    ) -> BucketStream | None:
        """``ref``'s buckets as they arrive, where this transport sends them on request
        (``collective``): their layouts at once, each piece placed where its reader says as it
        lands (``reader``: the reading engine's name, its channel's; ``device``: where it
        places them). None where the data lies in storage the reader opens itself."""
        return None

    def tensors_file(self, ref: DataRef) -> Path | None:
        """The one safetensors file holding ``ref``'s tensors, where this transport keeps
        them in one (a reader that only copies them, as the Saver, needs no torch then);
        None where it does not."""
        return None

    def done_reading(self, ref: DataRef, device: torch.device) -> None:
        """Every read of ``ref``'s data by this process is queued on ``device``'s current
        stream (a GPU's copies may still be running): its producer may write the data's
        buffers again once those have run. Here, where a producer cannot see a reader's
        GPU work, this waits for it; a transport whose producer can (``cuda_ipc``) leaves it
        queued and tells the producer what to wait for (``BucketStager.reads_of``)."""
        if device.type == "cuda":
            import torch

            torch.cuda.current_stream(device).synchronize()


class StateReader(ABC):
    @abstractmethod
    def get_state(self, ref: DataRef) -> Any:
        """The state staged by ``put_state`` (tensors on the CPU)."""

    def state_file(self, ref: DataRef) -> Path | None:
        """The ``torch.save`` file of ``ref``'s state, where this transport keeps one (a
        reader that only copies it, as the Saver, needs no torch then); None where it does
        not."""
        return None


class Reader(BytesReader, BucketReader, StateReader):
    """The consumer's end: reads every kind of data a reference names."""

    name: str

    def close(self) -> None:
        """Drop what this end keeps open."""


# --- a run's data plane ----------------------------------------------------------------------


class Transport:
    """A run's data plane: its two ends, on the same storage. The producer of data uses
    ``stager``, its consumers ``reader``; ``close`` drops everything of the run."""

    name: str

    def __init__(self, run_id: str, stager: Stager, reader: Reader) -> None:
        self.run_id = run_id
        self.stager = stager
        self.reader = reader

    @classmethod
    def open(cls, run_id: str, run_dir: Path | None = None, config: Config | None = None) -> Transport:
        """The transport of run ``run_id``, whose directory is ``run_dir``, set up as
        ``config`` says (``publisher``'s settings)."""
        return cls(run_id)  # type: ignore[call-arg]

    def close(self) -> None:
        """Drop everything of this run held by this transport."""
        self.reader.close()
        self.stager.close()


class SharedFiles(Protocol):
    """The directory two ends of a transport share (shared memory, the run's disk)."""

    @property
    def root(self) -> Path: ...

    def remove(self) -> None:
        """Remove the directory and everything in it."""


class FilesTransport(Transport):
    """A transport whose two ends share the files under ``files.root``, removed on close."""

    files: SharedFiles

    @property
    def root(self) -> Path:
        return self.files.root

    def close(self) -> None:
        super().close()
        self.files.remove()


TRANSPORTS: dict[str, str] = {
    "inprocess": "miles_events.transport.inprocess:InProcessTransport",
    "shm": "miles_events.transport.shm:ShmTransport",
    "disk": "miles_events.transport.disk:DiskTransport",
    "cuda_ipc": "miles_events.transport.cuda_ipc:CudaIpcTransport",
    "collective": "miles_events.transport.collective:CollectiveTransport",
}
"""Transport name -> ``"module:Class"``, imported when a run opens it."""


def open_transport(
    name: str, run_id: str, run_dir: Path | None = None, config: Config | None = None
) -> Transport:
    cls: type[Transport] = registered(TRANSPORTS, name, "transport")
    return cls.open(run_id, run_dir, config)
