"""What a save staged beside training costs the training: a launch-bound GPU loop in the
main thread, and on a thread beside it one way of taking a train state off the GPU (or of
writing it), repeated for as long as the loop runs. ``--loop-sync pinned`` reads each of the
loop's numbers back into pinned memory, ``stream`` only waits for its stream (no read). Reported: the loop's slowdown, and what
each save cost it (the loop's extra time over the number of saves it overlapped).

    python bench/gpu/save_overlap.py [--state-gb 2.1] [--iterations 300] [--ways checkpoint,...]
        [--dir DIR]

The train state: bf16 tensors of a Qwen2-0.5B-shaped model's sizes, three times over (the
weights and AdamW's two moments: 2.1 GB). The loop: 24 small matmul layers on a batch of 64
with a host sync per iteration, as a decode or training step's launch-bound Python is. Each
way is timed against the loop alone in the same run; the ratio is the loop's slowdown.

- ``pin_new``: each tensor copied into newly pinned host memory on a copy stream (the
  caching host allocator emptied first, so each save pins afresh, as saves that overlap
  each other do once the cache is held by the ones still being written),
- ``pin_reused``: the same copies into pinned memory the first save pinned,
- ``pin_polled``, ``pin_chunked``, ``pin_chunked_polled``: the same, waited for by polling
  an event rather than a blocking wait, queued 32 MB at a time two chunks in flight, or
  both (what a save's copy holds back: the copy engine's queue, or the waiting),
- ``pin_paced_8mb``, ``_32mb``, ``_128mb``: queued that much at a time, each chunk waited
  for before the next is queued (the copy stream drained between chunks),
- ``host_copy``: the trainer's own ``copy_to_host`` into memory of a ``PinnedPool`` pinned
  before (queued ``CHUNK_BYTES`` at a time, each waited for before the next),
- ``pageable``: into ordinary host memory on a copy stream,
- ``torch_save``: ``torch.save`` of a host copy into a file under /dev/shm (a Saver's write),
- ``safetensors``: ``safetensors.torch.save_file`` of the same (the weights' write),
- ``checkpoint``: the Saver's own write (``write_checkpoint``: the first third as the
  weights, the rest as the optimizer state, each file fsynced and hashed) of the pinned
  copy into a directory on disk (``--dir``, default the system's temporary directory),
- ``checkpoint_unhashed``: the same without the manifest's hashing (isolates it),
- ``checkpoint_process``: the same write in another process, with a copy of the state of
  its own (what the host's memory and disk cost the loop, without this process's
  interpreter, allocator or threads).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from unittest import mock

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from miles_events.checkpoint import format as checkpoint
from miles_events.device.host_copy import PinnedPool, capture_point, copy_to_host
from schemas.checkpoint import DataCursor, TrainerState

QWEN_SHAPES = [(151936, 896)] + 24 * [
    (896, 896),
    (128, 896),
    (128, 896),
    (896, 896),
    (4864, 896),
    (4864, 896),
    (896, 4864),
]


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


def loop(layers: list[torch.Tensor], x: torch.Tensor, iterations: int, sync: str = "item") -> float:
    """Seconds per iteration of the launch-bound loop; each iteration ends reading a number
    back (``item``: a transfer to pageable host memory and a wait; ``pinned``: a transfer into
    pinned memory, then a wait for an event after it) or waiting for its stream (``stream``:
    no transfer)."""
    into = torch.empty((), dtype=x.dtype, pin_memory=True)
    began = time.perf_counter()
    for _ in range(iterations):
        h = x
        for w in layers:
            h = torch.nn.functional.silu(h @ w)
        if sync == "item":
            h.sum().item()
        elif sync == "pinned":
            into.copy_(h.sum(), non_blocking=True)
            torch.cuda.current_stream().record_event().synchronize()
        else:
            h.sum()
            torch.cuda.current_stream().synchronize()
    return (time.perf_counter() - began) / iterations


def copy_to(
    hosts: list[torch.Tensor],
    tensors: list[torch.Tensor],
    stream: torch.cuda.Stream,
    poll: bool = False,
    chunk_bytes: int | None = None,
    in_flight: int = 2,
) -> None:
    """Each tensor copied into its host tensor on ``stream``, waited for by a blocking
    synchronisation, or by polling an event (``poll``); queued all at once, or
    ``chunk_bytes`` at a time, at most ``in_flight`` chunks queued."""
    pending: list[torch.cuda.Event] = []

    def wait(event: torch.cuda.Event) -> None:
        while poll and not event.query():
            time.sleep(0.0002)
        event.synchronize()

    queued = 0
    with torch.cuda.stream(stream):
        for host, tensor in zip(hosts, tensors, strict=True):
            flat_host, flat = host.view(-1), tensor.view(-1)
            step = flat.numel() if chunk_bytes is None else max(1, chunk_bytes // flat.element_size())
            for start in range(0, flat.numel(), step):
                flat_host[start : start + step].copy_(flat[start : start + step], non_blocking=True)
                queued += min(step, flat.numel() - start) * flat.element_size()
                if chunk_bytes is not None and queued >= chunk_bytes:
                    queued = 0
                    pending.append(stream.record_event())
                    if len(pending) >= in_flight:
                        wait(pending.pop(0))
    wait(stream.record_event())


TRAINER_STATE = TrainerState(
    rollout_id=0,
    weight_version="1",
    num_optimizer_steps=1,
    data=DataCursor(next_rollout_id=1, epoch=0, offset=0),
    seed=0,
    run_id="save-overlap",
)


def write_checkpoint(state: list[torch.Tensor], run_dir: Path, base_dir: Path) -> None:
    """The Saver's write of ``state``: its first third as the weights, the rest as the
    optimizer's state, over the previous one (as a run saving the same rollout again)."""
    third = len(state) // 3
    checkpoint.write_checkpoint(
        run_dir=run_dir,
        base_model_dir=base_dir,
        rollout_id=0,
        weights={f"w{i}": t for i, t in enumerate(state[:third])},
        optimizer={"state": dict(enumerate(state[third:]))},
        rng={},
        trainer_state=TRAINER_STATE,
    )


def checkpoint_process(state_file: str, run_dir: str, base_dir: str, pipe: Connection) -> None:
    """Writes a checkpoint of the state in ``state_file`` each time ``pipe`` asks."""
    state = torch.load(state_file)
    pipe.send("ready")
    while pipe.recv() is not None:
        write_checkpoint(state, Path(run_dir), Path(base_dir))
        pipe.send("done")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-gb", type=float, default=2.1)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--ways", default="", help="comma-separated ways to run (default: all)")
    parser.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: the temporary dir)"
    )
    parser.add_argument(
        "--loop-sync",
        default="item",
        choices=["item", "pinned", "stream"],
        help="how each loop iteration waits",
    )
    args = parser.parse_args()
    tensors = state_tensors(args.state_gb)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    layers = [torch.randn(896, 896, device="cuda", dtype=torch.bfloat16) / 30 for _ in range(24)]
    x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    reused = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    host = [t.cpu() for t in tensors]
    shm = Path(
        tempfile.mkdtemp(prefix="save-overlap-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )

    def pin_new() -> None:
        torch._C._host_emptyCache()
        copy_to([torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors], tensors, stream)

    def torch_save() -> None:
        torch.save(host, shm / "state.pt")

    def safetensors_save() -> None:
        from safetensors.torch import save_file

        save_file({str(i): t for i, t in enumerate(host)}, str(shm / "state.safetensors"))

    disk = Path(tempfile.mkdtemp(prefix="save-overlap-", dir=args.dir))
    base = disk / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    copy_to(reused, tensors, stream)

    pool = PinnedPool()

    def host_copy() -> None:
        _, arena = copy_to_host(tensors, capture_point(tensors[0].device), pool)
        assert arena is not None
        pool.give_back(arena)

    def checkpoint_unhashed() -> None:
        with mock.patch.object(checkpoint, "_sha256", lambda path: ""):
            write_checkpoint(reused, disk / "in-process", base)

    child = None

    def in_child() -> None:
        nonlocal child
        if child is None:
            torch.save(host, shm / "child-state.pt")
            ours, theirs = mp.get_context("spawn").Pipe()
            proc = mp.get_context("spawn").Process(
                target=checkpoint_process,
                args=(str(shm / "child-state.pt"), str(disk / "child"), str(base), theirs),
            )
            proc.start()
            if not ours.poll(300) or ours.recv() != "ready":
                raise TimeoutError("the checkpoint process did not start within 300 s")
            child = (proc, ours)
        child[1].send(1)
        if not child[1].poll(300):
            raise TimeoutError("the checkpoint process did not answer within 300 s")
        child[1].recv()

    ways: dict[str, Callable[[], None]] = {
        "pin_new": pin_new,
        "pin_reused": lambda: copy_to(reused, tensors, stream),
        "pin_polled": lambda: copy_to(reused, tensors, stream, poll=True),
        "pin_chunked": lambda: copy_to(reused, tensors, stream, chunk_bytes=32 << 20),
        "pin_chunked_polled": lambda: copy_to(reused, tensors, stream, poll=True, chunk_bytes=32 << 20),
        **{
            f"pin_paced_{mb}mb": lambda mb=mb: copy_to(
                reused, tensors, stream, chunk_bytes=mb << 20, in_flight=1
            )
            for mb in (8, 32, 128)
        },
        "host_copy": host_copy,
        "pageable": lambda: copy_to([torch.empty(t.shape, dtype=t.dtype) for t in tensors], tensors, stream),
        "torch_save": torch_save,
        "safetensors": safetensors_save,
        "checkpoint": lambda: write_checkpoint(reused, disk / "in-process", base),
        "checkpoint_unhashed": checkpoint_unhashed,
        "checkpoint_process": in_child,
    }
    if args.ways:
        unknown = set(args.ways.split(",")) - set(ways)
        if unknown:
            parser.error(f"--ways: unknown {', '.join(sorted(unknown))}; known: {', '.join(ways)}")
        ways = {name: way for name, way in ways.items() if name in args.ways.split(",")}
    loop(layers, x, 20)  # warm-up
    for way in ways.values():
        way()
    print(f"state: {len(tensors)} tensors, {num_bytes / 1e9:.2f} GB; loop alone measured before each way")
    print(
        f"{'way':12}{'loop ms':>10}{'alone ms':>10}{'slowdown':>10}{'save s':>9}{'GB/s':>7}{'stall/save ms':>15}"
    )
    results = []
    for name, way in ways.items():
        alone = statistics.median(loop(layers, x, args.iterations // 3, args.loop_sync) for _ in range(3))
        stop = threading.Event()
        times: list[float] = []

        def beside(
            way: Callable[[], None] = way, stop: threading.Event = stop, times: list[float] = times
        ) -> None:
            while not stop.is_set():
                began = time.perf_counter()
                way()
                times.append(time.perf_counter() - began)

        thread = threading.Thread(target=beside)
        thread.start()
        time.sleep(0.05)
        during = loop(layers, x, args.iterations, args.loop_sync)
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
    if child is not None:
        child[1].send(None)
        child[0].join(60)
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    print("RESULT loop_slowdown,stall_per_save " + " ".join(results))


if __name__ == "__main__":
    main()
