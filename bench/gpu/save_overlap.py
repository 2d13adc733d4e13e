"""What a save staged beside training costs the training: a launch-bound GPU loop in the
main thread, and on a thread beside it one way of taking a train state off the GPU (or of
writing it), repeated for as long as the loop runs. Reported: the loop's slowdown, and what
each save cost it (the loop's extra time over the number of saves it overlapped).

    python bench/gpu/save_overlap.py [--state-gb 2.1] [--iterations 300]

The train state: bf16 tensors of a Qwen2-0.5B-shaped model's sizes, three times over (the
weights and AdamW's two moments: 2.1 GB). The loop: 24 small matmul layers on a batch of 64
with a host sync per iteration, as a decode or training step's launch-bound Python is. Each
way is timed against the loop alone in the same run; the ratio is the loop's slowdown.

- ``pin_new``: each tensor copied into newly pinned host memory on a copy stream (the
  caching host allocator emptied first, so each save pins afresh, as saves that overlap
  each other do once the cache is held by the ones still being written),
- ``pin_reused``: the same copies into pinned memory the first save pinned,
- ``pageable``: into ordinary host memory on a copy stream,
- ``torch_save``: ``torch.save`` of a host copy into a file under /dev/shm (a Saver's write),
- ``safetensors``: ``safetensors.torch.save_file`` of the same (the weights' write).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

QWEN_SHAPES = [(151936, 896)] + 24 * [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)]


def state_tensors(gigabytes: float) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    total = 0
    while total < gigabytes * 1e9:
        for shape in QWEN_SHAPES:
            tensors.append(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
            total += tensors[-1].numel() * 2
            if total >= gigabytes * 1e9:
                break
    return tensors


def loop(layers: list[torch.Tensor], x: torch.Tensor, iterations: int) -> float:
    """Seconds per iteration of the launch-bound loop."""
    began = time.perf_counter()
    for _ in range(iterations):
        h = x
        for w in layers:
            h = torch.nn.functional.silu(h @ w)
        h.sum().item()
    return (time.perf_counter() - began) / iterations


def copy_to(hosts: list[torch.Tensor], tensors: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        for host, tensor in zip(hosts, tensors, strict=True):
            host.copy_(tensor, non_blocking=True)
    stream.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-gb", type=float, default=2.1)
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    tensors = state_tensors(args.state_gb)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    layers = [torch.randn(896, 896, device="cuda", dtype=torch.bfloat16) / 30 for _ in range(24)]
    x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    reused = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    host = [t.cpu() for t in tensors]
    shm = Path(tempfile.mkdtemp(prefix="save-overlap-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))

    def pin_new() -> None:
        torch._C._host_emptyCache()
        copy_to([torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors], tensors, stream)

    def torch_save() -> None:
        torch.save(host, shm / "state.pt")

    def safetensors_save() -> None:
        from safetensors.torch import save_file

        save_file({str(i): t for i, t in enumerate(host)}, str(shm / "state.safetensors"))

    ways: dict[str, Callable[[], None]] = {
        "pin_new": pin_new,
        "pin_reused": lambda: copy_to(reused, tensors, stream),
        "pageable": lambda: copy_to([torch.empty(t.shape, dtype=t.dtype) for t in tensors], tensors, stream),
        "torch_save": torch_save,
        "safetensors": safetensors_save,
    }
    loop(layers, x, 20)  # warm-up
    for way in ways.values():
        way()
    print(f"state: {len(tensors)} tensors, {num_bytes / 1e9:.2f} GB; loop alone measured before each way")
    print(f"{'way':12}{'loop ms':>10}{'alone ms':>10}{'slowdown':>10}{'save s':>9}{'GB/s':>7}{'stall/save ms':>15}")
    results = []
    for name, way in ways.items():
        alone = statistics.median(loop(layers, x, args.iterations // 3) for _ in range(3))
        stop = threading.Event()
        times: list[float] = []

        def beside(way: Callable[[], None] = way, stop: threading.Event = stop, times: list[float] = times) -> None:
            while not stop.is_set():
                began = time.perf_counter()
                way()
                times.append(time.perf_counter() - began)

        thread = threading.Thread(target=beside)
        thread.start()
        time.sleep(0.05)
        during = loop(layers, x, args.iterations)
        stop.set()
        thread.join()
        save = statistics.median(times)
        ratio = during / alone
        # What each save beside it cost the loop: its extra time over the saves it overlapped.
        stall = (during - alone) * args.iterations / len(times)
        results.append(f"{name}={ratio:.2f}x,{stall * 1e3:.0f}ms")
        print(
            f"{name:12}{during * 1e3:10.3f}{alone * 1e3:10.3f}{ratio:9.2f}x{save:9.2f}"
            f"{num_bytes / save / 1e9:7.1f}{stall * 1e3:15.1f}"
        )
    for file in shm.iterdir():
        file.unlink()
    shm.rmdir()
    print("RESULT loop_slowdown,stall_per_save " + " ".join(results))


if __name__ == "__main__":
    main()
