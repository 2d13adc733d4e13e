"""What pinning a save's host memory costs the GPU work beside it: ``cudaHostAlloc`` against
the ``PinnedPool``'s host block (pages allocated up front in a memory file, then registered).

    python bench/gpu/pinning.py [--state-gb 3.6] [--reps 2]

A background save's host memory is pinned once, ahead of the first periodic save or at the
first save (``miles_events.device.host_copy``); while it pins, every CUDA call of the process
may wait. Here a thread runs a launch-bound loop (4 small matmuls, then a number read back,
as a training or decode step's Python does) while the main thread takes host memory for a
train state of Qwen2-0.5B-shaped tensors (bf16, weights and AdamW's two moments: 3.6 GB)
one way at a time:

- ``cudaHostAlloc``: a pinned tensor per tensor (``pin_memory=True``, the caching host
  allocator emptied first): what a first save's pinning was;
- ``PinnedPool``: ``PinnedPool().take``, one block for the arena: what it is now;
- ``block mapped``, ``block registered``: the block's two phases alone (its pages allocated
  and mapped, not pinned; then the registration with CUDA of a block mapped beforehand).

For each: how long it took, and what the loop lost meanwhile: its iterations against the
loop alone at its median rate (``lost ms``), and its longest iteration. Medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from save_overlap import state_tensors

from miles_events.device.host_copy import HostBlock, PinnedPool, block_offsets


class Loop:
    """The launch-bound loop on a thread of its own, each iteration's end time recorded."""

    def __init__(self) -> None:
        self.a = torch.randn(256, 256, device="cuda")
        self.b = torch.randn(256, 256, device="cuda")
        self.ends: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.cuda.set_device(0)
        while not self._stop.is_set():
            for _ in range(4):
                y = self.a @ self.b
            y.sum().item()
            self.ends.append(time.perf_counter())

    def __enter__(self) -> Loop:
        self._thread.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def iteration_s(self, since: float) -> float:
        ends = [t for t in self.ends if t >= since]
        if len(ends) < 3:  # stalled meanwhile (the last way's memory going): the whole run's
            ends = self.ends
        return statistics.median(b - a for a, b in pairwise(ends))

    def during(self, start: float, end: float, iteration_s: float) -> tuple[float, float]:
        """(seconds lost: the window less its iterations at ``iteration_s``, the longest gap)."""
        inside = [t for t in self.ends if start <= t <= end]
        marks = [start, *inside, end]
        return max(0.0, (end - start) - len(inside) * iteration_s), max(b - a for a, b in pairwise(marks))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-gb", type=float, default=3.6)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    tensors = state_tensors(args.state_gb)
    signature = [(tuple(t.shape), t.dtype) for t in tensors]
    num_bytes = block_offsets(signature)[1]
    print(f"{torch.cuda.get_device_name()}: {len(tensors)} tensors, {num_bytes / 1e9:.2f} GB")

    # The caching host allocator keeps what the last rep pinned: emptied before each rep,
    # outside the timed call, so every rep pins afresh.
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None) or torch._C._accelerator_emptyHostCache

    def alloc() -> object:
        return [torch.empty(shape, dtype=dtype, pin_memory=True) for shape, dtype in signature]

    mapped: list[HostBlock] = []

    def register() -> object:
        block = mapped.pop()
        assert int(torch.cuda.cudart().cudaHostRegister(block.address, block.num_bytes, 1)) == 0
        return block, block.address

    ways: dict[str, tuple[Callable[[], object], Callable[[], None]]] = {
        "cudaHostAlloc": (alloc, empty_host_cache),
        "PinnedPool": (lambda: PinnedPool().take(tensors), lambda: None),
        "block mapped": (lambda: HostBlock(num_bytes, pin=False), lambda: None),
        "block registered": (register, lambda: mapped.append(HostBlock(num_bytes, pin=False))),
    }
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
    with Loop() as loop:
        for _ in range(args.reps):
            for name, (way, prepare) in ways.items():
                prepare()
                time.sleep(1.0)  # the last way's memory unpinned and freed meanwhile
                iteration_s = loop.iteration_s(time.perf_counter() - 0.4)
                start = time.perf_counter()
                kept = way()
                end = time.perf_counter()
                time.sleep(0.1)
                lost, longest = loop.during(start, end, iteration_s)
                rows[name].append((end - start, lost, longest))
                if name == "block registered":
                    _, address = kept  # type: ignore[misc]
                    torch.cuda.cudart().cudaHostUnregister(address)
                del kept
    print("\n| way | ms | loop lost, ms | loop's longest iteration, ms |\n|---|---|---|---|")
    medians = {}
    for name, values in rows.items():
        took, lost, longest = (statistics.median(v[i] for v in values) for i in range(3))
        medians[name] = (took, lost)
        print(f"| {name} | {took * 1e3:.0f} | {lost * 1e3:.0f} | {longest * 1e3:.0f} |")
    old, new = medians["cudaHostAlloc"][1], medians["PinnedPool"][1]
    print(
        f"RESULT bytes={num_bytes} alloc_ms={medians['cudaHostAlloc'][0] * 1e3:.0f} alloc_lost_ms={old * 1e3:.0f} "
        f"pool_ms={medians['PinnedPool'][0] * 1e3:.0f} pool_lost_ms={new * 1e3:.0f} "
        f"lost_ratio={new / old if old else float('nan'):.2f}"
    )


if __name__ == "__main__":
    main()
