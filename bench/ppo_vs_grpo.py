"""PPO with a critic against GRPO on the same task, interleaved: rollouts to a reward, time per rollout.

    .venv/bin/python bench/ppo_vs_grpo.py [--config examples/tiny.toml] [--seeds 1,2]
        [--rollouts 50] [--target 0.9] [--set KEY=VALUE ...] [--ppo-set KEY=VALUE ...] [--work-dir DIR]

Each round runs the config twice with the round's seed, the arms' order rotated by one each
round (the machine is shared: compare within a round): ``grpo`` as the config says, and
``ppo`` with ``trainer.use_critic = true`` plus every ``--ppo-set``. Both are
``python -m miles_events.run`` on the local runtime. Per arm, from its event log: the first
rollout whose mean reward reaches ``--target`` and the median interval between rollout
starts (the first left out, and those holding an eval). One line per round and a
``RESULT`` line: ``rollouts_to_target_grpo=a/b rollouts_to_target_ppo=c/d
ppo_vs_grpo_per_rollout=x`` (the median of the rounds' ratios).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trl_side_by_side import (
    eval_intervals,
    intervals,
    median_or_nan,
    reached,
    read_our_run,
    rollouts_to,
)

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("grpo", "ppo")


def command(
    config: str, arm: str, seed: int, rollouts: int, run_dir: Path, sets: list[str], ppo_sets: list[str]
) -> list[str]:
    overrides = [
        f'run.dir="{run_dir}"',
        'run.runtime="local"',
        f"run.seed={seed}",
        f"run.num_rollout={rollouts}",
        "metrics.port=0",
        *sets,
        *(["trainer.use_critic=true", *ppo_sets] if arm == "ppo" else []),
    ]
    return [sys.executable, "-m", "miles_events.run", config, *(a for s in overrides for a in ("--set", s))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--rollouts", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ppo-set", dest="ppo_sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ppo-vs-grpo-"))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    reached_by: dict[str, list[str]] = {arm: [] for arm in ARMS}
    ratios: list[float] = []
    for number, seed in enumerate(seeds):
        order = ARMS[number % 2 :] + ARMS[: number % 2]
        seconds: dict[str, float] = {}
        for arm in order:
            run_dir = work / f"seed{seed}-{arm}"
            cmd = command(args.config, arm, seed, args.rollouts, run_dir, args.sets, args.ppo_sets)
            print(f"  {arm}: {' '.join(cmd)}", flush=True)
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  {arm} FAILED: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                return 1
            log = read_our_run(run_dir)
            spans = intervals(log.rollouts)
            skip = eval_intervals(log) | {log.rollouts[0].rollout_id}
            seconds[arm] = median_or_nan(v for k, v in spans.items() if k not in skip)
            reached_by[arm].append(reached(rollouts_to(log.rollouts, args.target)))
        ratio = seconds["ppo"] / seconds["grpo"]
        ratios.append(ratio)
        print(
            f"round seed={seed} (order {', '.join(order)}): per rollout grpo {seconds['grpo']:.3f} s, ppo"
            f" {seconds['ppo']:.3f} s ({ratio:.2f}x); reward >= {args.target} at rollout grpo"
            f" {reached_by['grpo'][-1]}, ppo {reached_by['ppo'][-1]}",
            flush=True,
        )
    print(
        f"RESULT rollouts_to_target_grpo={'/'.join(reached_by['grpo'])}"
        f" rollouts_to_target_ppo={'/'.join(reached_by['ppo'])}"
        f" ppo_vs_grpo_per_rollout={statistics.median(ratios):.3f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
