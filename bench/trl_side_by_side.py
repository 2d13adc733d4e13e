"""The embedded default side by side with TRL's ``GRPOTrainer``: same model, task and GRPO settings.

    .venv/bin/python bench/trl_side_by_side.py [--seeds 1,2,3] [--rollouts 50] [--arms ray,local,trl]
        [--config examples/tiny.toml] [--set KEY=VALUE ...] [--json PATH] [--work-dir DIR] [--trl-threads N]

Three arms learn the same task (``examples/tiny.toml``: a 1-layer Qwen2 built in code with a
character tokenizer learns single-digit addition with GRPO on the CPU):

- ``ray`` and ``local``: ``python -m miles_events.run CONFIG --set run.runtime=... --set
  run.seed=S --set run.num_rollout=N`` (plus ``metrics.port=0``, a free port, and every
  ``--set`` given here), with the config's own thread settings;
- ``trl``: ``bench/trl_grpo.py`` under ``.venv-trl`` (TRL 1.13 layered over the project's
  ``.venv`` by ``bash .ci/setup-trl``, which this script runs when ``.venv-trl`` is
  missing), with torch's default thread count (``--trl-threads`` sets one). It reads the
  same config and ``--set`` options and builds the same model (same init), the same
  prompts in the same order and the same reward; its module docstring lists the TRL
  settings that make it the same GRPO.

Round ``r`` runs every arm for the ``r``-th seed, the arms' order rotated by one each round
(the machine is shared and noisy: compare within a round). Measured per arm:

- per rollout: the median interval between the starts of consecutive rollouts (ours:
  ``RolloutRequested`` times in the event log; TRL: entering
  ``_generate_and_score_completions``), leaving out the first interval (warm-up) and every
  interval in which an arm evaluated (after every ``run.eval_interval``-th rollout: ours
  ``EvalFinished``, TRL's arm the same eval in a callback), from every arm;
- the held-out accuracy (``eval/accuracy``) of every eval, and the loop seconds (from the
  first rollout's start, evals left out) to the first eval reaching ``--target-accuracy``
  (default: the lowest of the arms' best accuracies in the round, one every arm reached);
- the generation + training split, medians over the same rollouts: ours
  ``RolloutGenerated.generate_seconds`` and ``TrainStepFinished.train_seconds``; TRL its
  generate-and-score call and the time to the end of the rollout's last optimizer step,
  with TRL's old-log-probability pass counted as training, where our trainer does it;
- fixed cost: the process's wall time (spawn to exit) minus its loop time (ours: first
  to last event of the log; TRL: ``on_train_begin`` to ``on_train_end``);
- peak memory: the largest sum of ``Pss`` (``/proc/PID/smaps_rollup``) over the whole
  process tree, sampled every ``--sample-interval`` seconds, or less often where a sample
  takes longer, so that sampling takes at most 10% of one core (the tree from the child's
  ``/proc/PID/task/*/children``, plus every process of its session, so a process that
  Ray reparents is still counted), and the largest number of processes summed; each
  round line says how much CPU the sampling took;
- rollouts to reward ``--target``: the id of the first rollout whose mean reward reaches
  it (``none``: never).

Printed: the exact command of every arm, each round's ratios (ours/TRL per rollout, ray/local
per rollout, ray's fixed cost over local's, ray's PSS over local's), a table over the seeds,
and one line ``RESULT ray_vs_trl=... local_vs_trl=... ray_vs_local=... ray_fixed_extra_s=...
ray_pss_vs_local=... rollouts_to_0.9_ours=... rollouts_to_0.9_trl=... eval_accuracy_ours=...
eval_accuracy_trl=... seconds_to_accuracy_ours=... seconds_to_accuracy_trl=...`` (ratios:
medians of the per-round ratios; rollouts, last eval's accuracy and seconds to accuracy: one
per seed, ``/``-separated). ``--json PATH`` writes all of it. Another model and task:
``--config`` a TOML with ``model.path`` or ``model.gguf`` (the TRL arm loads the same
converted checkpoint with transformers, as the run's actors do), e.g.
``--config examples/smollm2_math.toml --arms local,trl --seeds 1 --rollouts 20``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_events.app.config import load_config
from miles_events.bus.event_log import read_events
from schemas.config import Config
from schemas.events import EvalFinished, EvalRequested, RolloutGenerated, RolloutRequested, TrainStepFinished

ROOT = Path(__file__).resolve().parents[1]

ARMS = ("ray", "local", "trl")
OURS = ("ray", "local")
TRL_VENV = ROOT / ".venv-trl"
SETUP_TRL = ROOT / ".ci" / "setup-trl"
RESULT_KEYS = (
    "ray_vs_trl",
    "local_vs_trl",
    "ray_vs_local",
    "ray_fixed_extra_s",
    "ray_pss_vs_local",
    "rollouts_to_0.9_ours",
    "rollouts_to_0.9_trl",
    "eval_accuracy_ours",
    "eval_accuracy_trl",
    "seconds_to_accuracy_ours",
    "seconds_to_accuracy_trl",
)


# --- the process tree's memory ---------------------------------------------------------


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (of every one of its threads)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            found.extend(int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    return found


def process_tree(root: int) -> set[int]:
    """``root`` and all its descendants that are alive now."""
    tree: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in tree or not os.path.exists(f"/proc/{pid}"):
            continue
        tree.add(pid)
        todo.extend(children(pid))
    return tree


def session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[3])


def session_members(session: int) -> set[int]:
    members: set[int] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and session_of(int(entry.name)) == session:
            members.add(int(entry.name))
    return members


def pss_bytes(pid: int) -> int | None:
    """The proportional set size of ``pid`` (None: gone, or not readable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def summed_pss(pids: Iterable[int]) -> tuple[int, list[int]]:
    """The summed PSS of ``pids`` and those of them counted (alive and readable)."""
    counted = []
    total = 0
    for pid in sorted(pids):
        pss = pss_bytes(pid)
        if pss is not None:
            total += pss
            counted.append(pid)
    return total, counted


def tree_pss(root: int, session: int | None = None) -> tuple[int, list[int]]:
    """The summed PSS of ``root``'s process tree (and of the members of ``session``), and
    the processes counted."""
    return summed_pss(process_tree(root) | (session_members(session) if session is not None else set()))


class PeakSampler(threading.Thread):
    """Samples a process tree's summed PSS until ``stop``; keeps the peak and the most
    processes counted in one sample.

    Reading ``smaps_rollup`` costs milliseconds for a process that imported torch (the
    kernel walks its mappings), and this machine has 2 cores: a sample starts every
    ``interval`` seconds, or later, so that sampling takes at most ``duty`` of one core.
    Every ``session_every``-th sample scans ``/proc`` for the members of ``session``
    (processes that left the tree); between scans the ones found are followed.
    """

    def __init__(
        self,
        root: int,
        interval: float = 0.2,
        session: int | None = None,
        duty: float = 0.1,
        session_every: int = 10,
    ) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.session = root, interval, session
        self.duty, self.session_every = duty, session_every
        self.peak_pss = 0
        self.peak_processes = 0
        self.samples = 0
        self.names: set[str] = set()
        self.cpu_seconds = 0.0
        """CPU time the sampling took (set by ``run_measured``)."""
        self._members: set[int] = set()
        self._stop_event = threading.Event()

    def sample(self) -> None:
        if self.session is not None and self.samples % self.session_every == 0:
            self._members = session_members(self.session)
        total, counted = summed_pss(process_tree(self.root) | self._members)
        self._members &= set(counted)
        self.samples += 1
        if total > self.peak_pss:
            self.peak_pss = total
        if len(counted) > self.peak_processes:
            self.peak_processes = len(counted)
            self.names.update(command_name(pid) for pid in counted)

    def run(self) -> None:
        while not self._stop_event.is_set():
            started = time.perf_counter()
            self.sample()
            took = time.perf_counter() - started
            self._stop_event.wait(max(self.interval - took, took * (1 / self.duty - 1)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# --- what each arm recorded ------------------------------------------------------------


@dataclass
class Rollout:
    rollout_id: int
    start: float
    """Wall-clock time the rollout was asked for (ours) or its generation began (TRL)."""
    generate_seconds: float
    train_seconds: float
    reward_mean: float
    num_completions: int


@dataclass
class Eval:
    rollout_id: int
    """The rollout after which it ran (0 also for the one before training)."""
    start: float
    seconds: float
    accuracy: float


@dataclass
class RunLog:
    """One arm's record of its loop: rollouts, the loop's span, evals."""

    rollouts: list[Rollout]
    loop_seconds: float
    evals: list[Eval] = field(default_factory=list)

    @property
    def eval_times(self) -> list[float]:
        return [e.start for e in self.evals]


def read_our_run(run_dir: Path) -> RunLog:
    """The rollouts of one of our runs, from its event log."""
    log = list(read_events(run_dir / "events.log"))
    if not log:
        raise ValueError(f"{run_dir / 'events.log'}: no events")
    starts = {e.rollout_id: e.time for e in log if isinstance(e, RolloutRequested)}
    generated = {e.rollout_id: e for e in log if isinstance(e, RolloutGenerated)}
    trained = {e.rollout_id: e for e in log if isinstance(e, TrainStepFinished)}
    rollouts = [
        Rollout(
            rollout_id=k,
            start=starts[k],
            generate_seconds=generated[k].generate_seconds,
            train_seconds=trained[k].train_seconds,
            reward_mean=generated[k].reward_mean,
            num_completions=generated[k].num_samples,
        )
        for k in sorted(starts)
        if k in generated and k in trained
    ]
    finished = [e for e in log if isinstance(e, EvalFinished)]
    evals = [
        Eval(
            rollout_id=e.rollout_id,
            start=e.time - e.eval_seconds,
            seconds=e.eval_seconds,
            accuracy=e.metrics.get("eval/accuracy", math.nan),
        )
        for e in finished
    ]
    # An eval asked for but not finished (the run stopped) still took part of its interval.
    asked = [e.time for e in log if isinstance(e, EvalRequested)][len(finished) :]
    evals += [Eval(rollout_id=-1, start=t, seconds=0.0, accuracy=math.nan) for t in asked]
    return RunLog(rollouts=rollouts, loop_seconds=log[-1].time - log[0].time, evals=evals)


def read_trl_run(result: dict[str, Any]) -> RunLog:
    """The rollouts of the TRL arm, from the JSON ``bench/trl_grpo.py`` writes."""
    rollouts = [
        Rollout(
            rollout_id=r["rollout_id"],
            start=r["start"],
            generate_seconds=r["generate_seconds"],
            train_seconds=r["train_seconds"],
            reward_mean=r["reward_mean"],
            num_completions=r["num_completions"],
        )
        for r in result["rollouts"]
    ]
    evals = [
        Eval(rollout_id=e["rollout_id"], start=e["start"], seconds=e["seconds"], accuracy=e["accuracy"])
        for e in result.get("evals", [])
    ]
    return RunLog(rollouts=rollouts, loop_seconds=result["train_end"] - result["train_begin"], evals=evals)


def seconds_to_accuracy(log: RunLog, target: float) -> float | None:
    """Loop seconds, evals not counted, from the first rollout's start to the first eval
    whose accuracy reaches ``target`` (0 for the eval before training); None: none does."""
    if not log.rollouts:
        return None
    begin = log.rollouts[0].start
    for e in sorted(log.evals, key=lambda e: e.start):
        if e.accuracy >= target:
            earlier = sum(x.seconds for x in log.evals if begin <= x.start < e.start)
            return max(e.start - begin - earlier, 0.0)
    return None


def intervals(rollouts: Sequence[Rollout]) -> dict[int, float]:
    """Rollout id -> seconds from its start to the next rollout's start."""
    return {a.rollout_id: b.start - a.start for a, b in itertools.pairwise(rollouts)}


def eval_intervals(log: RunLog) -> set[int]:
    """The rollouts whose interval (to the next rollout's start) holds an eval."""
    return {
        a.rollout_id
        for a, b in itertools.pairwise(log.rollouts)
        if any(a.start <= t < b.start for t in log.eval_times)
    }


def rollouts_to(rollouts: Iterable[Rollout], target: float) -> int | None:
    """The id of the first rollout whose mean reward reaches ``target``."""
    return next((r.rollout_id for r in rollouts if r.reward_mean >= target), None)


def median_or_nan(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else math.nan


@dataclass
class ArmResult:
    arm: str
    seed: int
    command: list[str]
    returncode: int
    process_seconds: float
    peak_pss_bytes: int
    peak_processes: int
    process_names: list[str]
    pss_samples: int
    sampler_cpu_seconds: float = 0.0
    loop_seconds: float = math.nan
    rollouts: list[Rollout] = field(default_factory=list)
    eval_intervals: list[int] = field(default_factory=list)
    counted_intervals: list[int] = field(default_factory=list)
    per_rollout_seconds: float = math.nan
    generate_seconds: float = math.nan
    train_seconds: float = math.nan
    rollouts_to_target: int | None = None
    evals: list[Eval] = field(default_factory=list)
    target_accuracy: float = math.nan
    """The held-out accuracy ``seconds_to_accuracy`` counts up to (``--target-accuracy``, or
    the lowest of the arms' best in the round: one every arm reached)."""
    seconds_to_accuracy: float | None = None
    torch_threads: int | None = None
    log_dir: str = ""
    error: str = ""

    @property
    def fixed_seconds(self) -> float:
        return self.process_seconds - self.loop_seconds

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.error


def summarize(result: ArmResult, log: RunLog, excluded: set[int], target: float) -> None:
    """Fill in ``result``'s loop figures from ``log``, leaving out the rollouts ``excluded``
    (and the first: warm-up)."""
    result.rollouts = log.rollouts
    result.loop_seconds = log.loop_seconds
    spans = intervals(log.rollouts)
    first = log.rollouts[0].rollout_id if log.rollouts else 0
    counted = sorted(k for k in spans if k != first and k not in excluded)
    if not counted:  # too few rollouts to leave the warm-up out too: keep it
        counted = sorted(k for k in spans if k not in excluded) or sorted(spans)
    by_id = {r.rollout_id: r for r in log.rollouts}
    result.counted_intervals = counted
    result.per_rollout_seconds = median_or_nan(spans[k] for k in counted)
    result.generate_seconds = median_or_nan(by_id[k].generate_seconds for k in counted)
    result.train_seconds = median_or_nan(by_id[k].train_seconds for k in counted)
    result.rollouts_to_target = rollouts_to(log.rollouts, target)
    result.evals = sorted(log.evals, key=lambda e: e.start)


def set_accuracy_target(arms: dict[str, ArmResult], logs: dict[str, RunLog], target: float | None) -> None:
    """Each arm's loop seconds to ``target`` held-out accuracy; unset, to the lowest of the
    arms' best accuracies (the one every arm reached)."""
    bests = [max((e.accuracy for e in log.evals if not math.isnan(e.accuracy)), default=math.nan)
             for log in logs.values()]  # fmt: skip
    if target is None:
        target = min(bests) if bests and not any(math.isnan(b) for b in bests) else math.nan
    for arm, log in logs.items():
        arms[arm].target_accuracy = target
        arms[arm].seconds_to_accuracy = None if math.isnan(target) else seconds_to_accuracy(log, target)


def accuracy_curve(evals: Sequence[Eval]) -> str:
    """``0.140@0 0.230@9 ...``: accuracy at the rollout after which each eval ran."""
    return " ".join(f"{e.accuracy:.3f}@{e.rollout_id}" for e in evals if not math.isnan(e.accuracy)) or "n/a"


# --- running the arms ------------------------------------------------------------------


def our_command(
    python: str, config: str, arm: str, seed: int, rollouts: int, run_dir: Path, overrides: Sequence[str]
) -> list[str]:
    sets = [
        f'run.dir="{run_dir}"',
        f'run.runtime="{arm}"',
        f"run.seed={seed}",
        f"run.num_rollout={rollouts}",
        "metrics.port=0",
        *overrides,
    ]
    return [python, "-m", "miles_events.run", config, *(arg for s in sets for arg in ("--set", s))]


def trl_command(
    python: str, config: str, seed: int, rollouts: int, out: Path, work: Path, overrides: Sequence[str],
    threads: int | None = None,
) -> list[str]:  # fmt: skip
    sets = [f"run.seed={seed}", f"run.num_rollout={rollouts}", *overrides]
    return [
        python, str(ROOT / "bench" / "trl_grpo.py"), "--config", config, "--out", str(out), "--work-dir", str(work),
        *(["--threads", str(threads)] if threads else []), *(arg for s in sets for arg in ("--set", s)),
    ]  # fmt: skip


def run_measured(
    command: list[str], log_dir: Path, interval: float, timeout: float | None
) -> tuple[int, float, PeakSampler]:
    """Run ``command`` in a session of its own, output to ``log_dir``; its wall time and
    its tree's peak PSS."""
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(log_dir / "stdout.log", "wb") as out, open(log_dir / "stderr.log", "wb") as err:
        started = time.perf_counter()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        child = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        sampler = PeakSampler(child.pid, interval, session=child.pid)
        sampler.start()
        try:
            returncode = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.terminate()  # ours: the step in progress finishes, then the run stops
            returncode = child.wait()
        except BaseException:  # interrupted: the arm does not outlive this script
            stop_session(child)
            raise
        finally:
            seconds = time.perf_counter() - started
            sampler.stop()
            cpu_after = resource.getrusage(resource.RUSAGE_SELF)
            # This script only waits meanwhile: its CPU time is the sampler's.
            sampler.cpu_seconds = (cpu_after.ru_utime - cpu_before.ru_utime) + (
                cpu_after.ru_stime - cpu_before.ru_stime
            )
    return returncode, seconds, sampler


def stop_session(child: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the arm's driver, then, after ``grace`` seconds, SIGKILL to its session."""
    child.terminate()
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def run_arm(arm: str, seed: int, args: argparse.Namespace, work: Path) -> tuple[ArmResult, RunLog | None]:
    arm_dir = work / f"seed{seed}-{arm}"
    arm_dir.mkdir(parents=True, exist_ok=True)
    if arm == "trl":
        out = arm_dir / "trl.json"
        command = trl_command(
            str(args.trl_python),
            args.config,
            seed,
            args.rollouts,
            out,
            arm_dir,
            args.overrides,
            args.trl_threads,
        )
    else:
        command = our_command(
            sys.executable, args.config, arm, seed, args.rollouts, arm_dir / "run", args.overrides
        )
    print(f"  {arm}: {' '.join(command)}", flush=True)
    returncode, seconds, sampler = run_measured(command, arm_dir, args.sample_interval, args.timeout)
    result = ArmResult(
        arm=arm,
        seed=seed,
        command=command,
        returncode=returncode,
        process_seconds=seconds,
        peak_pss_bytes=sampler.peak_pss,
        peak_processes=sampler.peak_processes,
        process_names=sorted(sampler.names),
        pss_samples=sampler.samples,
        sampler_cpu_seconds=sampler.cpu_seconds,
        log_dir=str(arm_dir),
    )
    log = None
    try:
        if arm == "trl":
            trl = json.loads(out.read_text())
            result.torch_threads = trl.get("torch_threads")
            log = read_trl_run(trl)
        else:
            log = read_our_run(arm_dir / "run")
    except (OSError, ValueError, KeyError) as error:
        result.error = f"no results ({error}); stderr: {tail(arm_dir / 'stderr.log')}"
    if returncode != 0:
        result.error = f"exit code {returncode}; stderr: {tail(arm_dir / 'stderr.log')}"
    if log is not None and len(log.rollouts) < args.rollouts:
        result.error = result.error or f"{len(log.rollouts)} of {args.rollouts} rollouts completed"
    return result, log


# --- ratios and the report -------------------------------------------------------------


def ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def round_ratios(arms: dict[str, ArmResult]) -> dict[str, float]:
    """The comparisons within one round (nan where an arm is missing)."""
    nan = ArmResult("-", 0, [], 0, math.nan, 0, 0, [], 0)
    ray, local, trl = (arms.get(a, nan) for a in ARMS)
    return {
        "ray_vs_trl": ratio(ray.per_rollout_seconds, trl.per_rollout_seconds),
        "local_vs_trl": ratio(local.per_rollout_seconds, trl.per_rollout_seconds),
        "ray_vs_local": ratio(ray.per_rollout_seconds, local.per_rollout_seconds),
        "ray_fixed_extra_s": ray.fixed_seconds - local.fixed_seconds,
        "ray_pss_vs_local": ratio(ray.peak_pss_bytes or math.nan, local.peak_pss_bytes or math.nan),
    }


def fmt(value: float, digits: int = 2, unit: str = "") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}{unit}"


def times(value: float) -> str:
    return fmt(value, 2, "x")


def spread(values: Sequence[float], digits: int = 2, unit: str = "") -> str:
    """One value, or the range ``low-high`` of several."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    low, high = min(values), max(values)
    if f"{low:.{digits}f}" == f"{high:.{digits}f}":
        return f"{low:.{digits}f}{unit}"
    return f"{low:.{digits}f}-{high:.{digits}f}{unit}"


def processes(count: int) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def reached(value: int | None) -> str:
    return "none" if value is None else str(value)


def format_round(seed: int, order: Sequence[str], arms: dict[str, ArmResult], target: float) -> list[str]:
    lines = [f"round seed={seed} (order: {', '.join(order)})"]
    for arm in ARMS:
        if arm not in arms:
            continue
        r = arms[arm]
        lines.append(
            f"  {arm:5} per rollout {fmt(r.per_rollout_seconds, 3)} s (generate {fmt(r.generate_seconds, 3)}"
            f" + train {fmt(r.train_seconds, 3)}), process {fmt(r.process_seconds, 1)} s, loop"
            f" {fmt(r.loop_seconds, 1)} s, fixed {fmt(r.fixed_seconds, 1)} s, peak PSS"
            f" {fmt(r.peak_pss_bytes / 1e9, 2)} GB over {processes(r.peak_processes)}, reward >= {target}"
            f" at rollout {reached(r.rollouts_to_target)}; the PSS sampler took {fmt(r.sampler_cpu_seconds, 1)} s"
            f" of CPU for {r.pss_samples} samples" + (f"  ERROR: {r.error}" if r.error else "")
        )
        if r.evals:
            lines.append(
                f"        held-out accuracy {accuracy_curve(r.evals)} (accuracy@rollout); loop seconds to"
                f" accuracy {fmt(r.target_accuracy, 3)}: "
                + (f"{r.seconds_to_accuracy:.1f}" if r.seconds_to_accuracy is not None else "not reached")
            )
    ratios = round_ratios(arms)
    lines.append(
        f"  ratios: ray/trl {times(ratios['ray_vs_trl'])}, local/trl {times(ratios['local_vs_trl'])} per rollout;"
        f" ray/local {times(ratios['ray_vs_local'])} per rollout; fixed cost ray-local"
        f" {fmt(ratios['ray_fixed_extra_s'], 1, ' s')}; PSS ray/local {times(ratios['ray_pss_vs_local'])}"
    )
    return lines


def format_table(rounds: Sequence[dict[str, ArmResult]], target: float) -> list[str]:
    """The table over the seeds, one column per arm (markdown)."""
    columns = [("ours, ray", "ray"), ("ours, local", "local"), ("TRL GRPOTrainer", "trl")]
    present = [(title, arm) for title, arm in columns if any(arm in r for r in rounds)]
    seeds = "/".join(str(next(iter(r.values())).seed) for r in rounds if r)
    threads = sorted({r["trl"].torch_threads for r in rounds if "trl" in r and r["trl"].torch_threads})
    per_arm = {arm: [r[arm] for r in rounds if arm in r] for _, arm in present}

    def cell_per_rollout(arm: str) -> str:
        seconds = spread([a.per_rollout_seconds for a in per_arm[arm]], 2, " s")
        if arm == "trl":
            return f"1 ({seconds})"
        ratios = [round_ratios(r)[f"{arm}_vs_trl"] for r in rounds if arm in r]
        median = median_or_nan(v for v in ratios if not math.isnan(v))
        return f"{fmt(median)}x ({seconds})" if not math.isnan(median) else seconds

    def cell_split(arm: str) -> str:
        results = per_arm[arm]
        return (
            f"{spread([a.generate_seconds for a in results])} + {spread([a.train_seconds for a in results])}"
        )

    def cell_pss(arm: str) -> str:
        results = per_arm[arm]
        counts = sorted({a.peak_processes for a in results})
        count = processes(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]} processes"
        return f"{spread([a.peak_pss_bytes / 1e9 for a in results], 2, ' GB')} over {count}"

    thread_note = f"TRL on {'/'.join(map(str, threads))} threads" if threads else "TRL's threads"
    rows = [
        (f"median s per rollout (ratio to TRL, {thread_note})", cell_per_rollout),
        ("generation + training split (s)", cell_split),
        (
            "fixed cost: process time minus loop time",
            lambda arm: spread([a.fixed_seconds for a in per_arm[arm]], 1, " s"),
        ),
        ("peak memory, process tree (PSS)", cell_pss),
        (
            f"rollouts to reward {target} (seeds {seeds})",
            lambda arm: " / ".join(reached(a.rollouts_to_target) for a in per_arm[arm]),
        ),
    ]
    if any(a.evals for results in per_arm.values() for a in results):
        rows += [
            (
                "held-out accuracy (accuracy@rollout, per seed)",
                lambda arm: " / ".join(accuracy_curve(a.evals) for a in per_arm[arm]),
            ),
            (
                "loop seconds, evals left out, to held-out accuracy (per seed)",
                lambda arm: " / ".join(
                    (f"{a.seconds_to_accuracy:.0f} s" if a.seconds_to_accuracy is not None else "not reached")
                    + f" to {fmt(a.target_accuracy, 3)}"
                    for a in per_arm[arm]
                ),
            ),
        ]
    lines = ["| | " + " | ".join(title for title, _ in present) + " |", "|---|" + "---|" * len(present)]
    lines += [
        "| " + label + " | " + " | ".join(cell(arm) for _, arm in present) + " |" for label, cell in rows
    ]
    return lines


def result_values(rounds: Sequence[dict[str, ArmResult]]) -> dict[str, str]:
    """The RESULT line's values: medians of the per-round comparisons; rollouts per seed."""
    values: dict[str, str] = {}
    ratios = [round_ratios(r) for r in rounds]
    for key in RESULT_KEYS[:5]:
        median = median_or_nan(v for v in (r[key] for r in ratios) if not math.isnan(v))
        values[key] = fmt(median, 1 if key.endswith("_s") else 3)

    def per_seed(arm: str) -> str:
        found = [r[arm] for r in rounds if arm in r]
        return "/".join(reached(a.rollouts_to_target) for a in found) if found else "n/a"

    ours = "ray" if any("ray" in r for r in rounds) else "local"
    values["rollouts_to_0.9_ours"] = per_seed(ours)
    values["rollouts_to_0.9_trl"] = per_seed("trl")
    for key, arm in (("ours", ours), ("trl", "trl")):
        found = [r[arm] for r in rounds if arm in r]
        finals = [
            next((e.accuracy for e in reversed(a.evals) if not math.isnan(e.accuracy)), math.nan)
            for a in found
        ]
        values[f"eval_accuracy_{key}"] = "/".join(fmt(v, 3) for v in finals) or "n/a"
        values[f"seconds_to_accuracy_{key}"] = (
            "/".join(
                fmt(a.seconds_to_accuracy if a.seconds_to_accuracy is not None else math.nan, 0)
                for a in found
            )
            or "n/a"
        )
    return values


def result_line(values: dict[str, str]) -> str:
    return "RESULT " + " ".join(f"{key}={values[key]}" for key in RESULT_KEYS)


def parse_result_line(line: str) -> dict[str, str]:
    """``RESULT k=v k=v ...`` -> ``{k: v}``."""
    head, *items = line.split()
    if head != "RESULT":
        raise ValueError(f"not a RESULT line: {line!r}")
    return dict(item.split("=", 1) for item in items)


# --- main -------------------------------------------------------------------------------


def ensure_trl_venv(python: Path, setup: bool) -> None:
    if python.exists():
        return
    if not setup:
        raise SystemExit(
            f"{python} is missing: create TRL's environment with `bash {SETUP_TRL.relative_to(ROOT)}`"
        )
    print(
        f"{python} is missing: running bash {SETUP_TRL.relative_to(ROOT)} (TRL over .venv, ~30 s)", flush=True
    )
    subprocess.run(["bash", str(SETUP_TRL)], check=True, cwd=ROOT)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated run.seed values, one round each")
    parser.add_argument("--rollouts", type=int, default=50, help="run.num_rollout of every arm")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: ray, local, trl")
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="passed to every arm (ours: miles_events.run --set; TRL: read from the same config)",
    )  # fmt: skip
    parser.add_argument(
        "--target", type=float, default=0.9, help="the mean reward 'rollouts to' counts up to"
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        help="the held-out accuracy (eval/accuracy) whose loop seconds are reported"
        " (default: the lowest of the arms' best in each round)",
    )
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument("--work-dir", type=Path, help="run directories and logs (default: a temporary one)")
    parser.add_argument("--sample-interval", type=float, default=0.2, help="seconds between PSS samples")
    parser.add_argument("--timeout", type=float, help="seconds an arm may run before it is stopped")
    parser.add_argument("--trl-python", type=Path, default=TRL_VENV / "bin" / "python")
    parser.add_argument(
        "--trl-threads", type=int, help="torch threads of the TRL arm (default: torch's default)"
    )
    parser.add_argument(
        "--no-setup",
        action="store_true",
        help="do not run .ci/setup-trl when .venv-trl is missing: exit instead",
    )
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown or not args.arms:
        parser.error(f"--arms: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ARMS)}")
    if args.rollouts < 2:
        parser.error("--rollouts: at least 2 (a rollout's time is the interval to the next one)")
    args.config = str(Path(args.config).resolve())
    return args


def write_json(
    args: argparse.Namespace,
    work: Path,
    config: Config,
    rounds: Sequence[dict[str, ArmResult]],
    table: Sequence[str] = (),
    values: dict[str, str] | None = None,
) -> None:
    if not args.json:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "work_dir": str(work),
        "our_threads": {
            "rollout.num_threads": config.rollout.num_threads,
            "trainer.num_threads": config.trainer.num_threads,
        },
        "rounds": [
            {
                arm: {**asdict(r), "fixed_seconds": r.fixed_seconds, "ratios": round_ratios(rs)}
                for arm, r in rs.items()
            }
            for rs in rounds
        ],
        "table": list(table),
        "result": values,
    }
    args.json.write_text(json.dumps(report, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: the running arm is stopped too
    if "trl" in args.arms:
        ensure_trl_venv(args.trl_python, setup=not args.no_setup)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="trl-side-by-side-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(args.seeds)} round(s), seeds {','.join(map(str, args.seeds))}, {args.rollouts} rollouts, arms"
        f" {','.join(args.arms)}; config {args.config}; runs under {work}",
        flush=True,
    )
    config = load_config(args.config, args.overrides)
    trl_threads = str(args.trl_threads) if args.trl_threads else "torch's default"
    print(
        f"threads: ours as the config says (rollout.num_threads={config.rollout.num_threads},"
        f" trainer.num_threads={config.trainer.num_threads}; 0: every core while its phase runs), TRL {trl_threads}",
        flush=True,
    )
    rounds: list[dict[str, ArmResult]] = []
    report: list[str] = []
    failed = False
    for number, seed in enumerate(args.seeds):
        shift = number % len(args.arms)
        order = args.arms[shift:] + args.arms[:shift]
        print(f"round {number + 1}: seed {seed}, order {', '.join(order)}", flush=True)
        results: dict[str, ArmResult] = {}
        logs: dict[str, RunLog] = {}
        for arm in order:
            results[arm], log = run_arm(arm, seed, args, work)
            if log is not None:
                logs[arm] = log
            failed = failed or not results[arm].ok
            done = results[arm]
            print(
                f"  {arm} done: {'ok' if done.ok else 'FAILED: ' + done.error}; process {fmt(done.process_seconds, 1)} s,"
                f" peak PSS {fmt(done.peak_pss_bytes / 1e9, 2)} GB over {processes(done.peak_processes)},"
                f" {done.pss_samples} PSS samples in {fmt(done.sampler_cpu_seconds, 1)} s of CPU",
                flush=True,
            )
        # The rollouts in which any arm evaluated are left out of every arm.
        excluded = set().union(*(eval_intervals(log) for log in logs.values()))
        for arm, log in logs.items():
            results[arm].eval_intervals = sorted(excluded)
            summarize(results[arm], log, excluded, args.target)
        set_accuracy_target(results, logs, args.target_accuracy)
        rounds.append(results)
        write_json(args, work, config, rounds)  # a bench cut short keeps the rounds it finished
        lines = format_round(seed, order, results, args.target)
        report += lines
        print("\n".join(lines), flush=True)

    left_out = sorted(set().union(*(set(r.eval_intervals) for rs in rounds for r in rs.values())))
    print()
    print(
        f"Per rollout: medians of the intervals between rollout starts, less the first (warm-up) and the"
        f" {len(left_out)} in which an arm evaluated (rollouts {','.join(map(str, left_out)) or 'none'}),"
        " left out of every arm."
    )
    table = format_table(rounds, args.target)
    print("\n".join(table))
    values = result_values(rounds)
    line = result_line(values)
    write_json(args, work, config, rounds, table, values)
    print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: the running arm was stopped", file=sys.stderr)
        sys.exit(130)
