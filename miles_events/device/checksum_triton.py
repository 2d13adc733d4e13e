"""The fingerprint sum as one fused Triton kernel, for tensors on a CUDA device.

Same arithmetic as ``fingerprint._mix_sum_numpy`` (int64, wrapping): every word is mixed with
its global index and the mixed words are summed modulo 2**64, an order-free sum, so the
result is the CPU reference's bit for bit whatever the blocking. One pass over memory: a
persistent grid (a few programs per multiprocessor) walks the tensor in tiles of ``BLOCK``
words, each program keeping a vector of partial sums in registers and adding it once,
atomically, into one int64 at its end. The tiles are whole (no mask, so loads are full
width) except one tail tile; the index term's per-lane part (``lane * k2``) is computed
once per program, so a word costs two 64-bit multiplies. Imported only when a CUDA tensor
is fingerprinted and Triton is installed; otherwise the torch path is used.

``segment_sums`` computes the same sum for every tensor of a flat bucket
(``miles_events.device.buckets``) at once: a table of tiles, none crossing a tensor, walked by
a program per job of a few whole tiles of one tensor, then one per partial tile, each
tile's words indexed from its tensor's start.

``bench/gpu/fingerprint.py`` measures it against a copy and a read of the same bytes.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from schemas.data import BucketLayout, TensorSlot

BLOCK = 4096
"""int64 words per tile."""
PROGRAMS_PER_SM = 4
NUM_WARPS = 16
STAGES = 3
"""Triton's ``num_stages`` for the loop over tiles (its software pipelining; 3 is its default)."""


@triton.jit
def _mix(words, index_term, k1, k3):
    """Each word's hash, ``fingerprint._mix_sum_numpy``'s: ``words * k1`` plus the index term
    (``index * k2``, which each kernel computes where it is cheapest), then xorshift,
    multiply, xorshift. Inlined where it is called."""
    mixed = words * k1 + index_term
    mixed = mixed ^ (mixed >> 31)
    mixed = mixed * k3
    return mixed ^ (mixed >> 29)


@triton.jit
def _mix_sum_kernel(words_ptr, out_ptr, n, full_tiles, tail_start, k1, k2, k3, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    lane_k2 = lane * k2
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for tile in range(pid, full_tiles, programs):
        base = tl.cast(tile, tl.int64) * BLOCK
        words = tl.load(words_ptr + base + lane)
        acc += _mix(words, base * k2 + lane_k2, k1, k3)
    if pid == programs - 1:  # the tail, fewer than BLOCK words
        base = tl.full([], 0, tl.int64) + tail_start  # (an argument of 1 arrives as a constant)
        offsets = base + lane
        mask = offsets < n
        words = tl.load(words_ptr + offsets, mask=mask, other=0)
        acc += tl.where(mask, _mix(words, base * k2 + lane_k2, k1, k3), 0)
    tl.atomic_add(out_ptr, tl.sum(acc, axis=0))


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _persistent_programs(work: int, device: torch.device, programs_per_sm: int) -> int:
    """Programs of a persistent grid over ``work`` items: a few per multiprocessor, at
    least one, never more than the items."""
    return max(1, min(work, _multiprocessors(device.index or 0) * programs_per_sm))


def launch_mix_sum(
    words: torch.Tensor,
    out: torch.Tensor,
    k1: int,
    k2: int,
    k3: int,
    *,
    block: int = BLOCK,
    programs_per_sm: int = PROGRAMS_PER_SM,
    num_warps: int = NUM_WARPS,
    stages: int = STAGES,
) -> None:
    """Queue the kernel that adds the mixed sum of ``words`` (a contiguous int64 CUDA
    tensor) into ``out[0]`` (int64, on the same device), without waiting for it."""
    n = words.numel()
    if n:
        full_tiles = n // block
        programs = _persistent_programs(full_tiles, words.device, programs_per_sm)
        _mix_sum_kernel[(programs,)](
            words,
            out,
            n,
            full_tiles,
            full_tiles * block,
            k1,
            k2,
            k3,
            BLOCK=block,
            num_warps=num_warps,
            num_stages=stages,
        )


def mix_sum(words: torch.Tensor, k1: int, k2: int, k3: int, **settings: int) -> int:
    """The wrapped int64 sum of the mixed ``words`` (a contiguous int64 CUDA tensor):
    ``launch_mix_sum`` and the host's wait for it."""
    out = torch.zeros(1, dtype=torch.int64, device=words.device)
    launch_mix_sum(words, out, k1, k2, k3, **settings)
    return int(out.item())


# --- every tensor of a bucket in one launch --------------------------------------------------


@triton.jit
def _segment_jobs_kernel(
    words_ptr,
    start_ptr,
    index_ptr,
    tiles_ptr,
    slot_ptr,
    out_ptr,
    k1,
    k2,
    k3,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One job a program: up to a few whole tiles of ``BLOCK`` words of one tensor, from its
    word ``index`` at the bucket's word ``start``. The job's four numbers are read once;
    the tiles' addresses follow from them, so no load waits on another."""
    job = tl.program_id(0)
    start = tl.multiple_of(tl.load(start_ptr + job), ALIGN)  # tensors start on 256 bytes: full-width loads
    index = tl.load(index_ptr + job)
    tiles = tl.load(tiles_ptr + job)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    lane_k2 = lane * k2
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for tile in range(0, tiles):
        base = tl.cast(tile, tl.int64) * BLOCK
        words = tl.load(words_ptr + (start + base) + lane)
        acc += _mix(words, (index + base) * k2 + lane_k2, k1, k3)
    tl.atomic_add(out_ptr + tl.load(slot_ptr + job), tl.sum(acc, axis=0))


@triton.jit
def _segment_tail_kernel(
    words_ptr, start_ptr, index_ptr, count_ptr, slot_ptr, out_ptr, tiles, k1, k2, k3, BLOCK: tl.constexpr
):
    """The last, partial tile of each tensor (fewer than ``BLOCK`` words), masked."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for tile in range(pid, tiles, programs):
        start = tl.load(start_ptr + tile)
        index = tl.load(index_ptr + tile)
        mask = lane < tl.load(count_ptr + tile)
        words = tl.load(words_ptr + start + lane, mask=mask, other=0)
        mixed = _mix(words, (index + lane) * k2, k1, k3)
        tl.atomic_add(out_ptr + tl.load(slot_ptr + tile), tl.sum(tl.where(mask, mixed, 0), axis=0))


TILES_PER_JOB = 8
"""Whole tiles one program of ``segment_sums`` walks (256 KiB at the default tile)."""


@functools.lru_cache(maxsize=64)
def _segment_tiles(
    layout: BucketLayout, slots: tuple[TensorSlot, ...], device: torch.device, block: int, tiles_per_job: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The work tables of ``slots`` of a bucket, ``[4, n]`` int64 tensors on ``device``:
    jobs of whole tiles (first word in the bucket, index of that word within its tensor,
    tiles, slot number) and each tensor's partial last tile (first word, index, words, slot
    number)."""
    itemsize = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    jobs: list[np.ndarray] = []
    tail: list[tuple[int, int, int, int]] = []
    for number, slot in enumerate(slots):
        first = slot.offset * itemsize // 8
        words = -(-slot.numel * itemsize // 8)
        whole = words // block
        if whole:
            starts = np.arange(0, whole, tiles_per_job, dtype=np.int64)
            tiles = np.minimum(tiles_per_job, whole - starts)
            jobs.append(
                np.stack([first + starts * block, starts * block, tiles, np.full(len(starts), number)])
            )
        if words % block:
            tail.append((first + whole * block, whole * block, words % block, number))
    job_table = np.concatenate(jobs, axis=1) if jobs else np.zeros((4, 0), dtype=np.int64)
    tail_table = np.array(tail, dtype=np.int64).T.reshape(4, -1)
    return (
        torch.from_numpy(np.ascontiguousarray(job_table)).to(device),
        torch.from_numpy(np.ascontiguousarray(tail_table)).to(device),
    )


def segment_sums(
    buffer: torch.Tensor,
    layout: BucketLayout,
    slots: tuple[TensorSlot, ...],
    k1: int,
    k2: int,
    k3: int,
    *,
    block: int = BLOCK,
    tiles_per_job: int = TILES_PER_JOB,
    programs_per_sm: int = PROGRAMS_PER_SM,
    num_warps: int = NUM_WARPS,
) -> list[int]:
    """The wrapped int64 sum of the mixed words of each of ``slots`` of the bucket
    ``buffer`` (laid out as ``layout``), each tensor's words indexed from 0: what
    ``mix_sum`` gives for each tensor alone. Two launches (jobs of whole tiles, then each
    tensor's partial tile) and one host sync."""
    out = torch.zeros(max(1, len(slots)), dtype=torch.int64, device=buffer.device)
    if not slots:
        return []
    words = buffer.view(torch.int64)
    jobs, tail = _segment_tiles(layout, slots, buffer.device, block, tiles_per_job)
    if jobs.shape[1]:
        align = 32 if all((s.offset * buffer.element_size()) % 256 == 0 for s in slots) else 1
        _segment_jobs_kernel[(jobs.shape[1],)](
            words,
            jobs[0],
            jobs[1],
            jobs[2],
            jobs[3],
            out,
            k1,
            k2,
            k3,
            BLOCK=block,
            ALIGN=align,
            num_warps=num_warps,
        )
    tails = tail.shape[1]
    if tails:
        programs = _persistent_programs(tails, buffer.device, programs_per_sm)
        _segment_tail_kernel[(programs,)](
            words,
            tail[0],
            tail[1],
            tail[2],
            tail[3],
            out,
            tails,
            k1,
            k2,
            k3,
            BLOCK=block,
            num_warps=num_warps,
        )
    return [int(v) for v in out.tolist()]
