"""One RL step of the embedded default, split into generate / train / publish / verify / save.

    .venv/bin/python bench/rl_step.py [--runtime local|ray] [--rollouts 12] [--config examples/tiny.toml]
        [--set KEY=VALUE ...]

``--set`` takes the run's own overrides, e.g. two vLLM engines:
``--set generator.engine='"vllm"' --set generator.num_engines=2`` (with the model and
verifier settings a vLLM run needs: see bench/vllm_engine.py's ``VLLM_RUN``).

Runs the embedded default with a save after every rollout, then reads the run's event log:
- step: wall time between consecutive ``RolloutRequested`` events (the whole loop); the
  median, and the mean, which counts the steps a save every few rollouts slows,
- generate / train: ``RolloutGenerated.generate_seconds`` / ``TrainStepFinished.train_seconds``,
- publish: ``WeightsPublished.publish_seconds`` (from the request to every engine's load,
  waits included: a save asked for before it stages the train state first), and of that
  the publication's own work: ``WeightsStaged.stage_seconds`` plus the slowest
  ``WeightsLoaded.load_seconds``,
- verify: what verification adds to a step: fingerprinting the published tensors on the
  trainer and on every engine (measured here on the same weights, in the run's dtype, on
  the device the run used, packed in buckets as the run packs them) plus the Verifier's
  comparison (``PublicationVerified.verify_seconds``),
- save: ``CheckpointSaved.save_seconds`` (runs beside the publication, not in series),
  and for each save when its train state was staged and its checkpoint written, and how
  long the publication asked for with it waited before the trainer took it up.
Medians over the rollouts after the first (warm-up), then every step and train step.
``--watch-interpreter`` also reports the gaps over 20 ms of a thread that ticks every
millisecond beside a local run: whether another thread held the interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from miles_events.app.config import load_config
from miles_events.app.roster import ACTORS
from miles_events.app.run import configure_logging
from miles_events.app.session import Session
from miles_events.bus.event_log import read_events
from miles_events.device.buckets import Buckets, fingerprint_buckets
from miles_events.rl.hf_model import load_model
from miles_events.rl.weights import split_tied
from schemas.events import (
    CheckpointSaved,
    PublicationVerified,
    PublishRequested,
    RolloutGenerated,
    RolloutRequested,
    SaveRequested,
    TrainStateStaged,
    TrainStepFinished,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)

ROOT = Path(__file__).resolve().parent.parent


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 2 else values)


def fingerprint_seconds(model_path: str, dtype: str, repeats: int = 20) -> float:
    """One side's fingerprinting of a publication as the run does it: the model's weights in
    the run's dtype, packed in buckets on the device the run trains on (a GPU when there is
    one), every tensor fingerprinted (one fused launch per dtype on a GPU)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights, _ = split_tied(load_model(model_path, dtype).to(device).state_dict())
    buckets = Buckets.of(weights)
    fingerprint_buckets(buckets)
    start = time.perf_counter()
    for _ in range(repeats):
        fingerprint_buckets(buckets)
    return (time.perf_counter() - start) / repeats


def tick(ticks: list[tuple[float, float]]) -> None:
    """Sleep a millisecond at a time, recording (when, how long) each sleep took: a long one
    is the interpreter held by another thread (or the process not running)."""
    last = time.time()
    while True:
        time.sleep(0.001)
        now = time.time()
        ticks.append((last, now - last))
        last = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--runtime", default="local", choices=["local", "ray"])
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--keep-log", default=None, metavar="PATH", help="copy the run's event log to PATH")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        help="of the run's processes, as python -m miles_events.run's (e.g. info)",
    )
    parser.add_argument(
        "--watch-interpreter", action="store_true",
        help="a thread ticks every ms beside the run (local runtime): reports the gaps over 20 ms in the loop",
    )  # fmt: skip
    args = parser.parse_args()
    configure_logging(args.log_level)
    ticks: list[tuple[float, float]] = []
    if args.watch_interpreter:
        threading.Thread(target=tick, args=(ticks,), daemon=True).start()
    run_dir = Path(tempfile.mkdtemp(prefix="rl-step-"))
    config = load_config(
        args.config,
        [
            f'run.dir="{run_dir}"',
            f'run.runtime="{args.runtime}"',
            f"run.num_rollout={args.rollouts}",
            "run.save_interval=1",
            "run.skip_eval_before_train=true",
            *args.set,
        ],
    )
    config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, eval_interval=None))
    session = Session(config, list(ACTORS))
    result = asyncio.run(session.run())
    assert result.finished.status == "completed", result.finished
    log = list(read_events(run_dir / "events.log"))
    if args.keep_log:
        shutil.copyfile(run_dir / "events.log", args.keep_log)

    requested = [e.time for e in log if isinstance(e, RolloutRequested)]
    steps = [b - a for a, b in itertools.pairwise(requested)]
    generate = [e.generate_seconds for e in log if isinstance(e, RolloutGenerated)]
    train = [e.train_seconds for e in log if isinstance(e, TrainStepFinished)]
    publish = [e.publish_seconds for e in log if isinstance(e, WeightsPublished) and e.rollout_id is not None]
    # A publication's own work: the trainer's staging and the slowest engine's load, by version.
    stage = {e.weight_version: e.stage_seconds for e in log if isinstance(e, WeightsStaged)}
    load: dict[str, float] = {}
    for e in log:
        if isinstance(e, WeightsLoaded):
            load[e.weight_version] = max(load.get(e.weight_version, 0.0), e.load_seconds)
    own = [
        stage[e.weight_version] + load.get(e.weight_version, 0.0)
        for e in log
        if isinstance(e, WeightsPublished) and e.rollout_id is not None and e.weight_version in stage
    ]
    compare = [
        e.verify_seconds for e in log if isinstance(e, PublicationVerified) and e.rollout_id is not None
    ]
    save = [e.save_seconds for e in log if isinstance(e, CheckpointSaved)]
    num_engines = config.generator.num_engines
    fingerprint = fingerprint_seconds(session.config.model.path or "", config.model.dtype) * (1 + num_engines)
    verify = [fingerprint + c for c in compare]

    rows = {
        "step (wall)": median_after_warmup(steps),
        "step (mean)": statistics.mean(steps[1:] if len(steps) > 2 else steps),
        "generate": median_after_warmup(generate),
        "train": median_after_warmup(train),
        "publish": median_after_warmup(publish),
        "  stage + load": median_after_warmup(own),
        "verify": median_after_warmup(verify),
        "save (beside)": median_after_warmup(save),
    }
    step = rows["step (wall)"]
    print(f"runtime {args.runtime}, {args.rollouts} rollouts, {num_engines} engine(s); medians after warm-up")
    print(f"{'phase':16}{'ms':>10}{'% of step':>12}")
    for name, seconds in rows.items():
        print(f"{name:16}{seconds * 1000:10.2f}{100 * seconds / step:11.1f}%")
    saved = {e.rollout_id for e in log if isinstance(e, SaveRequested)}
    print(
        "each step, ms (* after a rollout with a save): "
        + ", ".join(
            f"{seconds * 1000:.0f}{'*' if rollout in saved else ''}" for rollout, seconds in enumerate(steps)
        )
    )
    print(
        "each rollout, ms generating (response tokens): "
        + ", ".join(
            f"{e.generate_seconds * 1000:.0f} ({e.response_tokens})"
            for e in log
            if isinstance(e, RolloutGenerated)
        )
    )
    print("each train step, ms: " + ", ".join(f"{seconds * 1000:.0f}" for seconds in train))
    print(
        "each rollout asked for at (to read beside the log's lines): "
        + ", ".join(
            time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}" for t in requested
        )
    )
    staged = {e.rollout_id: e.time for e in log if isinstance(e, TrainStateStaged)}
    written = {e.rollout_id: e.time for e in log if isinstance(e, CheckpointSaved)}
    asked = {e.rollout_id: e.time for e in log if isinstance(e, SaveRequested)}
    if asked:
        print(
            "each save, s after it was asked for (staged, written): "
            + ", ".join(
                f"rollout {r}: {staged.get(r, t) - t:.2f}, {written.get(r, t) - t:.2f}"
                for r, t in sorted(asked.items())
            )
        )
        # The publication asked for with a save: how long it waited before the trainer took
        # it up (behind the save's snapshot and whatever else the trainer was doing).
        publish_asked = {e.rollout_id: e.time for e in log if isinstance(e, PublishRequested)}
        waited = [
            (e.rollout_id, e.time - e.stage_seconds - publish_asked[e.rollout_id], e.stage_seconds)
            for e in log
            if isinstance(e, WeightsStaged) and e.rollout_id in asked and e.rollout_id in publish_asked
        ]
        print(
            "each save's publication, ms before the trainer took it up (its own staging): "
            + ", ".join(f"rollout {r}: {before * 1000:.0f} ({own * 1000:.0f})" for r, before, own in waited)
        )
    if args.watch_interpreter:
        inside = [(t, gap) for t, gap in list(ticks) if requested[0] <= t <= requested[-1]]
        long = [(t - requested[0], gap) for t, gap in inside if gap > 0.02]
        print(
            f"interpreter: {len(long)} gaps over 20 ms in the loop ({requested[-1] - requested[0]:.1f} s)"
            + "".join(f", {gap * 1000:.0f} ms at {t:.1f} s" for t, gap in long)
        )
    fraction = rows["verify"] / step
    print(f"verification is {100 * fraction:.2f}% of a step (goal < 5%)")
    print(
        f"RESULT verify_fraction={fraction:.4f} step_ms={step * 1000:.1f} "
        f"step_mean_ms={rows['step (mean)'] * 1000:.1f} generate_ms={rows['generate'] * 1000:.1f} "
        f"train_ms={rows['train'] * 1000:.1f} publish_ms={rows['publish'] * 1000:.1f} "
        f"stage_load_ms={rows['  stage + load'] * 1000:.1f} "
        f"verify_ms={rows['verify'] * 1000:.2f} save_ms={rows['save (beside)'] * 1000:.1f}"
    )


if __name__ == "__main__":
    main()
