"""Device-to-host copies that overlap the GPU's work: pinned memory and a copy stream.

A save staged in the background copies the train state to the host while the trainer
goes on. Copied with ``.cpu()`` on the trainer's stream, each copy would wait for every
kernel queued before it and hold back every kernel queued after it. Here the copies run on
a stream of their own that waits only for the point where the state was captured
(``capture_point``), into pinned host memory, so the DMA engines move the bytes while the
next step computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles_events.rl.buckets import Buckets

if TYPE_CHECKING:
    import torch


def capture_point(device: torch.device) -> torch.cuda.Event | None:
    """An event at the current point of ``device``'s stream (None off CUDA): what a later
    ``copy_to_host`` waits for."""
    import torch

    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_to_host(obj: Any, after: torch.cuda.Event | None = None) -> Any:
    """``obj`` (tensors in dicts, lists and tuples, and ``Buckets``) with every CUDA tensor
    copied into pinned host memory, on a copy stream that first waits for ``after``.

    Returns once the copies are done; the wait releases the GIL. The CUDA tensors must not
    be written between ``after`` and the return (copies of them, taken at ``after``, are
    what a caller passes). CPU tensors and everything else come back as they are.
    """
    import torch

    devices = {t.device for t in _tensors(obj) if t.is_cuda}
    if not devices:
        return obj
    streams = {device: torch.cuda.Stream(device) for device in devices}
    for stream in streams.values():
        if after is not None:
            stream.wait_event(after)

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(streams[tensor.device]):
            host.copy_(tensor.detach(), non_blocking=True)
        return host

    copied = map_tensors(obj, to_host)
    for stream in streams.values():
        stream.synchronize()
    return copied


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


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found
