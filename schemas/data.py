"""References to bulk data. Events are small: batches and weights travel through a
transport and the event carries this handle."""

from __future__ import annotations

import msgspec


class DataRef(msgspec.Struct, frozen=True):
    transport: str
    """Which transport holds the data: ``"inprocess"``, ``"shm"``, ``"disk"``, ``"cuda_ipc"``
    or ``"collective"``."""
    key: str
    """The transport's name for it; unique within a run."""
    owner: str
    """The actor that created it and frees it on ``DataReleased``."""
    num_bytes: int = 0
    address: str = ""
    """Where the owner sends the data from on request (``"collective"``: ``host:port`` of its
    rendezvous store); empty where the data lies in storage a reader opens itself."""


class TensorSlot(msgspec.Struct, frozen=True, array_like=True):
    """Where one tensor lies in a flat bucket: ``numel`` elements from element ``offset``,
    viewed as ``shape``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class BucketLayout(msgspec.Struct, frozen=True, cache_hash=True):
    """One flat buffer of one dtype (``"bfloat16"``, torch's name without ``torch.``)
    holding ``slots`` in order, each starting at a 256-byte boundary; the bytes between
    slots are zero."""

    dtype: str
    numel: int
    slots: tuple[TensorSlot, ...]


class CudaIpcBuffer(msgspec.Struct, frozen=True):
    """A bucket's buffer as CUDA IPC shares it (the fields of torch's own reduction of a
    CUDA tensor, ``torch.multiprocessing.reductions.reduce_tensor``): another process on the
    same host opens the producer's memory with it, without a copy."""

    layout: BucketLayout
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class CudaIpcRecord(msgspec.Struct, frozen=True):
    """What the ``cuda_ipc`` transport writes for a set of staged weights: one entry a
    bucket. The producer keeps the buffers alive until the reference is freed."""

    buffers: tuple[CudaIpcBuffer, ...]
    ready_event: bytes | None = None
    """The IPC handle of an interprocess CUDA event the producer records on its stream once
    the buffers are written: a reader's stream waits for it before reading them, so the
    producer need not wait on the host. None: the buffers were written before the record was."""
