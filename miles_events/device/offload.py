"""Offload and onload: device tensors to a host copy and back, measured.

What the seed's ``offload`` / ``onload`` do for a trainer and an engine, for tensors this
process holds: a module whose parameters are views of flat buckets
(``buckets.bucket_parameters``) moves bucket by bucket, each parameter re-pointed at its
view of the new bucket (the module, its optimizer and its ties keep their parameter
objects); loose tensors (an optimizer's moments, a module's own parameters) move one by
one. The host copy is pinned when it comes from a GPU. The copy is always made, on the CPU
too (to a fresh host buffer, the old one freed), so the CPU runs the very path a GPU does.

``Measured`` times an offload or onload and reads the device's free memory
(``torch.cuda.mem_get_info``) before and after: on a GPU their difference is what really
came free, whatever the allocator kept.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING

from miles_events.device.buckets import Buckets
from schemas.events import MemoryPart

if TYPE_CHECKING:
    import torch

HOST = "cpu"


def free_device_bytes(device: torch.device | str) -> int:
    """The device's free bytes after its cached blocks are given back; 0 off CUDA."""
    import torch

    if not isinstance(device, torch.device) or device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


class Measured:
    """``with Measured(name, device) as measure: ...; measure.part(num_bytes)``: the
    ``MemoryPart`` of what the block moved."""

    def __init__(self, name: str, device: torch.device | str) -> None:
        """``device``: a torch device, or a name such as ``server`` for memory elsewhere
        (nothing read)."""
        import torch

        self.name = name
        self.device = (
            device if isinstance(device, torch.device) or device == "server" else torch.device(device)
        )
        self.free_before = 0
        self.free_after = 0
        self.started = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Measured:
        self.free_before = free_device_bytes(self.device)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free_after = free_device_bytes(self.device)
        self.seconds = time.perf_counter() - self.started

    def part(self, num_bytes: int) -> MemoryPart:
        return MemoryPart(
            name=self.name,
            device=str(self.device),
            bytes=int(num_bytes),
            device_free_before=self.free_before,
            device_free_after=self.free_after,
            seconds=self.seconds,
        )


class HostCopies:
    """The pinned host copies of a GPU's tensors, kept once taken and reused by the next
    offload of the same tensor (by key): pinning host memory costs far more than copying
    into it, and an offload comes every step. What it holds stays taken (as SGLang's CPU
    backup of the weights does); off a GPU nothing is kept."""

    def __init__(self) -> None:
        self._copies: dict[object, torch.Tensor] = {}

    def take(self, key: object, like: torch.Tensor) -> torch.Tensor:
        import torch

        copy = self._copies.get(key)
        if copy is None or copy.shape != like.shape or copy.dtype != like.dtype:
            copy = self._copies[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return copy


def copy_to(
    tensor: torch.Tensor, device: torch.device | str, copies: HostCopies | None = None, key: object = None
) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` in other memory than its own, even when it is
    there already: from a GPU to the host, pinned (``copies``' under ``key`` where given)."""
    import torch

    device = torch.device(device)
    if device.type == HOST and tensor.is_cuda:
        copy = (
            copies.take(key, tensor)
            if copies is not None
            else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        )
    else:
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    copy.copy_(tensor.detach())
    return copy


def move_buckets(
    owners: MutableMapping[str, torch.Tensor],
    buckets: Buckets,
    device: torch.device | str,
    copies: HostCopies | None = None,
) -> Buckets:
    """``buckets`` copied to ``device``, and every tensor of ``owners`` (state-dict name ->
    the parameter or buffer object, ``module.state_dict(keep_vars=True)``) that is a view of
    them re-pointed at its view of the copy. The old buckets are referenced no more by
    ``owners``; they are freed once the caller drops them."""
    import torch

    moved = Buckets(
        buckets.layouts,
        tuple(copy_to(buffer, device, copies, ("bucket", i)) for i, buffer in enumerate(buckets.buffers)),
    )
    with torch.no_grad():
        for name, view in moved.tensors().items():
            owners[name].data = view
    return moved


def move_loose(
    tensors: Iterable[torch.Tensor], device: torch.device | str, copies: HostCopies | None = None
) -> int:
    """Move each parameter (or tensor held as a parameter's ``.data``) to ``device`` in place
    (its ``.data`` re-pointed); returns the bytes moved."""
    import torch

    moved = 0
    with torch.no_grad():
        for index, tensor in enumerate(tensors):
            tensor.data = copy_to(tensor.data, device, copies, ("loose", index))
            moved += tensor.numel() * tensor.element_size()
    return moved


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device | str, copies: HostCopies | None = None
) -> int:
    """Move every tensor of the optimizer's per-parameter state to ``device`` (Adam's moments
    and step counts; a CPU step count stays where it is); returns the bytes moved."""
    import torch

    moved = 0
    target = torch.device(device)
    for index, state in enumerate(optimizer.state.values()):
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step" and value.device.type == HOST and value.dim() == 0:
                continue  # Adam keeps its step count on the host unless capturable
            state[key] = copy_to(value, target, copies, ("optimizer", index, key))
            moved += value.numel() * value.element_size()
    return moved
