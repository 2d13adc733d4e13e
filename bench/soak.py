"""A soak of a run that heals: many rollouts of the embedded default with random faults,
then what the event log and the process say about them.

    .venv/bin/python bench/soak.py [--rollouts 300] [--every 4] [--runtime local] [--seed 1]
        [--cells rollout,train] [--faults N] [--set KEY=VALUE ...] [--work-dir DIR]

The run (``examples/tiny.toml``, 2 engines and, with ``train`` in ``--cells``, a trainer of
2 ranks; ``run.ft_components`` as ``--cells``; a save every 5 rollouts keeping 3) gets a
fault every ``--every`` seconds through the control server: a random cell (an engine,
``rollout-{i}``, or a trainer rank, ``actor-{i}``) and a random mode of ``sigkill``,
``segfault``, ``exit``, ``deadlock``, or a suspension resumed a few seconds later. Faults
stop before the last 10% of the rollouts, or once ``--faults`` were delivered. Printed: the
faults delivered, the steps lost and doubled (every rollout id must be kept once, a
trainer's restore dropping the steps after its checkpoint: goal 0 and 0), the rollouts
done again, the recovery time per cell type and fault kind (from the fault to the cell's
weights verified again, an engine's, or restored, the trainer's, and to the next verified
publication), the driver's and its processes' RSS at 25% and 3 rollouts before the end,
and the run directory's size then. The last line is ``RESULT ...``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.server_process import free_port
from miles_events.bus.event_log import read_events
from schemas.events import (
    CellFailed,
    CellRestarted,
    CellResumed,
    FaultInjected,
    PublicationVerified,
    RestoreVerified,
    RunFinished,
    TrainerRestored,
    TrainerRestoreRequested,
    kept_steps,
)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sigkill", "segfault", "exit", "deadlock", "suspend")
TOKEN = "soak-token"


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants."""
    total = 0
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        pids.extend(int(c) for c in children)
    return total


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--every", type=float, default=4.0)
    parser.add_argument("--runtime", default="local", choices=("local", "ray"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=None, help="stop faulting after this many")
    parser.add_argument("--cells", default="rollout,train", help="what heals and gets faults: rollout, train")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    port = free_port()
    components = [c for c in args.cells.split(",") if c]
    cells = [f"rollout-{i}" for i in range(2) if "rollout" in components]
    cells += [f"actor-{i}" for i in range(2) if "train" in components]
    components_toml = ", ".join(f'"{c}"' for c in components)
    overrides = [
        f'run.dir="{run_dir}"',
        f'run.runtime="{args.runtime}"',
        f"run.num_rollout={args.rollouts}",
        "run.eval_interval=1000",
        "run.save_interval=5",
        "generator.num_engines=2",
        f"trainer.num_ranks={2 if 'train' in components else 1}",
        f"run.ft_components=[{components_toml}]",
        f"run.control_server_port={port}",
        "control.max_restarts=1000",
        "control.restart_backoff_seconds=0",
        "control.heartbeat_interval_seconds=1",
        "control.heartbeat_timeout_seconds=2",
        "control.heartbeat_max_failures=2",
        'console.mode="plain"',
        "metrics.enabled=false",
        *args.set,
    ]
    command = [sys.executable, "-m", "miles_events.run", str(ROOT / "examples" / "tiny.toml")]
    for item in overrides:
        command += ["--set", item]
    out = work / "run.out"
    env = dict(os.environ, MILES_CONTROL_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    chooser = random.Random(args.seed)
    delivered: Counter[str] = Counter()
    samples: dict[str, tuple[int, int]] = {}
    with out.open("w") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}/api/v1",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )

        def trained() -> int:
            """Rollouts trained, as far as the run has got (the last rollout line's count: a
            trainer's restore goes back)."""
            done = re.findall(rf"\[(\d+)/{args.rollouts}\]: ", out.read_text())
            return int(done[-1]) if done else 0

        try:
            while process.poll() is None and trained() < 3:
                time.sleep(0.5)
            while (
                process.poll() is None
                and trained() < 0.9 * args.rollouts
                and (args.faults is None or sum(delivered.values()) < args.faults)
            ):
                if "quarter" not in samples and trained() >= args.rollouts // 4:
                    samples["quarter"] = (rss_bytes(process.pid), dir_bytes(run_dir))
                time.sleep(args.every)
                cell = chooser.choice(cells)
                mode = chooser.choice(MODES)
                try:
                    if mode == "suspend":
                        if (
                            client.patch(f"/cells/{cell}", json={"spec": {"suspend": True}}).status_code
                            == 200
                        ):
                            time.sleep(2)
                            client.patch(f"/cells/{cell}", json={"spec": {"suspend": False}})
                            delivered[mode] += 1
                    elif client.post(f"/cells/{cell}/inject-fault", json={"mode": mode}).status_code == 200:
                        delivered[mode] += 1
                except httpx.HTTPError:
                    pass  # the run is ending
            while process.poll() is None and trained() < args.rollouts - 3:
                time.sleep(0.2)
            samples["end"] = (rss_bytes(process.pid), dir_bytes(run_dir))  # the last rollouts
            code = process.wait(timeout=600)
        finally:
            if process.poll() is None:
                process.kill()
            client.close()
    log = list(read_events(run_dir / "events.log"))
    steps = Counter(e.rollout_id for e in kept_steps(log))
    lost = sum(1 for r in range(args.rollouts) if steps[r] == 0)
    doubled = sum(count - 1 for count in steps.values() if count > 1)
    redone = sum(len(e.redo) for e in log if isinstance(e, TrainerRestoreRequested))
    finished = next((e for e in reversed(log) if isinstance(e, RunFinished)), None)
    recovery: dict[str, list[float]] = defaultdict(list)
    to_publication: dict[str, list[float]] = defaultdict(list)
    for at, fault in enumerate(log):
        if not isinstance(fault, FaultInjected) or fault.error:
            continue
        kind, index = fault.cell.split("-")
        later = log[at + 1 :]
        back = next(
            (e for e in later if isinstance(e, CellRestarted | CellResumed) and e.cell == fault.cell), None
        )
        if back is None:
            continue
        restored = next(
            (
                e
                for e in later
                if (
                    (isinstance(e, RestoreVerified) and e.engine == f"engine-{index}")
                    or isinstance(e, TrainerRestored)
                )
                and e.time >= back.time - 1
            ),
            None,
        )
        key = f"{kind} {fault.mode}"
        if restored is not None:
            recovery[key].append(restored.time - fault.time)
        published = next(
            (e for e in later if isinstance(e, PublicationVerified) and e.time > (restored or back).time),
            None,
        )
        if published is not None:
            to_publication[key].append(published.time - fault.time)
    failures = Counter(
        f"{e.cell.split('-')[0]} {'hung' if e.hung else 'died'}" for e in log if isinstance(e, CellFailed)
    )
    print(f"run {run_dir}: exit {code}, {finished.status if finished else 'no RunFinished'}")
    print(f"faults delivered: {dict(delivered)}; cells failed: {dict(failures)}")
    print(
        f"steps kept {sum(steps.values())} of {args.rollouts}: lost {lost}, doubled {doubled}; "
        f"rollouts done again after a trainer restore: {redone}"
    )
    for mode in sorted(recovery):
        weights = statistics.median(recovery[mode])
        publication = statistics.median(to_publication[mode]) if to_publication[mode] else float("nan")
        print(
            f"recovery {mode}: median {weights:.2f} s to the weights verified (engine) or restored (trainer), "
            f"{publication:.2f} s to the next verified publication ({len(recovery[mode])} faults)"
        )
    (rss_q, dir_q), (rss_e, dir_e) = samples.get("quarter", (0, 0)), samples.get("end", (0, 0))
    print(
        f"RSS (driver and its processes): {rss_q / 2**20:.0f} MiB at 25%, {rss_e / 2**20:.0f} MiB at the end"
    )
    print(f"run directory: {dir_q / 2**20:.1f} MiB at 25%, {dir_e / 2**20:.1f} MiB at the end")
    print(
        f"RESULT faults={sum(delivered.values())} lost={lost} doubled={doubled} redone={redone} "
        f"rss_growth={rss_e / rss_q if rss_q else float('nan'):.2f} "
        f"run_dir_growth={dir_e / dir_q if dir_q else float('nan'):.2f} status={finished.status if finished else '-'}"
    )
    return 0 if code == 0 and lost == 0 and doubled == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
