"""Device-to-host copies that overlap the GPU's work: pinned memory and a copy stream.

A save staged in the background copies the train state to the host while the trainer
goes on. Copied with ``.cpu()`` on the trainer's stream, each copy would wait for every
kernel queued before it and hold back every kernel queued after it. Here the copies run on
a stream of their own that waits only for the point where the state was captured
(``capture_point``), into pinned host memory, so the DMA engines move the bytes while the
next step computes.

The pinned memory is pinned once and reused (``PinnedPool``): pinning stalls every CUDA
call of the process for as long as it takes, seconds for a train state; into memory pinned
before, a copy costs the work beside it about the copy's own time
(``bench/gpu/save_overlap.py``). Copies into pageable memory stall the work beside them
as long as pinning would, at a fraction of the rate. Most of pinning is allocating and
zeroing the pages, faulted in one by one: an arena's memory is one block (``HostBlock``) whose pages
the kernel allocates first, in a memory file outside this process's address space, then
mapped (``_populate``) and registered with CUDA. Work beside it then loses the
registration (the driver holds the process's CUDA calls meanwhile) and a small part of the
mapping, where ``cudaHostAlloc`` would cost it the whole allocation (``bench/gpu/pinning.py``).

While a save's copy to the host runs, any other transfer to the host on the same GPU (a
loss read with ``.item()``, a fingerprint's result) waits until the copy's stream has
nothing queued: whether the copy is queued whole or in chunks kept two in flight, and
whether the read goes to pageable or pinned memory, the reads beside it wait for the whole
copy; a loop that only waits for its stream is barely slowed. So the copies are queued a
chunk at a time (``CHUNK_BYTES``), each waited for before the next is queued: between two
chunks the other transfers go.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from miles_events.device.buckets import Buckets

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 32 << 20
"""The bytes a host copy queues on a copy stream at a time, each chunk waited for before
the next is queued: another transfer to the host waits for one chunk at most."""


logger = logging.getLogger(__name__)

ALIGN = 4096
"""Where each tensor of a block starts: a multiple of this many bytes."""


def capture_point(device: torch.device) -> torch.cuda.Event | None:
    """An event at the current point of ``device``'s stream (None off CUDA): what a later
    ``copy_to_host`` waits for."""
    import torch

    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


POPULATE_BYTES = 16 << 20
"""The bytes of a block whose page tables are filled in one call (``_populate``)."""

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux's advice (5.14 and later) to fill a range's page tables, writable, now."""


def _mapped(num_bytes: int) -> mmap.mmap:
    """``num_bytes`` of zeroed memory, mapped: an anonymous memory file (``memfd_create``,
    not counted against /dev/shm's size) given its pages by ``posix_fallocate`` (the kernel
    allocates and zeroes them without touching this process's address space), mapped with
    its page tables filled (``_populate``) and not inherited by a forked child (as the
    driver's own pinned memory is not); anonymous memory, faulted in as it is touched, where
    that fails."""
    try:
        fd = os.memfd_create("host-block", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as error:  # not Linux
        return _anonymous(num_bytes, error)
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        mapped = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED)
    except OSError as error:  # out of memory for it
        return _anonymous(num_bytes, error)
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_DONTFORK"):
        mapped.madvise(mmap.MADV_DONTFORK)
    _populate(mapped, num_bytes)
    return mapped


def _populate(mapped: mmap.mmap, num_bytes: int) -> None:
    """Fill the page tables of ``mapped`` a ``POPULATE_BYTES`` range at a time, through
    libc's ``madvise`` called by ctypes, which lets go of the GIL meanwhile (``mmap.madvise``
    holds it, and work beside the mapping loses more than with one call). Filled in one call
    (``MAP_POPULATE``), they hold the process's memory-map lock for the whole block, and
    every other thread that maps or unmaps memory (Python's allocator, the CUDA driver)
    waits that long. Where the kernel has no such advice, the
    registration with CUDA fills them instead."""
    madvise = _libc().madvise
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    for start in range(0, num_bytes, POPULATE_BYTES):
        if madvise(address + start, min(POPULATE_BYTES, num_bytes - start), MADV_POPULATE_WRITE) != 0:
            _say_unpopulated(os.strerror(ctypes.get_errno()))
            return


@functools.cache
def _say_unpopulated(why: str) -> None:
    """Log, once a process for each reason, that blocks are mapped as first touched."""
    logger.info("a save's host memory is mapped as it is first touched (%s)", why)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _anonymous(num_bytes: int, why: BaseException) -> mmap.mmap:
    logger.info("a save's host memory is allocated as it is first written (%s)", why)
    return mmap.mmap(-1, num_bytes)


HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the memory is pinned for every device's copies."""


def _unregister(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


class HostBlock:
    """Zeroed host memory for the tensors of an arena, one mapping (``_mapped``), registered
    with CUDA (pinned) when ``pin`` until this object is collected; each tensor a storage of
    its own within it (``tensor``), which keeps the mapping alive. The mapping is never
    closed by hand: it goes when the block and its last tensor do."""

    def __init__(self, num_bytes: int, pin: bool) -> None:
        import torch

        self.num_bytes = max(num_bytes, 1)
        self._map = _mapped(self.num_bytes)
        self.address = torch.frombuffer(self._map, dtype=torch.uint8).data_ptr()
        if pin:
            error = int(
                torch.cuda.cudart().cudaHostRegister(self.address, self.num_bytes, HOST_REGISTER_PORTABLE)
            )
            if error != 0:
                raise RuntimeError(
                    f"pinning {self.num_bytes} bytes of host memory failed: CUDA error {error}"
                )
            # Unpinned before the mapping can go: tensors of it that outlive this object stay
            # valid, as ordinary memory. The process's end frees it either way.
            weakref.finalize(self, _unregister, self.address).atexit = False

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset).view(shape)


def block_offsets(signature: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Where each tensor of ``signature`` starts in a block (``ALIGN``-aligned), and the
    block's bytes."""
    offsets, end = [], 0
    for shape, dtype in signature:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return offsets, end


Signature = tuple[tuple[tuple[int, ...], "torch.dtype"], ...]
"""An arena's tensors' shapes and dtypes, in order."""


class PinnedArena:
    """Host memory for one save's copies: a pinned tensor for each tensor copied, handed out
    in the order they are asked for (``carve``). Each is a storage of its own: ``torch.save``
    writes a view's whole storage, so copies that were views of one shared buffer would carry
    each other's bytes into every file they are saved in. ``block``: the memory they are in,
    kept pinned while the arena lives."""

    def __init__(self, tensors: list[torch.Tensor], block: HostBlock | None = None) -> None:
        self.tensors = tensors
        self.block = block
        self._next = 0

    @property
    def signature(self) -> Signature:
        return _signature(self.tensors)

    def carve(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor of ``tensor``'s shape and dtype: the next one."""
        host = self.tensors[self._next]
        if host.shape != tensor.shape or host.dtype != tensor.dtype:
            raise ValueError(
                f"the arena's tensor {self._next} is {tuple(host.shape)} {host.dtype}, "
                f"asked for {tuple(tensor.shape)} {tensor.dtype}"
            )
        self._next += 1
        return host

    def reset(self) -> None:
        self._next = 0


class PinnedPool:
    """Pinned arenas, each pinned once, for as many saves as are staged at a time: ``take``
    one for the tensors (an idle one of the same shapes and dtypes, else a new one, pinned
    now), ``give_back`` it when what was copied into it has been written (the Saver
    released it). ``reserve`` and ``prepare`` pin one ahead of the save that takes it; a
    ``take`` meanwhile waits for it. Once a state of other shapes is taken (its shapes
    changed), the idle arenas of the old ones are dropped, and their memory with them."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._lock = threading.Condition()  # taken on a staging thread, given back on the loop
        self._idle: list[PinnedArena] = []
        self._preparing: set[Signature] = set()
        """The signatures of the arenas reserved and not yet pinned (``prepare``)."""
        self._last_taken: Signature | None = None
        self._closed = False
        self.num_pinned = 0
        """Arenas pinned so far (each a stall of the GPU while it was pinned)."""

    def reserve(self, tensors: list[torch.Tensor]) -> Signature | None:
        """Claim an arena for tensors of these shapes and dtypes, to be pinned by ``prepare``
        (on another thread: pinning stalls every CUDA call of the process, ``HostBlock``); a
        ``take`` of them from now on waits for it. None where one is idle or claimed
        already, or where a state was taken already (the saves pin their own)."""
        signature = _signature(tensors)
        with self._lock:
            if self._closed or self._last_taken is not None or signature in self._preparing:
                return None
            if any(arena.signature == signature for arena in self._idle):
                return None
            self._preparing.add(signature)
            self.num_pinned += 1
        return signature

    def prepare(self, signature: Signature) -> None:
        """Pin the arena ``reserve`` claimed, idle until a ``take`` asks for it; dropped
        where the pool was closed, or a state of other shapes was taken, meanwhile."""
        try:
            arena = self._arena(signature)
        except BaseException:
            with self._lock:
                self.num_pinned -= 1
                self._preparing.discard(signature)
                self._lock.notify_all()
            raise
        with self._lock:
            self._preparing.discard(signature)
            if not self._closed and self._last_taken in (None, signature):
                self._idle.append(arena)
            self._lock.notify_all()

    def take(self, tensors: list[torch.Tensor]) -> PinnedArena:
        signature = _signature(tensors)
        with self._lock:
            self._last_taken = signature
            while True:
                for arena in self._idle:
                    if arena.signature == signature:
                        self._idle.remove(arena)
                        arena.reset()
                        return arena
                if signature not in self._preparing:
                    break
                self._lock.wait()
            self._idle.clear()  # of other shapes: not taken again
            self.num_pinned += 1
        return self._arena(signature)

    def close(self) -> None:
        """Drop the idle arenas; one being prepared is dropped once pinned."""
        with self._lock:
            self._closed = True
            self._idle.clear()

    def give_back(self, arena: PinnedArena) -> None:
        with self._lock:
            self._idle.append(arena)

    def _arena(self, signature: Signature) -> PinnedArena:
        """A new arena for tensors of ``signature``: one host block, pinned when ``pin``."""
        offsets, num_bytes = block_offsets(signature)
        block = HostBlock(num_bytes, self.pin)
        return PinnedArena(
            [
                block.tensor(offset, shape, dtype)
                for offset, (shape, dtype) in zip(offsets, signature, strict=True)
            ],
            block,
        )


class DeviceArenaPool(PinnedPool):
    """Arenas of memory on ``device`` rather than the host's: for the copies a background
    save takes where the state lives, made at the first save and reused by every later one
    once on the host, as a publication's staging buffers are, rather than allocated again at
    each save (3.6 GB for a 0.5B model and its AdamW state, which training may have taken
    over from the caching allocator meanwhile)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(pin=False)
        self.device = device

    def give_back(self, arena: PinnedArena) -> None:
        """Kept for the next save, as the only idle arena: device memory is not held for
        saves that overlapped or for a state's earlier shapes."""
        with self._lock:
            self._idle = [arena]

    def _arena(self, signature: Signature) -> PinnedArena:
        import torch

        return PinnedArena(
            [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in signature]
        )


def _signature(tensors: list[torch.Tensor]) -> Signature:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def copy_to_host(
    obj: Any, after: torch.cuda.Event | None = None, pool: PinnedPool | None = None
) -> tuple[Any, PinnedArena | None]:
    """``obj`` (tensors in dicts, lists and tuples, and ``Buckets``) with every CUDA tensor
    copied into pinned host memory, on a copy stream that first waits for ``after``, and the
    arena of ``pool`` the copies live in (for ``pool.give_back`` once they are no longer
    read; None where nothing was copied). Without a pool, the memory is pinned now.

    Returns once the copies are done; the wait releases the GIL. The CUDA tensors must not
    be written between ``after`` and the return (copies of them, taken at ``after``, are
    what a caller passes). CPU tensors and everything else come back as they are.
    """
    import torch

    cuda = [t for t in tensors_of(obj) if t.is_cuda]
    if not cuda:
        return obj, None
    arena = (pool or PinnedPool()).take(cuda)
    streams = {device: torch.cuda.Stream(device) for device in {t.device for t in cuda}}
    for stream in streams.values():
        if after is not None:
            stream.wait_event(after)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host, source) in copy order

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_cuda:
            return tensor
        host = arena.carve(tensor)
        pairs.append((host, tensor.detach()))
        return host

    copied = map_tensors(obj, to_host)
    # A tensor that cannot be viewed flat is copied whole, as one piece of its size.
    pieces = [
        (s.numel(), s.element_size()) if s.is_contiguous() else (1, s.numel() * s.element_size())
        for _, s in pairs
    ]
    try:
        for chunk in plan_chunks(pieces, CHUNK_BYTES):
            used = set()
            for index, start, end in chunk:
                host, source = pairs[index]
                with torch.cuda.stream(streams[source.device]):
                    if source.is_contiguous():
                        host.view(-1)[start:end].copy_(source.view(-1)[start:end], non_blocking=True)
                    else:
                        host.copy_(source, non_blocking=True)
                used.add(source.device)
            for device in used:  # the copy stream drained: other transfers go before the next chunk
                streams[device].synchronize()
    finally:  # nothing queued still reads the sources when this returns or raises
        for stream in streams.values():
            stream.synchronize()
    return copied, arena


def plan_chunks(pieces: Sequence[tuple[int, int]], chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Tensors of ``pieces`` (elements, bytes an element) in chunks of at most
    ``chunk_bytes`` (at least one element), in order: each chunk the ranges (tensor's index,
    first element, end) it copies, a tensor larger than a chunk's room split across chunks."""
    chunks: list[list[tuple[int, int, int]]] = []
    chunk: list[tuple[int, int, int]] = []
    room = chunk_bytes
    for index, (numel, size) in enumerate(pieces):
        start = 0
        while start < numel:
            take = min(numel - start, max(room, 0) // size)
            if take == 0 and chunk:  # no room for an element: the next chunk
                chunks.append(chunk)
                chunk, room = [], chunk_bytes
                continue
            take = max(take, 1)
            chunk.append((index, start, start + take))
            start += take
            room -= take * size
    if chunk:
        chunks.append(chunk)
    return chunks


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it: dicts, lists and tuples walked,
    ``Buckets`` buffer by buffer; anything else as it is."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Buckets):
        return Buckets(obj.layouts, tuple(fn(buffer) for buffer in obj.buffers))
    if isinstance(obj, dict):
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(value, fn) for value in obj)
    return obj


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, in the order ``map_tensors`` visits them."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(obj, collect)
    return found
