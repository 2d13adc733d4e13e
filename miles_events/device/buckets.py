"""Weights as flat buckets: one buffer per dtype, every tensor a view into it.

A publication of a few hundred tensors costs a few hundred kernel launches and host
round trips when every tensor is staged, copied and fingerprinted alone; on a GPU that,
not the bytes, is the time. ``Buckets`` packs the tensors into one buffer per dtype with
a few batched copies (``torch.cat`` into the buffer), so that a load into an engine whose own
weights live in a bucket of the same layout is one copy per dtype, sharing it with another
process is one CUDA IPC handle per dtype (``miles_events.transport.cuda_ipc``), and
fingerprinting every tensor is one kernel launch and one host sync per dtype
(``fingerprint_buckets``).

Each tensor starts at a 256-byte boundary and the bytes between tensors are zero, so a
tensor's words in the bucket are the words ``fingerprint.tensor_fingerprint`` hashes (its
bytes, zero-padded to 8): the bucket's fingerprints equal the tensors' own, on any device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_events.device.fingerprint import (
    K1,
    K2,
    K3,
    fingerprint_from_sum,
    tensor_fingerprint,
    triton_segment_sums,
)
from miles_events.rl.checksum import is_skipped
from miles_events.rl.finite import require_finite_weights
from schemas.data import BucketLayout, TensorSlot

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 256
"""Every tensor of a bucket starts at a multiple of this many bytes (CUDA's allocation
alignment: full-width loads, and a tensor's words never share one with its neighbour)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a bucket layout")
    return dtype


def plan_layouts(tensors: Mapping[str, torch.Tensor]) -> tuple[BucketLayout, ...]:
    """One layout per dtype, in order of first appearance, each holding that dtype's tensors
    in the order of ``tensors``."""
    by_dtype: dict[str, list[TensorSlot]] = {}
    ends: dict[str, int] = {}
    for name, tensor in tensors.items():
        key = dtype_name(tensor.dtype)
        align = max(1, ALIGN_BYTES // tensor.element_size())
        start = -(-ends.get(key, 0) // align) * align
        numel = tensor.numel()
        by_dtype.setdefault(key, []).append(TensorSlot(name, tuple(tensor.shape), start, numel))
        ends[key] = start + numel
    layouts = []
    for key, slots in by_dtype.items():
        align = max(1, ALIGN_BYTES // _torch_dtype(key).itemsize)
        layouts.append(BucketLayout(key, -(-ends[key] // align) * align, tuple(slots)))
    return tuple(layouts)


def byte_view(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer``'s bytes (a flat bucket of any dtype), without a copy."""
    import torch

    return buffer.view(torch.uint8)


def layouts_tensor_bytes(layouts: Iterable[BucketLayout]) -> int:
    """The bytes of the tensors ``layouts`` hold, without the gaps between them."""
    return sum(
        slot.numel * _torch_dtype(layout.dtype).itemsize for layout in layouts for slot in layout.slots
    )


@dataclass(frozen=True)
class Buckets:
    """Flat buffers (one a dtype) and their layouts; ``tensors()`` views every tensor."""

    layouts: tuple[BucketLayout, ...]
    buffers: tuple[torch.Tensor, ...]

    @classmethod
    def allocate(cls, layouts: Sequence[BucketLayout], device: torch.device | str) -> Buckets:
        """Buffers for ``layouts`` on ``device``: uninitialised, but for the gaps between
        tensors, which are zeroed (``pack`` writes the rest)."""
        import torch

        buffers = tuple(
            torch.empty(layout.numel, dtype=_torch_dtype(layout.dtype), device=device) for layout in layouts
        )
        buckets = cls(tuple(layouts), buffers)
        gaps = [g for g in buckets._gaps() if g.numel()]
        if gaps:
            torch._foreach_zero_(gaps)
        return buckets

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None) -> Buckets:
        """``tensors`` copied into new buckets on ``device`` (default: the first tensor's)."""
        if device is None:
            device = next(iter(tensors.values())).device if tensors else "cpu"
        buckets = cls.allocate(plan_layouts(tensors), device)
        buckets.pack(tensors)
        return buckets

    def _gaps(self) -> list[torch.Tensor]:
        gaps = []
        for layout, buffer in zip(self.layouts, self.buffers, strict=True):
            end = 0
            for slot in layout.slots:
                gaps.append(buffer[end : slot.offset])
                end = slot.offset + slot.numel
            gaps.append(buffer[end : layout.numel])
        return gaps

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @property
    def tensor_bytes(self) -> int:
        """The bytes of the tensors alone, without the gaps between them."""
        return layouts_tensor_bytes(self.layouts)

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    def to(self, device: torch.device | str) -> Buckets:
        """These buckets on ``device`` (themselves when already there): one copy per dtype."""
        return Buckets(self.layouts, tuple(b.to(device) for b in self.buffers))

    def names(self) -> list[str]:
        return [slot.name for layout in self.layouts for slot in layout.slots]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, as a view into its bucket (no copy)."""
        return {
            slot.name: buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for layout, buffer in zip(self.layouts, self.buffers, strict=True)
            for slot in layout.slots
        }

    def pack(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (every name of the layouts, same shapes) into the buckets,
        converting dtype and device where they differ. Tensors that follow each other without
        a gap (all of them, where every tensor's bytes are a multiple of ``ALIGN_BYTES``, as a
        model's are) are written by one ``torch.cat``: a few batched launches per dtype, not
        one per tensor."""
        import torch

        names = self.names()
        if set(names) != tensors.keys():
            missing = sorted(set(names) - tensors.keys())
            unknown = sorted(tensors.keys() - set(names))
            raise ValueError(f"tensors do not fit the buckets (missing {missing[:5]}, unknown {unknown[:5]})")
        with torch.no_grad():
            for layout, buffer in zip(self.layouts, self.buffers, strict=True):
                for start, end, run in _gapless_runs(layout.slots):
                    sources = [_flat(tensors[slot.name], slot, buffer) for slot in run]
                    torch.cat(sources, out=buffer[start:end])

    def copy_from(self, other: Buckets) -> None:
        """Copy ``other``'s buffers into these (same layouts): one copy per dtype."""
        if other.layouts != self.layouts:
            raise ValueError("the buckets' layouts differ")
        for target, source in zip(self.buffers, other.buffers, strict=True):
            target.copy_(source, non_blocking=True)


def _gapless_runs(slots: Sequence[TensorSlot]) -> list[tuple[int, int, list[TensorSlot]]]:
    """``slots`` cut into runs that follow each other without a gap: (start, end, run)."""
    runs: list[tuple[int, int, list[TensorSlot]]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot.offset:
            start, _, run = runs[-1]
            runs[-1] = (start, slot.offset + slot.numel, [*run, slot])
        else:
            runs.append((slot.offset, slot.offset + slot.numel, [slot]))
    return runs


def _flat(tensor: torch.Tensor, slot: TensorSlot, buffer: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the flat run of ``buffer``'s dtype and device that ``slot`` holds."""
    if tuple(tensor.shape) != slot.shape:
        raise ValueError(f"{slot.name}: shape {tuple(tensor.shape)}, the bucket holds {slot.shape}")
    return tensor.detach().reshape(-1).to(device=buffer.device, dtype=buffer.dtype)


def bucket_parameters(module: torch.nn.Module, names: Iterable[str]) -> Buckets:
    """Move the named tensors of ``module`` (state-dict names; a tied tensor once) into
    buckets on their device, in place: each parameter or buffer becomes a view of its
    bucket, with the same values, so that a whole-bucket copy loads the module and one
    launch per dtype fingerprints it."""
    import torch

    state = module.state_dict(keep_vars=True)
    owned = {name: state[name] for name in names}
    buckets = Buckets.of({name: t.detach() for name, t in owned.items()})
    with torch.no_grad():
        for name, view in buckets.tensors().items():
            owned[name].data = view
    return buckets


def fingerprint_buckets(buckets: Buckets, skip_tensor_list: Iterable[str] = ()) -> dict[str, str]:
    """The fingerprint of every tensor in ``buckets`` not skipped, equal to
    ``fingerprint.tensor_fingerprint`` of each tensor: on a CUDA device with Triton, one fused
    launch and one host sync per dtype; elsewhere tensor by tensor."""
    skip = list(skip_tensor_list)
    if buckets.buffers and buckets.device.type == "cuda":
        segment_sums = triton_segment_sums()
        if segment_sums is not None:
            result: dict[str, str] = {}
            for layout, buffer in zip(buckets.layouts, buckets.buffers, strict=True):
                slots = [s for s in layout.slots if not is_skipped(s.name, skip)]
                sums = segment_sums(buffer, layout, tuple(slots), K1, K2, K3)
                for slot, total in zip(slots, sums, strict=True):
                    result[slot.name] = fingerprint_from_sum(buffer.dtype, slot.shape, total)
            return result
    return {
        name: tensor_fingerprint(t) for name, t in buckets.tensors().items() if not is_skipped(name, skip)
    }


def require_finite_buckets(buckets: Buckets, what: str) -> None:
    """``require_finite_weights`` for weights packed in buckets: one read of each float
    bucket (its minimum and maximum, which a NaN or an infinity reaches) and one host sync;
    the tensors are named only when one holds a non-finite value."""
    import torch

    floats = [b for b in buckets.buffers if b.is_floating_point() and b.numel()]
    if not floats:
        return
    extremes = torch.stack([torch.stack(torch.aminmax(b)).float() for b in floats])
    if not bool(torch.isfinite(extremes).all()):
        require_finite_weights(buckets.tensors(), what)
