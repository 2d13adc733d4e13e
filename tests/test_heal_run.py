"""Whole runs that heal (``run.ft_components = ["rollout"]``), through the CLI and the
control server: faults injected with ``inject-fault`` (SIGKILL, a hang) and by ``kill -9``
of an engine's process, suspensions and resumes (by hand and by the mini FT controller).
Each run finishes with every rollout trained once, in order, consecutive weight versions,
every restarted engine's weights verified, a verified final publication, and the very
weights of a run without faults (slow: real processes, a real Ray cluster)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.engine.server_process import free_port
from miles_events.bus.event_log import read_events
from schemas.events import (
    CellFailed,
    CellHealing,
    CellRestarted,
    CellResumed,
    CellSuspended,
    FaultInjected,
    PublicationMismatch,
    PublicationVerified,
    RestoreVerified,
    RunFinished,
    TrainStepFinished,
    WeightsPublished,
    WeightsStaged,
)
from tests.support import cli_env, tiny_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NUM_ROLLOUT = 24
HEAL = (
    "generator.num_engines=2",
    f"run.num_rollout={NUM_ROLLOUT}",
    'run.ft_components=["rollout"]',
    "run.eval_interval=1000",
    "run.save_interval=1000",
    "control.heartbeat_interval_seconds=0.5",
    "control.heartbeat_timeout_seconds=1",
    "control.heartbeat_max_failures=2",
    "control.restart_backoff_seconds=0",
    'console.mode="plain"',
    "metrics.enabled=false",
)


def command(run_dir: Path, *overrides: str) -> list[str]:
    return tiny_command(run_dir, *HEAL, *overrides)


def run_to_end(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(run_dir, *overrides), capture_output=True, text=True, timeout=300, cwd=ROOT, env=cli_env()
    )


class LiveRun:
    """A run in the background, its control server at hand."""

    def __init__(self, run_dir: Path, *overrides: str) -> None:
        self.run_dir = run_dir
        self.port = free_port()
        self.out = run_dir.parent / f"{run_dir.name}.out"
        self.out_file = self.out.open("w")
        env = cli_env(MILES_CONTROL_TOKEN="heal-test-token")
        self.process = subprocess.Popen(
            command(run_dir, f"run.control_server_port={self.port}", *overrides),
            stdout=self.out_file,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}/api/v1",
            headers={"Authorization": "Bearer heal-test-token"},
            timeout=10,
        )

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until the run printed ``text`` (a regular expression)."""
        deadline = time.monotonic() + timeout
        while not re.search(text, self.out.read_text()):
            assert self.process.poll() is None, self.out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.out.read_text()[-3000:]}"
            time.sleep(0.1)

    def wait_count(self, text: str, count: int, timeout: float = 120) -> None:
        """Until the run printed ``text`` (plain) ``count`` times."""
        deadline = time.monotonic() + timeout
        while self.out.read_text().count(text) < count:
            assert self.process.poll() is None, self.out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not {count} {text!r} in:\n{self.out.read_text()[-3000:]}"
            time.sleep(0.1)

    def inject(self, cell: str, mode: str) -> None:
        response = self.client.post(f"/cells/{cell}/inject-fault", json={"mode": mode})
        assert response.json() == {"status": "ok"}, response.text

    def kill_one_then_hang_the_other(self) -> None:
        """Once rollout 3 runs: SIGKILL into rollout-1, and once it is back, a hang (SIGSTOP)
        into rollout-0, until it is back too."""
        self.wait_for(r"rollout 3 \[")
        self.inject("rollout-1", "sigkill")
        self.wait_for("rollout-1 restarted")
        self.inject("rollout-0", "deadlock")
        self.wait_for("rollout-0 restarted")

    def suspend(self, cell: str, suspend: bool) -> dict[str, Any]:
        response = self.client.patch(f"/cells/{cell}", json={"spec": {"suspend": suspend}})
        assert response.status_code == 200, response.text
        return response.json()

    def finish(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=240)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.client.close()
            self.out_file.close()
        return code, self.out.read_text()


def check_whole(run_dir: Path) -> tuple[list[str], list[Any]]:
    """What every healed run must show in its log: each rollout trained once and in order,
    consecutive versions, every restore verified, the final publication verified. Returns
    the digests of the verified publications, and the log."""
    log = list(read_events(run_dir / "events.log"))
    trained = [e.rollout_id for e in log if isinstance(e, TrainStepFinished)]
    assert trained == list(range(NUM_ROLLOUT)), "every step trained once, none lost or doubled"
    versions = [int(e.weight_version) for e in log if isinstance(e, WeightsPublished)]
    assert versions == list(range(1, NUM_ROLLOUT + 2)), "consecutive weight versions"
    verified = [e for e in log if isinstance(e, PublicationVerified)]
    assert [int(e.weight_version) for e in verified] == versions
    assert not [e for e in log if isinstance(e, PublicationMismatch)]
    # Each engine started again serves the version every engine served, verified.
    for event in log:
        if isinstance(event, CellRestarted | CellResumed) and event.weight_version != "default":
            engine = f"engine-{event.cell.split('-')[1]}"
            assert any(
                isinstance(e, RestoreVerified)
                and (e.engine, e.weight_version) == (engine, event.weight_version)
                for e in log
            ), event
    finished = log[-1]
    assert isinstance(finished, RunFinished) and finished.status == "completed", finished
    return [e.digest for e in verified], log


@pytest.fixture(scope="module")
def unhurt(tmp_path_factory) -> list[str]:
    """The digests of a run without faults, on the local runtime."""
    run_dir = tmp_path_factory.mktemp("unhurt") / "run"
    result = run_to_end(run_dir, 'run.runtime="local"')
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    digests, log = check_whole(run_dir)
    assert not [e for e in log if isinstance(e, CellFailed)]
    return digests


def test_an_engine_killed_then_one_hung_then_one_suspended_heal_to_the_same_weights(tmp_path: Path, unhurt):
    """On the local runtime: SIGKILL into rollout-1 and a hang (SIGSTOP) into rollout-0
    through inject-fault, then rollout-1 suspended and resumed by hand. Each engine comes back
    with the current weights, verified, its prompts sampled again with the same seeds: the run
    trains exactly the weights of the run without faults."""
    run = LiveRun(tmp_path / "run", 'run.runtime="local"')
    try:
        run.kill_one_then_hang_the_other()
        assert run.suspend("rollout-1", True)["spec"]["suspend"] is True
        run.wait_for("rollout-1 suspended")
        cells = run.client.get("/cells").json()["items"]
        assert [c["status"]["phase"] for c in cells] == ["Running", "Suspended"]
        run.suspend("rollout-1", False)
        run.wait_for("rollout-1 resumed")
    finally:
        code, out = run.finish()
    assert code == 0, out[-3000:]
    digests, log = check_whole(run.run_dir)
    assert digests == unhurt, "the healed run trained the very weights of the run without faults"
    failed = [e for e in log if isinstance(e, CellFailed)]
    assert [(e.cell, e.hung) for e in failed] == [("rollout-1", False), ("rollout-0", True)]
    assert "killed by SIGKILL" in failed[0].reason
    assert [e.cell for e in log if isinstance(e, CellRestarted)] == ["rollout-1", "rollout-0"]
    assert [e.cell for e in log if isinstance(e, CellSuspended)] == ["rollout-1"]
    injected = [e for e in log if isinstance(e, FaultInjected)]
    assert [(e.cell, e.mode, e.error) for e in injected] == [
        ("rollout-1", "sigkill", ""),
        ("rollout-0", "deadlock", ""),
    ]
    assert "rollout-1 failed" in out and "rollout-0 hung" in out


def test_over_the_collective_a_killed_and_a_hung_engine_rejoin_and_heal_to_the_same_weights(
    tmp_path: Path, unhurt
):
    """With ``publisher.transport = "collective"``: each engine restarted in place of a killed
    or a hung one joins under its name anew, its channel is formed again, and its restore comes
    over it, verified; the run trains the weights of the run without faults."""
    run = LiveRun(
        tmp_path / "run",
        'run.runtime="local"',
        'publisher.transport="collective"',
        "publisher.broadcast_timeout=10",
    )
    try:
        run.kill_one_then_hang_the_other()
    finally:
        code, out = run.finish()
    assert code == 0, out[-3000:]
    digests, log = check_whole(run.run_dir)
    assert digests == unhurt
    staged = [e for e in log if isinstance(e, WeightsStaged)]
    assert staged and all(e.weights.transport == "collective" for e in staged)
    restored = [(e.engine, e.weight_version) for e in log if isinstance(e, RestoreVerified)]
    assert [engine for engine, _ in restored] == ["engine-1", "engine-0"]


def test_on_ray_a_kill_9_of_an_engine_heals_and_the_controller_resumes_a_suspended_cell(
    tmp_path: Path, unhurt
):
    """On the ray runtime: kill -9 of an engine's process from outside, and a cell suspended by
    hand that the mini FT controller resumes; the same weights as the run without faults."""
    run = LiveRun(
        tmp_path / "run",
        'run.runtime="ray"',
        "run.mini_ft_controller=true",
        "control.controller_poll_seconds=0.5",
        "control.controller_suspend_seconds=0.5",
    )
    try:
        run.wait_for(r"rollout 3 \[")
        engines = subprocess.run(
            ["pgrep", "-f", "ray::RankHost"], capture_output=True, text=True
        ).stdout.split()
        assert len(engines) >= 2, "each embedded engine that heals has a process of its own"
        os.kill(int(engines[-1]), signal.SIGKILL)
        # The engine restarts itself, unless the controller, finding it unhealthy first,
        # suspends and resumes it.
        run.wait_for(r"rollout-\d (restarted|resumed)")
        resumed = run.out.read_text().count(" resumed (")
        run.suspend("rollout-0", True)
        run.wait_count(" resumed (", resumed + 1, timeout=60)
    finally:
        code, out = run.finish()
    assert code == 0, out[-3000:]
    digests, log = check_whole(run.run_dir)
    assert digests == unhurt
    healing = [(e.cell, e.step) for e in log if isinstance(e, CellHealing) and e.cell == "rollout-0"]
    assert ("rollout-0", "resume") in healing and ("rollout-0", "done") in healing
    assert any(isinstance(e, CellFailed) and "died" in e.reason for e in log)


def fails_in_one_line(run: LiveRun, cell: str) -> None:
    """With ``control.max_restarts = 0``: a segfault into ``cell`` once the run trains ends
    it (exit 1) with one line naming the cell and the limit, no traceback."""
    try:
        run.wait_for(r"rollout 1 \[")
        run.inject(cell, "segfault")
    finally:
        code, out = run.finish()
    assert code == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: run failed: ") and cell in last and "control.max_restarts = 0" in last, (
        last
    )
    assert "Traceback" not in out


def test_past_its_restarts_an_engine_fails_the_run_with_one_line(tmp_path: Path):
    """control.max_restarts = 0: the first death ends the run (exit 1) with one line naming
    the cell and the limit."""
    fails_in_one_line(LiveRun(tmp_path / "run", 'run.runtime="local"', "control.max_restarts=0"), "rollout-1")
