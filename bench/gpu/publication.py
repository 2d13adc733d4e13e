"""Publication on one GPU against a copy of the same bytes: in process and across processes.

    python bench/gpu/publication.py [--hidden 896 --layers 24 --intermediate 4864 --heads 14 --kv-heads 2]
        [--reps 20]

The model is the built-in one shaped like Qwen2-0.5B (bf16, 358M parameters, 716 MB with the
project's small vocabulary), trained weights on the GPU, an engine's weights beside them on
the same GPU. Times (CUDA-synchronised, medians of ``--reps``):

- copy: one device-to-device copy of a buffer of the published bytes (the floor);
- per tensor (before): each tensor cloned into the staged copy, copied into the engine,
  and fingerprinted on both sides, tensor by tensor;
- buckets, in process: the trainer's weights, which it trains in buckets of its own, copied
  whole into staged buckets (one copy per dtype), then into the engine's own buckets of
  the same layout (one copy per dtype); and the fingerprints of both sides
  (``fingerprint_buckets``: one launch and one sync per dtype each). The packing a trainer
  without buckets would do instead (``Buckets.of``, one ``torch.cat`` per dtype) is timed
  beside;
- buckets, across processes: the same staging, shared with an engine process on the same
  GPU by the ``cuda_ipc`` transport (a record under /dev/shm naming each buffer's IPC
  handle), the engine opening it and copying into its buckets, timed from the start of the
  packing to the engine's answer over a pipe.

Prints a table with each rate against the copy's (bytes read + written) and a ``RESULT``
line. Goals: in process < 5 ms, across processes < 20 ms, >= 70% of the copy rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from qwen_shape import add_shape_arguments, prepare_model  # noqa: E402

from miles_events.rl.buckets import Buckets, bucket_parameters, fingerprint_buckets  # noqa: E402
from miles_events.rl.checksum import K1, K2, K3, fingerprints  # noqa: E402
from miles_events.rl.checksum_triton import segment_sums  # noqa: E402
from miles_events.rl.hf_model import load_model  # noqa: E402
from miles_events.rl.weights import split_tied  # noqa: E402
from miles_events.transport.cuda_ipc import CudaIpcTransport  # noqa: E402
from schemas.data import DataRef  # noqa: E402


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` between two device synchronisations, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_process(model_dir: str, run_id: str, requests: mp.Queue, answers: mp.Queue) -> None:
    """An engine on the same GPU in a process of its own: loads each publication named on
    ``requests`` from the cuda_ipc transport into its buckets, answers with its time."""
    model = load_model(model_dir, "bfloat16").cuda()
    served, _ = split_tied(model.state_dict())
    own = bucket_parameters(model, served)
    plane = CudaIpcTransport(run_id)
    answers.put("ready")
    while (key := requests.get()) is not None:
        start = time.perf_counter()
        staged = plane.get_buckets(DataRef("cuda_ipc", key, "trainer"))
        assert staged is not None and staged.layouts == own.layouts
        own.copy_from(staged)
        torch.cuda.synchronize()
        del staged  # the mapping goes once no tensor of it is left
        answers.put(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_shape_arguments(parser)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    model_dir = str(prepare_model(args))
    trainer = load_model(model_dir, "bfloat16").cuda()
    weights, _ = split_tied(trainer.state_dict())
    engine = load_model(model_dir, "bfloat16").cuda()
    engine_weights, _ = split_tied(engine.state_dict())
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"{torch.cuda.get_device_name()}: {len(weights)} tensors, {num_bytes / 1e6:.0f} MB")

    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    copy_s = timed(lambda: target.copy_(source), args.reps)

    def per_tensor() -> None:
        staged = {n: t.clone() for n, t in weights.items()}
        for name, tensor in staged.items():
            engine_weights[name].copy_(tensor)
        fingerprints(staged)
        fingerprints(engine_weights)

    per_tensor_s = timed(per_tensor, args.reps)

    engine_buckets = bucket_parameters(engine, engine_weights)
    pack_s = timed(lambda: Buckets.of(weights), args.reps)
    # The trainer trains in buckets of its own (TrainerBackend.weight_buckets): staging
    # copies each bucket whole.
    trainer_buckets = bucket_parameters(trainer, weights)

    def stage() -> Buckets:
        return Buckets(trainer_buckets.layouts, tuple(b.clone() for b in trainer_buckets.buffers))

    stage_s = timed(stage, args.reps)
    staged = stage()
    assert staged.layouts == engine_buckets.layouts
    load_s = timed(lambda: engine_buckets.copy_from(staged), args.reps)
    publish_s = timed(lambda: engine_buckets.copy_from(stage()), args.reps)
    fingerprint_s = timed(lambda: fingerprint_buckets(staged), args.reps)
    sweep = {}
    layout, buffer = staged.layouts[0], staged.buffers[0]
    for per_job in (2, 4, 8, 16, 32):
        sweep[per_job] = timed(
            lambda p=per_job: segment_sums(buffer, layout, layout.slots, K1, K2, K3, tiles_per_job=p), args.reps
        )
    reference = fingerprints({n: t.cpu() for n, t in split_tied(trainer.state_dict())[0].items()})
    assert fingerprint_buckets(engine_buckets) == fingerprint_buckets(staged) == reference, (
        "bucket fingerprints differ from the CPU reference"
    )

    run_id = f"bench-{int(time.time())}"
    plane = CudaIpcTransport(run_id)
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=engine_process, args=(model_dir, run_id, requests, answers))
    child.start()
    assert answers.get(timeout=300) == "ready"
    cross, opened = [], []
    previous: DataRef | None = None
    for rep in range(args.reps + 2):
        start = time.perf_counter()
        ref = plane.put_buckets(f"weights-v{rep}", stage(), owner="trainer")
        requests.put(ref.key)
        child_s = answers.get(timeout=120)
        if rep >= 2:
            cross.append(time.perf_counter() - start)
            opened.append(child_s)
        if previous is not None:
            plane.free(previous)
        previous = ref
    requests.put(None)
    child.join(60)
    plane.close()
    cross_s, child_s = statistics.median(cross), statistics.median(opened)

    def rate(seconds: float, moved: int = 2 * num_bytes) -> float:
        return moved / seconds / 1e9

    copy_rate = rate(copy_s)
    rows = [
        ("copy of the same bytes (floor)", copy_s, copy_rate),
        ("per tensor: clone + copy + fingerprints (before)", per_tensor_s, None),
        ("buckets: pack tensor by tensor (a trainer without buckets)", pack_s, rate(pack_s)),
        ("buckets: stage (one copy per trainer bucket)", stage_s, rate(stage_s)),
        ("buckets: load into the engine (copy)", load_s, rate(load_s)),
        ("buckets: publish in process (stage + load)", publish_s, rate(publish_s, 4 * num_bytes)),
        ("buckets: fingerprint every tensor (one side)", fingerprint_s, rate(fingerprint_s, num_bytes)),
        ("cuda_ipc: publish across processes (stage + share + open + load)", cross_s, rate(cross_s, 4 * num_bytes)),
        ("cuda_ipc: the engine's part (open + load)", child_s, rate(child_s)),
    ]
    print("\n| step | ms | GB/s (read + write) | / copy rate |\n|---|---|---|---|")
    for name, seconds, gbps in rows:
        shown = f"{gbps:.0f} | {gbps / copy_rate:.2f}" if gbps is not None else "- | -"
        print(f"| {name} | {seconds * 1e3:.3f} | {shown} |")
    print("\nbucket fingerprint by tiles per job: " + ", ".join(
        f"{p}: {s * 1e3:.3f} ms ({rate(s, num_bytes):.0f} GB/s)" for p, s in sweep.items()
    ))
    print(
        f"RESULT bytes={num_bytes} copy_ms={copy_s * 1e3:.3f} per_tensor_ms={per_tensor_s * 1e3:.2f} "
        f"publish_ms={publish_s * 1e3:.3f} publish_vs_copy={rate(publish_s, 4 * num_bytes) / copy_rate:.2f} "
        f"cross_process_ms={cross_s * 1e3:.3f} cross_vs_copy={rate(cross_s, 4 * num_bytes) / copy_rate:.2f} "
        f"fingerprint_ms={fingerprint_s * 1e3:.3f} fingerprint_gbps={rate(fingerprint_s, num_bytes):.0f} "
        f"speedup_vs_per_tensor={per_tensor_s / (publish_s + 2 * fingerprint_s):.1f}"
    )


if __name__ == "__main__":
    main()
