"""The fault suite: ``kill -9`` of the driver, or of one actor process, at points of a short
run, then ``run.resume = true`` until the run completes. From the event log: no rollout is
lost and none is trained twice into the final weights (the killed run's rollouts after its
last checkpoint are redone, and only those), and the final weights equal an uninterrupted
run's, bit for bit."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from miles_events.bus.event_log import read_events
from miles_events.checkpoint.format import read_checkpoint
from miles_events.checkpoint.resume import latest_checkpoint
from miles_events.runtime.leftovers import descendants
from schemas.events import RunFinished, RunStarted, TrainStepFinished
from tests.support import not_console

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"
NUM_ROLLOUT = 6

pytestmark = pytest.mark.slow

COMMON = (
    "data.rollout_batch_size=16",
    "data.n_samples_per_prompt=8",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "metrics.port=0",
    'console.mode="plain"',
    f"run.num_rollout={NUM_ROLLOUT}",
    "run.save_interval=2",
    "run.eval_interval=100",
)


def command(run_dir: Path, runtime: str, *overrides: str) -> list[str]:
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{run_dir}"']
    for override in (*COMMON, f'run.runtime="{runtime}"', *overrides):
        args += ["--set", override]
    return args


ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def run(run_dir: Path, runtime: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(run_dir, runtime, *overrides), capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=400
    )


def kill_after(
    run_dir: Path, runtime: str, rollout_line: int, victim: str, extra_delay: float
) -> subprocess.CompletedProcess:
    """Start a run; once it prints its ``rollout_line``-th rollout line, wait ``extra_delay``
    seconds and ``kill -9`` the ``victim`` ("driver" or an actor's Ray process); returns
    the driver's exit status and everything it printed."""
    overrides = ("run.resume=true",) if (run_dir / "events.log").exists() else ()
    args = command(run_dir, runtime, *overrides)
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV
    )
    try:
        assert process.stdout is not None
        seen, printed = 0, []
        for line in process.stdout:
            printed.append(line)
            if line.startswith("rollout "):
                seen += 1
                if seen >= rollout_line:
                    break
        time.sleep(extra_delay)
        if victim == "driver":
            process.send_signal(signal.SIGKILL)
        else:
            os.kill(actor_pid(process.pid, victim), signal.SIGKILL)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    return subprocess.CompletedProcess(args, process.returncode, "".join(printed) + out, err)


def actor_pid(driver: int, name: str) -> int:
    """The pid of one of the Ray actor processes of the run of ``driver`` (a model actor's:
    the light ones are hosted by the driver), their titles naming the actor's method."""

    def title(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    hosts = [pid for pid, _ in descendants(driver) if title(pid).startswith(b"ray::RemoteActorHost")]
    assert hosts, "no Ray actor process found"
    return random.Random(name).choice(sorted(hosts))


def trained_into_final_weights(run_dir: Path) -> list[int]:
    """Per run of the log, its rollouts up to the checkpoint the next run resumed from (all
    of the last run's): the rollouts whose training the final weights hold, in order."""
    log = list(read_events(run_dir / "events.log"))
    runs: list[str] = []
    for event in log:
        if event.run_id not in runs:
            runs.append(event.run_id)
    kept: list[int] = []
    for index, run_id in enumerate(runs):
        trained = [e.rollout_id for e in log if e.run_id == run_id and isinstance(e, TrainStepFinished)]
        if index + 1 < len(runs):
            (next_start,) = [
                e.start_rollout_id for e in log if e.run_id == runs[index + 1] and isinstance(e, RunStarted)
            ]
            trained = [r for r in trained if r < next_start]
        kept.extend(trained)
    return kept


def last_run_status(run_dir: Path) -> str | None:
    """How the log's last run finished (None: it never did, as a killed driver's)."""
    log = list(read_events(run_dir / "events.log"))
    last = log[-1].run_id
    finished = [e.status for e in log if e.run_id == last and isinstance(e, RunFinished)]
    return finished[0] if finished else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("whole")
    result = run(run_dir, "local")
    assert result.returncode == 0, result.stderr[-2000:]
    return read_checkpoint(latest_checkpoint(run_dir)).weights


def finish_by_resuming(run_dir: Path, runtime: str) -> None:
    for _ in range(3):
        if last_run_status(run_dir) == "completed":
            return
        result = run(run_dir, runtime, "run.resume=true")
        assert result.returncode in (0, 1), result.stderr[-2000:]
    raise AssertionError("the run did not complete after three resumes")


def assert_exactly_once_and_equal(run_dir: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    assert trained_into_final_weights(run_dir) == list(range(NUM_ROLLOUT)), (
        "a rollout was lost or trained twice"
    )
    final = read_checkpoint(latest_checkpoint(run_dir))
    assert final.trainer_state.rollout_id == NUM_ROLLOUT - 1
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, final.weights[name]), name


@pytest.mark.parametrize(
    ("rollout_line", "delay"), [(1, 0.0), (3, 0.05), (4, 0.3)], ids=["early", "mid-step", "late"]
)
def test_kill_9_of_the_driver_then_resume(tmp_path, uninterrupted, rollout_line, delay):
    kill_after(tmp_path, "local", rollout_line, "driver", delay)
    finish_by_resuming(tmp_path, "local")
    assert_exactly_once_and_equal(tmp_path, uninterrupted)


def test_kill_9_of_an_actor_process_on_ray_is_one_error_line_then_resume(tmp_path, uninterrupted):
    """The run that lost an actor process fails with one line, the detail in the run log;
    resumed, it trains every rollout once into the uninterrupted run's weights."""
    result = kill_after(tmp_path, "ray", 3, "actor", 0.1)
    assert result.returncode == 1, result.stderr[-2000:]
    assert last_run_status(tmp_path) == "failed"
    assert not_console(result.stdout) == []
    (error,) = result.stderr.splitlines()
    assert error.startswith("error: run failed: actor ") and "actor process died" in error
    assert error.endswith(f"(log: {tmp_path / 'run.log'})")
    log = (tmp_path / "run.log").read_text()
    assert re.search(r"ERROR \[driver pid \d+\] miles_events.runtime.ray: actor \w+ is gone: ", log), log
    assert "Worker exit type" in log  # Ray's account of the death, in full
    finish_by_resuming(tmp_path, "local")
    assert_exactly_once_and_equal(tmp_path, uninterrupted)
