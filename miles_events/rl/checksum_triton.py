"""The fingerprint sum as one fused Triton kernel, for tensors on a CUDA device.

Same arithmetic as ``checksum._mix_sum_numpy`` (int64, wrapping): every word is mixed with
its global index and the mixed words are summed modulo 2**64, an order-free sum, so the
result is the CPU reference's bit for bit whatever the blocking. One pass over memory: a
persistent grid (a few programs per multiprocessor) walks the tensor in tiles of ``BLOCK``
words, each program keeping a vector of partial sums in registers and adding it once,
atomically, into one int64 at its end. The tiles are whole (no mask, so loads are full
width) except one tail tile; the index term's per-lane part (``lane * k2``) is computed
once per program, so a word costs two 64-bit multiplies. Imported only when a CUDA tensor
is fingerprinted and Triton is installed; otherwise the torch path is used.

``bench/gpu/fingerprint.py`` measures it against a copy and a read of the same bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""int64 words per tile."""
PROGRAMS_PER_SM = 4
NUM_WARPS = 16


@triton.jit
def _mix_sum_kernel(words_ptr, out_ptr, n, full_tiles, tail_start, k1, k2, k3, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    lane_k2 = lane * k2
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for tile in range(pid, full_tiles, programs):
        base = tile.to(tl.int64) * BLOCK
        words = tl.load(words_ptr + base + lane)
        mixed = words * k1 + (base * k2 + lane_k2)
        mixed = mixed ^ (mixed >> 31)
        mixed = mixed * k3
        mixed = mixed ^ (mixed >> 29)
        acc += mixed
    if pid == programs - 1:  # the tail, fewer than BLOCK words
        base = tl.full([], 0, tl.int64) + tail_start  # (an argument of 1 arrives as a constant)
        offsets = base + lane
        mask = offsets < n
        words = tl.load(words_ptr + offsets, mask=mask, other=0)
        mixed = words * k1 + (base * k2 + lane_k2)
        mixed = mixed ^ (mixed >> 31)
        mixed = mixed * k3
        mixed = mixed ^ (mixed >> 29)
        acc += tl.where(mask, mixed, 0)
    tl.atomic_add(out_ptr, tl.sum(acc, axis=0))


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def mix_sum(
    words: torch.Tensor,
    k1: int,
    k2: int,
    k3: int,
    *,
    block: int = BLOCK,
    programs_per_sm: int = PROGRAMS_PER_SM,
    num_warps: int = NUM_WARPS,
) -> int:
    """The wrapped int64 sum of the mixed ``words`` (a contiguous int64 CUDA tensor)."""
    out = torch.zeros(1, dtype=torch.int64, device=words.device)
    n = words.numel()
    if n:
        full_tiles = n // block
        programs = max(1, min(full_tiles, _multiprocessors(words.device.index or 0) * programs_per_sm))
        _mix_sum_kernel[(programs,)](
            words, out, n, full_tiles, full_tiles * block, k1, k2, k3, BLOCK=block, num_warps=num_warps
        )
    return int(out.item())
