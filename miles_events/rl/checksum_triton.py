"""The fingerprint sum as one fused Triton kernel, for tensors on a CUDA device.

Same arithmetic as ``checksum._mix_chunk`` (int64, wrapping): each program loads a block of
words, mixes each with its global index, sums the block, and adds it atomically into one
int64. One pass over memory instead of one per elementwise op. Imported only when a CUDA
tensor is fingerprinted and Triton is installed; otherwise the torch path is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _mix_sum_kernel(words_ptr, out_ptr, n, k1, k2, k3, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offsets < n
    words = tl.load(words_ptr + offsets, mask=mask, other=0)
    mixed = words * k1 + offsets * k2
    mixed = mixed ^ (mixed >> 31)
    mixed = mixed * k3
    mixed = mixed ^ (mixed >> 29)
    mixed = tl.where(mask, mixed, 0)
    tl.atomic_add(out_ptr, tl.sum(mixed, axis=0))


def mix_sum(words: torch.Tensor, k1: int, k2: int, k3: int) -> int:
    """The wrapped int64 sum of the mixed ``words`` (a contiguous int64 CUDA tensor)."""
    out = torch.zeros(1, dtype=torch.int64, device=words.device)
    n = words.numel()
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _mix_sum_kernel[grid](words, out, n, k1, k2, k3, BLOCK=_BLOCK)
    return int(out.item())
