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
  staging to the engine's answer over a pipe. The producer shares the buckets with the
  staging still queued; the engine's stream waits for it on the GPU (the transport's ready
  event). Three times: staged into new buffers each time (every publication a new handle
  the engine maps); staged as the trainer does, into the buffers of a publication the
  engine said it was done with (``StagingPool``: the engine finds them mapped already);
  and so, with the producer waiting on the host for its staging before it shares (what a
  producer without the ready event must do). Then with the engine answering as soon as its
  copy is queued, as ``TorchEngine.load_weights`` returns (``done_reading``: the transport's
  read event recorded behind it), and the producer waiting on the host for that event (``reads_of``):
  the publication's end as the producer sees it, with no host sync and answer between the
  engine's copy and the producer. Each side's copy is also timed on the GPU
  (CUDA events around it): what the wall-clock parts spend beyond it is the host's; the
  pipe's round trip with no work at all is timed beside. Other reps are traced: each side
  reads the GPU's global timer (``%globaltimer``, one clock for every process on the GPU)
  on its stream before and after its copy, and the host's clock at each step of its own;
  the GPU's timer, read on the host's clock (``clock_offset``), puts both on one timeline
  (printed for the staging reused): where the host waits for the GPU, and where the GPU
  for the host or for the switch between the two processes.

Prints a table with each rate against the copy's (bytes read + written) and a ``RESULT``
line. Goals: in process < 5 ms, across processes < 20 ms, >= 70% of the copy rate.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.multiprocessing as mp
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from qwen_shape import add_shape_arguments, prepare_model  # noqa: E402

from miles_events.device.buckets import Buckets, bucket_parameters, fingerprint_buckets  # noqa: E402
from miles_events.device.checksum_triton import segment_sums  # noqa: E402
from miles_events.device.fingerprint import K1, K2, K3, fingerprints  # noqa: E402
from miles_events.device.staging import StagingPool  # noqa: E402
from miles_events.rl.hf_model import load_model  # noqa: E402
from miles_events.rl.weights import split_tied  # noqa: E402
from miles_events.runtime.heap import freeze_start_up  # noqa: E402
from miles_events.transport.cuda_ipc import CudaIpcReader, CudaIpcTransport  # noqa: E402
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


@triton.jit
def _stamp_kernel(clock_ptr, slot):
    now = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(clock_ptr + slot, now)


def stamp(clock: torch.Tensor, slot: int) -> None:
    """Write the GPU's global timer (ns) into ``clock[slot]`` once the work queued before it
    on the current stream has run: the same clock for every process on the GPU."""
    _stamp_kernel[(1,)](clock, slot)


def clock_offset(clock: torch.Tensor, reps: int = 50) -> tuple[int, int]:
    """What to add to the GPU's global timer to read it on the host's monotonic clock
    (``time.perf_counter_ns``, one for every process), and the reading's uncertainty (ns):
    from the tightest of ``reps`` brackets of a stamp on the idle GPU between the host's
    time before its launch and after its sync."""
    best = None
    for _ in range(reps):
        torch.cuda.synchronize()
        before = time.perf_counter_ns()
        stamp(clock, 0)
        torch.cuda.synchronize()
        after = time.perf_counter_ns()
        if best is None or after - before < best[1] - best[0]:
            best = (before, after, clock[0].item())
    before, after, gpu = best
    return (before + after) // 2 - gpu, (after - before) // 2


TIMELINE = (
    "staging starts (GPU)", "staging queued", "shared (put_buckets)", "the engine has the key",
    "the engine's copy queued", "staging ends (GPU)", "the engine's copy starts (GPU)",
    "the engine's copy ends (GPU)", "the engine's wait for it returns", "the producer has the answer",
)  # fmt: skip
"""The marks of a traced publication across processes, in the order they come."""


PING = "ping"
"""Asks the engine process to answer at once: the pipe's round trip, the host's floor."""


GPU_PING = "gpu-ping"
"""Asks the engine process to answer once a one-element kernel of its own has run, right
after one of the producer's: the round trip with each process's GPU work waited for."""


SPIN = "spin"
"""``(SPIN, True)`` asks the engine process to wait for each message by polling the pipe
without sleeping (``receive``), ``(SPIN, False)`` to sleep in the wait again."""


def receive(pipe: Connection, spin: bool, timeout: float = 120.0) -> object:
    """The next message on ``pipe``: waited for asleep in the kernel, or when ``spin`` by
    polling without sleeping (a process woken from its sleep takes a while to run).
    Raises TimeoutError after ``timeout`` seconds."""
    if spin:
        deadline = time.monotonic() + timeout
        while not pipe.poll(0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer on the pipe within {timeout:g} s")
    elif not pipe.poll(timeout):
        raise TimeoutError(f"no answer on the pipe within {timeout:g} s")
    return pipe.recv()


def round_trip(pipe: Connection, reps: int, gpu: bool = False) -> float:
    """Median seconds of a ``PING`` (a ``GPU_PING`` after a kernel of this process, waited
    for, when ``gpu``) to the engine process and its answer, after two warm-ups."""
    times = []
    tiny = torch.zeros(1, device="cuda")
    for rep in range(reps + 2):
        start = time.perf_counter()
        if gpu:
            tiny.add_(1)
        pipe.send(GPU_PING if gpu else PING)
        assert pipe.recv() == (GPU_PING if gpu else PING)
        if gpu:
            torch.cuda.synchronize()
        if rep >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_process(model_dir: str, run_id: str, pipe: Connection) -> None:
    """An engine on the same GPU in a process of its own: loads each publication named on
    ``pipe`` from the cuda_ipc transport into its buckets (as ``TorchEngine`` does: one copy
    a bucket, done before it answers), answers with its time."""
    model = load_model(model_dir, "bfloat16").cuda()
    served, _ = split_tied(model.state_dict())
    own = bucket_parameters(model, served)
    plane = CudaIpcTransport(run_id)
    freeze_start_up()  # as every process of a run does once its actors have started
    tiny = torch.zeros(1, device="cuda")
    pipe.send("ready")
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clock = torch.zeros(2, dtype=torch.int64, device="cuda")
    offset, uncertainty = clock_offset(clock)
    pipe.send(("clock", offset, uncertainty))
    matched = None  # the staged layouts found to be the engine's (TorchEngine compares them once too)
    spin = False
    while (asked := receive(pipe, spin)) is not None:
        if isinstance(asked, tuple) and asked[0] == SPIN:
            spin = asked[1]
            continue
        if asked in (PING, GPU_PING):
            if asked == GPU_PING:
                tiny.add_(1)
                torch.cuda.synchronize()
            pipe.send(asked)
            continue
        key, kind, host_wait, early = asked
        gpu_timed, traced = kind == "gpu", kind == "traced"
        # The engine waits for the producer's ready event on its stream (the transport's
        # way), or, when ``host_wait``, on the host before it queues its copy.
        plane.reader._wait_ready = (
            (lambda event, device: event.synchronize()) if host_wait else CudaIpcReader._wait_ready
        )
        got = time.perf_counter_ns()
        ref = DataRef("cuda_ipc", key, "trainer")
        staged = plane.reader.get_buckets(ref)
        assert staged is not None
        if staged.layouts is not matched:
            assert staged.layouts == own.layouts
            matched = staged.layouts
        if gpu_timed:
            began.record()
        if traced:
            stamp(clock, 0)
        own.copy_from(Buckets(own.layouts, staged.buffers))
        if gpu_timed:
            ended.record()
        if traced:
            stamp(clock, 1)
        if early:  # the transport's read event behind the copy, and a receipt naming it
            plane.reader.done_reading(ref, staged.device)
        queued = time.perf_counter_ns()
        if early:  # answered with the copy queued: the producer waits for the read event
            pipe.send(((queued - got) / 1e9, (queued - got) / 1e9, None, None))
        torch.cuda.synchronize()
        synced = time.perf_counter_ns()
        del staged
        marks = None
        if traced:
            copy_start, copy_end = (t + offset for t in clock.tolist())
            marks = {
                "the engine has the key": got, "the engine's copy queued": queued,
                "the engine's copy starts (GPU)": copy_start, "the engine's copy ends (GPU)": copy_end,
                "the engine's wait for it returns": synced,
            }  # fmt: skip
        gpu_s = began.elapsed_time(ended) / 1e3 if gpu_timed else None
        pipe.send(((time.perf_counter_ns() - got) / 1e9, (queued - got) / 1e9, gpu_s, marks))
    plane.close()


def across_processes(
    plane: CudaIpcTransport,
    pipe: Connection,
    stage: Callable[[Buckets], None],
    layouts,
    reps: int,
    reuse: bool,
    host_sync: bool = False,
    host_wait: bool = False,
    spin: bool = False,
    early: bool = False,
    after_own_work: bool = False,
    *,
    offset: int,
) -> dict[str, float]:
    """Medians, in seconds, of a publication across processes (``whole``: stage, share, the
    engine's open and load, its answer) and of its parts (``stage``: the copy queued, or
    waited for when ``host_sync``; ``share``: ``put_buckets``; ``engine``: the engine's open
    and load, as it times them, and ``engine_host`` its part until the copy is queued;
    ``stage_gpu``, ``engine_gpu``: each side's copy as the GPU times it; each of ``TIMELINE``,
    from the start, on the host's clock: the host's steps as read, the GPU's global timer
    put on it by adding ``offset``, this process's ``clock_offset``, the engine process's
    by its own), and the staging buffers allocated
    (``allocated``): into the buffers of a
    publication the engine said it was done with (``StagingPool``, as the trainer does) when
    ``reuse``, else into new ones each time. Without ``host_sync`` the producer shares the
    buckets with the staging still queued, and the engine's stream waits for it on the GPU
    (the transport's ready event), or, when ``host_wait``, on the host. With ``spin`` each
    process waits for the other's message without sleeping (``receive``). With ``early`` the
    engine answers as soon as its copy is queued (``done_reading``: its read event recorded
    behind it, a receipt naming it), as ``TorchEngine.load_weights`` returns, and the producer
    waits on the host for the events of the key's receipts (``reads_of``): the publication is over when
    the engine's copy is, as the producer sees it. Otherwise the engine waits for its copy on
    the host before it answers. With ``after_own_work`` each publication starts right after
    a kernel of the producer's, waited for, as a run's starts right after its train step:
    the GPU runs the producer's context when it starts, where otherwise the last work on
    it was the engine's (its copy of the publication before). Reps take turns: the
    wall-clock times come from reps with nothing added, the GPU times from reps with CUDA
    events around each side's copy, the timeline from reps with a stamp of the GPU's timer
    before and after each side's copy (each a launch of the host's, on the
    publication's path)."""
    pool = StagingPool()
    times: dict[str, list[float]] = {
        "whole": [], "stage": [], "share": [], "engine": [], "engine_host": [], "stage_gpu": [], "engine_gpu": [],
    } | {mark: [] for mark in TIMELINE}  # fmt: skip
    clock = torch.zeros(2, dtype=torch.int64, device="cuda")
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    kinds = ("wall", "gpu", "traced")
    own_work = torch.zeros(1, device="cuda")
    pipe.send((SPIN, spin))
    for rep in range(len(kinds) * (reps + 1)):
        kind = kinds[rep % len(kinds)]
        key = f"weights-{'reused' if reuse else 'fresh'}-v{rep}"
        if after_own_work:
            own_work.add_(1)
            torch.cuda.synchronize()
        start = time.perf_counter_ns()
        buckets = pool.take(layouts, "cuda") if reuse else Buckets.allocate(layouts, "cuda")
        if kind == "gpu":
            began.record()
        if kind == "traced":
            stamp(clock, 0)
        stage(buckets)
        if kind == "gpu":
            ended.record()
        if kind == "traced":
            stamp(clock, 1)
        if host_sync:
            torch.cuda.synchronize()
        staged = time.perf_counter_ns()
        pool.lend(key, buckets)
        ref = plane.stager.put_buckets(key, buckets, owner="trainer")
        shared = time.perf_counter_ns()
        pipe.send((ref.key, kind, host_wait, early))
        reads = ()
        if early:
            receive(pipe, spin)  # the engine's copy is queued, its read event behind it
            reads = plane.stager.reads_of(ref)
            assert len(reads) == 1
            reads[0].synchronize()
            answered = time.perf_counter_ns()
        engine_s, engine_host_s, engine_gpu_s, engine_marks = receive(pipe, spin)
        if not early:
            answered = time.perf_counter_ns()
        if rep < len(kinds):
            pass
        elif kind == "gpu":
            ended.synchronize()  # done already (the engine's copy waited for it): for its time
            times["stage_gpu"].append(began.elapsed_time(ended) / 1e3)
            times["engine_gpu"].append(engine_gpu_s)
        elif kind == "traced":
            stage_start, stage_end = (t + offset for t in clock.tolist())
            marks = engine_marks | {
                "staging starts (GPU)": stage_start, "staging queued": staged, "shared (put_buckets)": shared,
                "staging ends (GPU)": stage_end, "the producer has the answer": answered,
            }  # fmt: skip
            for mark, ns in marks.items():
                times[mark].append((ns - start) / 1e9)
        else:
            for name, seconds in (
                ("whole", (answered - start) / 1e9),
                ("stage", (staged - start) / 1e9),
                ("share", (shared - staged) / 1e9),
                ("engine", engine_s),
                ("engine_host", engine_host_s),
            ):
                times[name].append(seconds)
        pool.give_back(key, reads)  # the engine's load is done: the Publisher's DataReleased
        plane.stager.free(ref)
    pipe.send((SPIN, False))
    return {name: statistics.median(values) for name, values in times.items()} | {
        "allocated": pool.num_allocated
    }


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
            lambda p=per_job: segment_sums(buffer, layout, layout.slots, K1, K2, K3, tiles_per_job=p),
            args.reps,
        )
    reference = fingerprints({n: t.cpu() for n, t in split_tied(trainer.state_dict())[0].items()})
    assert fingerprint_buckets(engine_buckets) == fingerprint_buckets(staged) == reference, (
        "bucket fingerprints differ from the CPU reference"
    )

    run_id = f"bench-{int(time.time())}"
    plane = CudaIpcTransport(run_id)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=engine_process, args=(model_dir, run_id, theirs))
    child.start()
    if not ours.poll(300) or ours.recv() != "ready":
        raise RuntimeError("the engine process did not start within 300 s")
    _, engine_offset, engine_uncertainty = receive(ours, spin=False)
    offset, uncertainty = clock_offset(torch.zeros(1, dtype=torch.int64, device="cuda"))
    freeze_start_up()

    def stage_into(buckets: Buckets) -> None:
        buckets.copy_from(trainer_buckets)

    across = functools.partial(
        across_processes, plane, ours, stage_into, trainer_buckets.layouts, args.reps, offset=offset
    )
    fresh = across(reuse=False)
    reused = across(reuse=True)
    synced = across(reuse=True, host_sync=True)
    host_waited = across(reuse=True, host_wait=True)
    spun = across(reuse=True, spin=True)
    early = across(reuse=True, early=True)
    early_spun = across(reuse=True, spin=True, early=True)
    reused_after = across(reuse=True, after_own_work=True)
    early_after = across(reuse=True, early=True, after_own_work=True)
    early_spun_after = across(reuse=True, spin=True, early=True, after_own_work=True)
    ping_s = round_trip(ours, args.reps)
    gpu_ping_s = round_trip(ours, args.reps, gpu=True)
    ours.send(None)
    child.join(60)
    plane.close()

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
        *(
            row
            for label, cross in (
                ("new buffers each time", fresh),
                ("staging reused", reused),
                ("staging reused, waited for on the host before sharing", synced),
                ("staging reused, the engine waiting on the host for the ready event", host_waited),
                ("staging reused, each process waiting for the other's message without sleeping", spun),
                (
                    "staging reused, the engine answering with its copy queued and the producer waiting for its read event",
                    early,
                ),
                ("the same, each process waiting for the other's message without sleeping", early_spun),
                (
                    "staging reused, right after the producer's own GPU work (as after a train step)",
                    reused_after,
                ),
                ("the same, the engine answering with its copy queued", early_after),
                ("the same, each process waiting for the other's message without sleeping", early_spun_after),
            )
            for row in (
                (
                    f"cuda_ipc, {label}: publish across processes (stage + share + open + load)",
                    cross["whole"],
                    rate(cross["whole"], 4 * num_bytes),
                ),
                (
                    f"cuda_ipc, {label}: of which the staging (copy queued, or waited for)",
                    cross["stage"],
                    None,
                ),
                (
                    f"cuda_ipc, {label}: the staging's copy on the GPU",
                    cross["stage_gpu"],
                    rate(cross["stage_gpu"]),
                ),
                (f"cuda_ipc, {label}: of which the sharing (put_buckets)", cross["share"], None),
                (
                    f"cuda_ipc, {label}: of which the engine's part (open + load)",
                    cross["engine"],
                    rate(cross["engine"]),
                ),
                (
                    f"cuda_ipc, {label}: of which the engine's host work until its copy is queued",
                    cross["engine_host"],
                    None,
                ),
                (
                    f"cuda_ipc, {label}: the engine's copy on the GPU",
                    cross["engine_gpu"],
                    rate(cross["engine_gpu"]),
                ),
            )
        ),
    ]
    print("\n| step | ms | GB/s (read + write) | / copy rate |\n|---|---|---|---|")
    for name, seconds, gbps in rows:
        shown = f"{gbps:.0f} | {gbps / copy_rate:.2f}" if gbps is not None else "- | -"
        print(f"| {name} | {seconds * 1e3:.3f} | {shown} |")
    print(
        f"| the pipe's round trip to the engine process, no work (the host's floor) | {ping_s * 1e3:.3f} | - | - |"
    )
    print(f"| the same with a one-element kernel on each side, waited for | {gpu_ping_s * 1e3:.3f} | - | - |")
    print(
        f"\nA publication across processes (staging reused), traced: each mark's median, ms from its start. The GPU's "
        f"timer read on the host's clock to +-{uncertainty / 1e3:.1f} us here, +-{engine_uncertainty / 1e3:.1f} us in the "
        f"engine's process (the two readings differ by {abs(offset - engine_offset) / 1e3:.1f} us)."
    )
    print(
        "\n| mark | ms | same, waiting without sleeping | the engine answering with its copy queued "
        "(the producer has the answer: its read event seen done) | the same, right after the producer's own GPU work "
        "|\n|---|---|---|---|---|"
    )
    for mark in sorted(TIMELINE, key=lambda m: reused[m]):
        print(
            f"| {mark} | {reused[mark] * 1e3:.3f} | {spun[mark] * 1e3:.3f} | {early[mark] * 1e3:.3f} "
            f"| {early_after[mark] * 1e3:.3f} |"
        )
    gap = reused["the engine's copy starts (GPU)"] - reused["staging ends (GPU)"]
    span = reused["the engine's copy ends (GPU)"] - reused["staging starts (GPU)"]
    print(
        "\nbucket fingerprint by tiles per job: "
        + ", ".join(f"{p}: {s * 1e3:.3f} ms ({rate(s, num_bytes):.0f} GB/s)" for p, s in sweep.items())
    )
    variants = " ".join(
        f"cross_{name}_ms={cross['whole'] * 1e3:.3f} "
        f"cross_{name}_vs_copy={rate(cross['whole'], 4 * num_bytes) / copy_rate:.2f}"
        for name, cross in (
            ("spin", spun), ("read_event", early), ("read_event_spin", early_spun), ("after_own", reused_after),
            ("read_event_after_own", early_after), ("read_event_spin_after_own", early_spun_after),
            ("fresh", fresh), ("host_sync", synced), ("engine_host_wait", host_waited),
        )
    )  # fmt: skip
    print(
        f"RESULT bytes={num_bytes} copy_ms={copy_s * 1e3:.3f} per_tensor_ms={per_tensor_s * 1e3:.2f} "
        f"publish_ms={publish_s * 1e3:.3f} publish_vs_copy={rate(publish_s, 4 * num_bytes) / copy_rate:.2f} "
        f"cross_process_ms={reused['whole'] * 1e3:.3f} cross_vs_copy={rate(reused['whole'], 4 * num_bytes) / copy_rate:.2f} "
        f"cross_engine_vs_copy={rate(reused['engine']) / copy_rate:.2f} cross_gap_ms={gap * 1e3:.3f} "
        f"cross_gpu_span_ms={span * 1e3:.3f} cross_gpu_span_vs_copy={rate(span, 4 * num_bytes) / copy_rate:.2f} "
        f"{variants} round_trip_ms={ping_s * 1e3:.3f} gpu_round_trip_ms={gpu_ping_s * 1e3:.3f} "
        f"staging_allocated={reused['allocated']:.0f} "
        f"fingerprint_ms={fingerprint_s * 1e3:.3f} fingerprint_gbps={rate(fingerprint_s, num_bytes):.0f} "
        f"speedup_vs_per_tensor={per_tensor_s / (publish_s + 2 * fingerprint_s):.1f}"
    )


if __name__ == "__main__":
    main()
