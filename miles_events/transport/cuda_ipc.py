"""The ``cuda_ipc`` transport: weights staged on a GPU, read by other processes of the same
host through CUDA IPC handles, without a copy (the colocated path of slime and miles).

``put_buckets`` keeps the trainer's flat buckets (``miles_events.device.buckets``) alive in the
producer's process and writes, under the run's shared-memory directory, one small record:
each buffer's layout and the handle torch's own reduction of a CUDA tensor gives
(``torch.multiprocessing.reductions``). A reader opens the buffers from that record and
copies what it needs; the producer frees them when the reference is freed (the next
publication, ``DataReleased`` or the run's end), and torch's IPC reference counting keeps
the memory from being reused while a reader still maps it.

Opening a handle maps the producer's memory into the reader, and the mapping goes when the
last tensor of it does; decoding a record's layouts (a few hundred tensors) costs about as
much again. On a GPU each is a sizeable part of the copy that follows. The trainer stages each publication into the buffers of an earlier
one, once its readers are done (``miles_events.device.staging``), so the producer shares each
buffer once, while it lives, and a reader keeps the buffers it opened last
(``OPEN_BUFFERS``) and the buckets of the records it read last (``OPEN_RECORDS``): the next
publication's record is the same bytes (the producer links the file it wrote for those
buffers under the new key: one call), and the reader copies from the mapping it has.
Torch counts a reader per share; a buffer shared anew that a reader has mapped already is
released by it at once, as torch's own rebuild of a cached handle does.

The producer need not wait on the host for its staging before it shares it:
``put_buckets`` records an interprocess CUDA event behind the staging on the producer's
stream and names it in the record, and ``get_buckets`` makes the reader's current stream
wait for it, so the reader's copy is queued at once and runs on the GPU right behind the
staging (``bench/gpu/publication.py`` measures a producer that shares at once; the trainer reads its staging's fingerprints and finiteness back
before it shares, so it has waited for the staging anyway).

Nor need a reader wait on the host for its copies before it says it is done with the
buffers: ``done_reading`` records the reader's own interprocess event behind them and
links a receipt naming it beside the record (``<key>.cuda-ipc.read-<pid>-<device>``), and
the producer, told the reader is done, gets the events of every receipt of the key
(``reads_of``) and writes the buffers again only once they have run
(``miles_events.device.staging``), never where an event cannot be opened (``UnknownRead``).
``TorchEngine.load_weights`` returns with its copies queued, and what the engine runs next
runs behind them on its stream; in a run the engine reports the load once it has read back
the fingerprints of what it serves, so its copies have run by then anyway. The receipts of
a key go when it is freed, with those of keys freed before a reader linked its receipt.

The two ends keep apart what each side holds: ``CudaIpcStager`` the producer's buffers,
records, shares and ready event, and the readers' events it opened; ``CudaIpcReader`` the
buffers and records it opened, the keys it is reading, its read event and the producers'
ready events it opened. Everything that is not a set of GPU buckets (rollout batches, train
state for the Saver, CPU weights) each end passes to the shared-memory end it holds
(``miles_events.transport.shm``), on the same directory.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from miles_events.transport.base import FilesTransport, Reader, Stager
from miles_events.transport.shm import ShmFiles, ShmReader, ShmStager
from schemas.data import BucketLayout, CudaIpcBuffer, CudaIpcRecord, DataRef

if TYPE_CHECKING:
    import torch

    from miles_events.device.buckets import Buckets

RECORD_SUFFIX = ".cuda-ipc"
"""The record of key ``k`` is the shared-memory file ``k.cuda-ipc``."""

_DECODER = msgspec.msgpack.Decoder(CudaIpcRecord)

OPEN_BUFFERS = 8
"""Buffers a reader keeps mapped after its last read of them, the least recently read
unmapped first: the buckets (one per dtype, and the canary's) of a few publications."""
OPEN_RECORDS = 2
"""Records a reader keeps read (and their buffers mapped) after its last read of them."""
READ_SUFFIX = ".read-"
"""A reader's receipt for key ``k`` is ``k.cuda-ipc.read-<pid>-<device>``: the IPC handle of
its read event, recorded behind its copies (``done_reading``)."""
READING = 16
"""Keys a reader remembers reading until it says it is done (a key forgotten is waited for
on the host by ``done_reading``)."""
OPEN_READ_EVENTS = 64
"""Readers' events a producer keeps open (one per reader process and device)."""


def share(buffer: torch.Tensor, layout: BucketLayout) -> CudaIpcBuffer:
    """The IPC handle of a whole CUDA ``buffer`` (a bucket laid out as ``layout``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (
        _,
        _,
        _,
        tensor_offset,
        _,
        _,
        device,
        handle,
        size_bytes,
        offset_bytes,
        _,
        counter,
        counter_offset,
        event,
        sync,
    ) = args
    return CudaIpcBuffer(
        layout=layout,
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        tensor_offset=int(tensor_offset),
        ref_counter_handle=bytes(counter),
        ref_counter_offset=int(counter_offset),
        event_handle=None if event is None else bytes(event),
        event_sync_required=bool(sync),
    )


def open_shared(shared: CudaIpcBuffer) -> torch.Tensor:
    """The producer's buffer, mapped into this process (torch caches the mapping while any
    tensor of it lives)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, shared.layout.dtype)
    mapped: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([shared.layout.numel]),
        (1,),
        shared.tensor_offset,
        torch.storage.TypedStorage,
        dtype,
        shared.device,
        shared.handle,
        shared.storage_size_bytes,
        shared.storage_offset_bytes,
        False,
        shared.ref_counter_handle,
        shared.ref_counter_offset,
        shared.event_handle,
        shared.event_sync_required,
    )
    return mapped


class UnknownRead:
    """A reader's read event that could not be opened (``reads_of``): whether its copies ran
    cannot be told, so ``query`` raises and the buffers are never written again."""

    def __init__(self, why: str) -> None:
        self.why = why

    def query(self) -> bool:
        raise RuntimeError(f"a reader's read event could not be opened: {self.why}")


def _receipt_prefix(key: str) -> str:
    """What the name of every reader's receipt for ``key`` starts with."""
    return f"{key}{RECORD_SUFFIX}{READ_SUFFIX}"


def _release_counter(shared: CudaIpcBuffer) -> None:
    """Tell the producer this process holds no reference from ``shared``'s share."""
    import torch

    torch.UntypedStorage._release_ipc_counter_cuda(shared.ref_counter_handle, shared.ref_counter_offset)


def _record_name() -> str:
    """A hidden name for a record file that no other producer of the run's directory picks."""
    return f".record-{os.getpid()}-{secrets.token_hex(8)}{RECORD_SUFFIX}"


def _link_or_copy(record: Path, path: Path) -> None:
    """``path`` made a link to ``record``, or a copy of its bytes where the filesystem has no
    hard links."""
    path.unlink(missing_ok=True)  # left by an earlier attempt that failed
    try:
        os.link(record, path)
    except FileNotFoundError:
        raise
    except OSError:
        path.write_bytes(record.read_bytes())


def _keep_recent(cache: OrderedDict, key: object, value: object, limit: int) -> list:  # type: ignore[type-arg]
    """``cache[key] = value`` as its most recent entry, dropping the least recent beyond
    ``limit``; the values dropped."""
    cache[key] = value
    cache.move_to_end(key)
    dropped = []
    while len(cache) > limit:
        dropped.append(cache.popitem(last=False)[1])
    return dropped


def _new_record_name() -> str:
    return _record_name()  # looked up at each call


class InterprocessEvents:
    """This process's own interprocess CUDA event per device, with its IPC handle: one
    end's ready events (recorded behind each staging) or read events (behind each read's
    copies). One for all keys: a reader of an earlier key waits for the latest, which is
    only stricter as long as every staging (every read) on the device is queued on one
    stream."""

    def __init__(self) -> None:
        self._events: dict[int | None, tuple[torch.cuda.Event, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> tuple[torch.cuda.Event, bytes]:
        """The event on ``device`` and its IPC handle, created at the first call."""
        import torch

        with self._lock:
            known = self._events.get(device.index)
            if known is None:
                with torch.cuda.device(device):
                    event = torch.cuda.Event(interprocess=True)
                    event.record(torch.cuda.current_stream(device))  # created by its first record
                    known = (event, bytes(event.ipc_handle()))
                self._events[device.index] = known
        return known

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


class CudaIpcStager(Stager):
    """The producer's end: GPU buckets kept alive and shared by a record; everything else
    staged by the shared-memory end it holds."""

    name = "cuda_ipc"

    def __init__(self, files: ShmFiles) -> None:
        self.files = files
        self.shm = ShmStager(files, name=self.name)
        self._held: dict[str, Buckets] = {}
        """The buckets this process staged, by key, alive until freed."""
        self.ready = InterprocessEvents()
        """The ready event recorded behind each staging (``_record_ready``)."""
        self._written: OrderedDict[tuple[CudaIpcBuffer, ...], Path] = OrderedDict()
        """The last records this process wrote, by what they share: each a hidden file of
        the run's directory, linked under the key of every publication that shares the same
        buffers (readers find the bytes they read before)."""
        self._written_lock = threading.Lock()
        self._shared: dict[int, tuple[weakref.ref[torch.Tensor], CudaIpcBuffer]] = {}
        """How each buffer this process shared was shared, by ``id`` while it lives."""
        self._opened_reads: OrderedDict[bytes, torch.cuda.Event] = OrderedDict()
        """Readers' read events this process opened, by handle."""

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], owner: str) -> DataRef:
        return self.shm.put_tensors(key, tensors, owner)

    def put_bytes(self, key: str, data: bytes, owner: str) -> DataRef:
        return self.shm.put_bytes(key, data, owner)

    def put_state(self, key: str, state: Any, owner: str) -> DataRef:
        return self.shm.put_state(key, state, owner)

    def put_buckets(self, key: str, buckets: Buckets, owner: str) -> DataRef:
        if buckets.device.type != "cuda":
            return self.shm.put_buckets(key, buckets, owner)
        ready_event = self._record_ready(buckets.device)
        shared = tuple(
            self._share(b, layout) for layout, b in zip(buckets.layouts, buckets.buffers, strict=True)
        )
        with self._written_lock:  # a record is not dropped between its lookup and its link
            # Buffers staged into again are named by the record written for them before.
            written = self._written.pop(shared, None)
            if written is not None:
                try:
                    self._link_record(written, key + RECORD_SUFFIX)
                except FileNotFoundError:  # removed under this process: written again
                    written.unlink(missing_ok=True)  # where the key's file was what went
                    written = None
            if written is None:
                data = msgspec.msgpack.encode(CudaIpcRecord(shared, ready_event=ready_event))
                written = self.files.write_hidden(data, _new_record_name)
                self._link_record(written, key + RECORD_SUFFIX)
            for dropped in _keep_recent(self._written, shared, written, OPEN_RECORDS):
                dropped.unlink(missing_ok=True)
        self._held[key] = buckets
        return DataRef(self.name, key, owner, buckets.num_bytes)

    def held(self, key: str) -> Buckets | None:
        """The buckets this process staged under ``key`` and holds (a reader in the same
        process cannot open its own handles: it reads them as they are)."""
        return self._held.get(key)

    def _link_record(self, written: Path, name: str) -> None:
        """Publish the record ``written`` under ``name``: a link to it (one call, where
        writing a file anew is five), replacing what the name held."""
        final = self.files.path(name)
        try:
            os.link(written, final)
            return
        except FileExistsError:
            if os.path.samefile(written, final):  # the same record put again under the same key
                return
        except FileNotFoundError:
            raise
        except OSError:  # no hard links on this filesystem
            pass
        self.files.publish(name, lambda partial: _link_or_copy(written, partial))

    def reads_of(self, ref: DataRef) -> tuple[torch.cuda.Event | UnknownRead, ...]:
        """The read events of every receipt of ``ref`` (a key this process staged and holds),
        opened once each."""
        import torch

        held = self._held.get(ref.key)
        if held is None or held.device.type != "cuda":
            return ()
        events: list[torch.cuda.Event | UnknownRead] = []
        for receipt in self._receipts(ref.key):
            try:
                handle = receipt.read_bytes()
            except FileNotFoundError:
                continue
            event = self._opened_reads.get(handle)
            if event is None:
                try:
                    event = torch.cuda.Event.from_ipc_handle(held.device, handle)
                except RuntimeError as error:  # nobody can say whether its copies ran
                    events.append(UnknownRead(str(error)))
                    continue
            _keep_recent(self._opened_reads, handle, event, OPEN_READ_EVENTS)
            events.append(event)
        return tuple(events)

    def _receipts(self, key: str) -> list[Path]:
        """The readers' receipts for ``key`` in the run's directory."""
        prefix = _receipt_prefix(key)
        try:
            with os.scandir(self.files.root) as entries:
                return [Path(entry.path) for entry in entries if entry.name.startswith(prefix)]
        except FileNotFoundError:
            return []

    def _record_ready(self, device: torch.device) -> bytes:
        """Record this process's ready event behind what is queued on ``device``'s current
        stream (the staging), and return its IPC handle: readers copy from the buffers as
        soon as they hear of them, their streams waiting for it (no host sync)."""
        import torch

        ready, handle = self.ready.get(device)
        ready.record(torch.cuda.current_stream(device))
        return handle

    def _share(self, buffer: torch.Tensor, layout: BucketLayout) -> CudaIpcBuffer:
        """``share``, once per buffer while it lives: a buffer staged again (the staging pool
        reuses them) is named by the same record, which its readers have open already."""
        known = self._shared.get(id(buffer))
        if known is None or known[0]() is not buffer:
            known = (weakref.ref(buffer), share(buffer, layout))
            self._shared[id(buffer)] = known
            weakref.finalize(buffer, self._shared.pop, id(buffer), None)
        return known[1] if known[1].layout == layout else msgspec.structs.replace(known[1], layout=layout)

    def free(self, ref: DataRef) -> None:
        self._held.pop(ref.key, None)
        self.files.path(ref.key + RECORD_SUFFIX).unlink(missing_ok=True)
        self._remove_receipts(ref.key)
        self.shm.free(ref)

    def _remove_receipts(self, key: str) -> None:
        """Remove ``key``'s receipts, and those of keys whose record is gone (a reader's
        receipt linked after its key was freed)."""
        marker = _receipt_prefix("")
        try:
            with os.scandir(self.files.root) as entries:
                names = [entry.name for entry in entries]
        except FileNotFoundError:
            return
        present = set(names)
        for name in names:
            owner, found, _ = name.partition(marker)
            if found and not name.startswith(".") and (owner == key or owner + RECORD_SUFFIX not in present):
                (self.files.root / name).unlink(missing_ok=True)

    def close(self) -> None:
        self._held.clear()
        self._shared.clear()
        self._opened_reads.clear()
        self._written.clear()
        self.ready.clear()


class CudaIpcReader(Reader):
    """The consumer's end: GPU buckets opened from a record (and kept mapped), a receipt
    left for the producer when done; everything else read by the shared-memory end it
    holds. ``local`` is the producer's end of this process, whose buckets are read as
    they are."""

    name = "cuda_ipc"

    def __init__(self, files: ShmFiles, local: CudaIpcStager | None = None) -> None:
        self.files = files
        self.shm = ShmReader(files)
        self.local = local
        self._records: OrderedDict[bytes, tuple[Buckets, torch.cuda.Event | None]] = OrderedDict()
        """The buckets (and the producer's ready event) of the last records read, by the
        record's bytes."""
        self._opened: OrderedDict[tuple[bytes, int, int], tuple[torch.Tensor, tuple[bytes, int]]] = (
            OrderedDict()
        )
        """Buffers of other processes this one read, kept mapped, by (handle, offset, bytes),
        with the reference counter of the share they were opened from."""
        self._opened_events: OrderedDict[bytes, torch.cuda.Event] = OrderedDict()
        """Other processes' ready events this one opened, by handle."""
        self.reads = InterprocessEvents()
        """The read event recorded behind each read's copies (``done_reading``)."""
        self._reading: OrderedDict[str, bool] = OrderedDict()
        """The last keys this process read from another's buffers and is not done reading
        (``READING``)."""
        self._read_handles: dict[int | None, Path] = {}
        """The hidden file holding each read event's handle, linked as every receipt."""
        self._reading_lock = threading.Lock()  # guards _reading and _read_handles

    def get_bytes(self, ref: DataRef) -> bytes:
        return self.shm.get_bytes(ref)

    def get_state(self, ref: DataRef) -> Any:
        return self.shm.get_state(ref)

    def state_file(self, ref: DataRef) -> Path:
        return self.shm.state_file(ref)

    def tensors_file(self, ref: DataRef) -> Path | None:
        return self.shm.tensors_file(ref)

    def get_tensors(self, ref: DataRef) -> dict[str, torch.Tensor]:
        buckets = self.get_buckets(ref)
        return buckets.tensors() if buckets is not None else self.shm.get_tensors(ref)

    def get_buckets(self, ref: DataRef) -> Buckets | None:
        from miles_events.device.buckets import Buckets

        held = self.local.held(ref.key) if self.local is not None else None
        if held is not None:  # the producer's own process cannot open its own handles
            assert self.local is not None
            self._wait_ready(self.local.ready.get(held.device)[0], held.device)
            return held
        path = self.files.path(ref.key + RECORD_SUFFIX)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        # A publication staged into buffers shared before has the same record as theirs:
        # the buckets read then (decoding the layouts of a few hundred tensors costs more
        # than the rest of the read).
        known = self._records.get(data)
        if known is None:
            record = _DECODER.decode(data)
            buckets = Buckets(
                tuple(b.layout for b in record.buffers), tuple(self._open(b) for b in record.buffers)
            )
            ready = (
                None if record.ready_event is None else self._open_event(record.ready_event, buckets.device)
            )
            known = (buckets, ready)
        _keep_recent(self._records, data, known, OPEN_RECORDS)
        buckets, ready = known
        if ready is not None:
            self._wait_ready(ready, buckets.device)
        with self._reading_lock:  # engines of one process may load on threads of their own
            _keep_recent(self._reading, ref.key, True, READING)
        return buckets

    def done_reading(self, ref: DataRef, device: torch.device) -> None:
        """Record this process's read event behind the copies queued on ``device``'s current
        stream and link a receipt naming it beside the key's record, for the producer
        (``CudaIpcStager.reads_of``); no host sync. The producer's own process, and a reader
        of anything but another process's GPU buckets, waits as every transport does, and
        so does a reader whose receipt cannot be written."""
        import torch

        with self._reading_lock:
            read_here = self._reading.pop(ref.key, False)
        if not read_here or device.type != "cuda":
            super().done_reading(ref, device)
            return
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        read, handle = self.reads.get(device)
        read.record(torch.cuda.current_stream(device))
        try:
            with self._reading_lock:
                hidden = self._read_handles.get(device.index)
                if hidden is None:
                    hidden = self._read_handles[device.index] = self.files.write_hidden(
                        handle, _new_record_name
                    )
            # Linked under a partial name and renamed: a key read again keeps a receipt.
            receipt = _receipt_prefix(ref.key) + f"{os.getpid()}-{device.index}"
            self.files.publish(receipt, lambda partial: _link_or_copy(hidden, partial))
        except OSError:  # the run's directory emptied under this process, or full
            torch.cuda.current_stream(device).synchronize()

    def _open_event(self, handle: bytes, device: torch.device) -> torch.cuda.Event:
        """The producer's event ``handle`` names, opened once."""
        import torch

        event = self._opened_events.get(handle)
        if event is None:
            event = torch.cuda.Event.from_ipc_handle(device, handle)
            _keep_recent(self._opened_events, handle, event, OPEN_RECORDS)
        return event

    @staticmethod
    def _wait_ready(event: torch.cuda.Event, device: torch.device) -> None:
        """Make this thread's stream on ``device`` wait, on the GPU, for ``event``."""
        import torch

        torch.cuda.current_stream(device).wait_event(event)

    def _open(self, shared: CudaIpcBuffer) -> torch.Tensor:
        """The buffer ``shared`` names, mapped by ``open_shared`` at its first read and kept
        for later reads (a mapping costs a sizeable part of a copy of the bytes)."""
        key = (shared.handle, shared.storage_offset_bytes, shared.storage_size_bytes)
        counter = (shared.ref_counter_handle, shared.ref_counter_offset)
        known = self._opened.get(key)
        if known is None:
            buffer = open_shared(shared)
        else:
            buffer, opened_from = known
            if (
                tuple(buffer.shape) != (shared.layout.numel,)
                or str(buffer.dtype) != f"torch.{shared.layout.dtype}"
            ):
                buffer = open_shared(shared)  # another view of the same memory (torch counts the share)
            elif counter != opened_from:
                # Shared again by its producer: torch counts a reader per share, and this
                # one is done with the new share at once (torch's own rebuild does the same).
                _release_counter(shared)
            counter = opened_from
        _keep_recent(self._opened, key, (buffer, counter), OPEN_BUFFERS)
        return buffer

    def close(self) -> None:
        self._opened_events.clear()
        with self._reading_lock:
            self._reading.clear()
            self._read_handles.clear()
        self._records.clear()
        self._opened.clear()
        self.reads.clear()


class CudaIpcTransport(FilesTransport):
    name = "cuda_ipc"
    stager: CudaIpcStager
    reader: CudaIpcReader

    def __init__(self, run_id: str, root: Path | None = None) -> None:
        self.files = ShmFiles(run_id, root)
        stager = CudaIpcStager(self.files)
        super().__init__(run_id, stager, CudaIpcReader(self.files, local=stager))
