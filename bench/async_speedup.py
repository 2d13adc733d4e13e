"""Asynchronous against synchronous training: time per trained rollout, same config.

    .venv/bin/python bench/async_speedup.py [--rollouts 30] [--staleness 1] [--repeats 2]
        [--runtime ray] [--set KEY=VALUE ...] [--work-dir DIR]

Runs ``examples/tiny.toml`` with ``run.max_staleness = 0`` (the seed's synchronous loop) and
``= --staleness`` (``staleness_policy = "wait"``), interleaved (sync, async, sync, async, ...),
pair ``i`` with ``run.seed = --seed + i``,
each stage on a core of its own (``rollout.num_threads = 1``, ``trainer.num_threads = 1``;
on ``ray`` the Generator and the Trainer are separate processes). Time per trained rollout
is read from each run's event log: from the first rollout asked for to the last step's
publication verified, over the rollouts trained (start-up and the opening left out). Also
printed: how long the engines waited between rollouts (for training and publication), the
mean reward of the last 5 rollouts and the eval after the last one (greedy, on
the eval set: equal reward after the same number of trained rollouts?), and the trained
tokens by staleness. ``--set trainer.rollout_is_cap=2`` corrects for the stale tokens. The last
line is ``RESULT ...`` with the median ratio sync / async (goal >= 1.7; 2 is the limit of two
stages).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_events.bus.event_log import read_events
from schemas.events import (
    EvalFinished,
    PublicationVerified,
    RolloutGenerated,
    RolloutRequested,
    TrainStepFinished,
)

ROOT = Path(__file__).resolve().parents[1]


def run(
    work: Path, name: str, args: argparse.Namespace, staleness: int, seed: int
) -> dict[str, float | list[int]]:
    run_dir = work / name
    sets = [
        f'run.dir="{run_dir}"',
        f'run.runtime="{args.runtime}"',
        f"run.num_rollout={args.rollouts}",
        f"run.seed={seed}",
        f"run.max_staleness={staleness}",
        "run.save_interval=1000",
        f"run.eval_interval={args.rollouts}",
        "run.skip_eval_before_train=true",
        "rollout.num_threads=1",
        "trainer.num_threads=1",
        "metrics.enabled=false",
        'console.mode="quiet"',
        *args.set,
    ]
    command = [sys.executable, "-m", "miles_events.run", str(ROOT / "examples" / "tiny.toml")]
    for item in sets:
        command += ["--set", item]
    subprocess.run(command, check=True, cwd=ROOT)
    log = list(read_events(run_dir / "events.log"))
    first = next(e.time for e in log if isinstance(e, RolloutRequested))
    last = [e.time for e in log if isinstance(e, PublicationVerified)][-1]
    steps = [e for e in log if isinstance(e, TrainStepFinished)]
    rewards = [e.reward_mean for e in log if isinstance(e, RolloutGenerated)]
    evals = [e.metrics.get("eval/reward_mean", 0.0) for e in log if isinstance(e, EvalFinished)]
    # How long the engines sat idle between a rollout generated and the next asked for
    # (waiting, in the synchronous loop, for the step's training and publication; with a
    # bound, for the publication that keeps the next rollout within it).
    asked = {e.rollout_id: e.time for e in log if isinstance(e, RolloutRequested)}
    done = {e.rollout_id: e.time for e in log if isinstance(e, RolloutGenerated)}
    waited = [max(0.0, asked[r] - done[r - 1]) for r in sorted(asked) if r - 1 in done]
    by_staleness: list[int] = []
    for step in steps:
        for age, tokens in enumerate(step.token_staleness):
            by_staleness.extend([0] * (age + 1 - len(by_staleness)))
            by_staleness[age] += tokens
    return {
        "per_rollout": (last - first) / len(steps),
        "reward_last5": statistics.fmean(rewards[-5:]),
        "eval": evals[-1] if evals else float("nan"),
        "gen": statistics.median(e.generate_seconds for e in log if isinstance(e, RolloutGenerated)),
        "train": statistics.median(e.train_seconds for e in steps),
        "staleness": by_staleness,
        "waited": statistics.fmean(waited) if waited else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="run.seed of the first pair; pair i runs seed + i (runs are deterministic)",
    )
    parser.add_argument("--runtime", default="ray", choices=["ray", "local"])
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE, as the CLI's --set")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="async-bench-"))
    ratios = []
    evals: dict[str, list[float]] = {"sync": [], "async": []}
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        sync = run(work, f"sync-{repeat}", args, 0, seed)
        asynchronous = run(work, f"async-{repeat}", args, args.staleness, seed)
        evals["sync"].append(float(sync["eval"]))
        evals["async"].append(float(asynchronous["eval"]))
        ratio = float(sync["per_rollout"]) / float(asynchronous["per_rollout"])
        ratios.append(ratio)
        for name, result in (("sync", sync), (f"async k={args.staleness}", asynchronous)):
            print(
                f"repeat {repeat} {name:>10}: {float(result['per_rollout']):.3f} s/rollout "
                f"(generate {float(result['gen']):.3f} s, train {float(result['train']):.3f} s median, "
                f"engines waited {float(result['waited']):.3f} s a rollout); "
                f"reward last 5 {float(result['reward_last5']):.3f}, last eval {float(result['eval']):.3f}; "
                f"tokens by staleness {result['staleness']}"
            )
        print(f"repeat {repeat} (run.seed {seed}): sync / async = {ratio:.2f}x")
    print(
        f"eval after {args.rollouts} rollouts, mean over seeds: sync {statistics.fmean(evals['sync']):.3f}, "
        f"async {statistics.fmean(evals['async']):.3f}"
    )
    print(
        f"RESULT async_speedup median={statistics.median(ratios):.2f}x runs={args.repeats} "
        f"rollouts={args.rollouts} staleness={args.staleness} runtime={args.runtime}"
    )


if __name__ == "__main__":
    main()
