"""Whole runs whose trainer heals (``"train"`` in ``run.ft_components``), through the CLI
and the control server: a rank killed with ``inject-fault``, by ``kill -9`` from outside,
and hung (SIGSTOP: the heartbeat kills it). Each time the trainer's group is restarted
from the latest checkpoint the run saved, the rollouts after it are generated and trained
again with the same ids, and the run ends with the very weights of a run without faults:
no step lost, none counted twice (slow: real processes, a real Ray cluster)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from miles_events.bus.event_log import read_events
from miles_events.checkpoint.resume import choose_resume_checkpoint
from schemas.events import (
    CellFailed,
    CellRestarted,
    CellResumed,
    FaultInjected,
    PublicationMismatch,
    PublicationVerified,
    RunFinished,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainStepFinished,
    WeightsPublished,
    kept_steps,
)
from tests.test_heal_run import LiveRun, fails_in_one_line, run_to_end

pytestmark = pytest.mark.slow

NUM_ROLLOUT = 10
TRAIN_HEALS = (
    f"run.num_rollout={NUM_ROLLOUT}",
    "generator.num_engines=1",
    "trainer.num_ranks=2",
    'run.ft_components=["train"]',
    "run.save_interval=3",
)


def check_whole(run_dir: Path) -> tuple[str, list[Any]]:
    """Every step kept once and in order, consecutive versions each verified, each restore
    answered and naming what it does again; returns the final digest and the log."""
    log = list(read_events(run_dir / "events.log"))
    assert [e.rollout_id for e in kept_steps(log)] == list(range(NUM_ROLLOUT)), (
        "every step kept once: none lost, none doubled"
    )
    versions = [int(e.weight_version) for e in log if isinstance(e, WeightsPublished)]
    assert versions == list(range(1, len(versions) + 1)), "consecutive weight versions"
    verified = [e for e in log if isinstance(e, PublicationVerified)]
    assert [int(e.weight_version) for e in verified] == versions
    assert not [e for e in log if isinstance(e, PublicationMismatch)]
    asked = [e for e in log if isinstance(e, TrainerRestoreRequested)]
    restored = [e for e in log if isinstance(e, TrainerRestored)]
    assert [(e.checkpoint, e.rollout_id) for e in restored] == [(e.checkpoint, e.rollout_id) for e in asked]
    for request in asked:
        # The steps done again are those trained (or in training) after the checkpoint.
        after = log.index(request)
        trained_after = [e.rollout_id for e in log[after:] if isinstance(e, TrainStepFinished)]
        assert trained_after[: len(request.redo)] == request.redo
    finished = log[-1]
    assert isinstance(finished, RunFinished) and finished.status == "completed", finished
    return verified[-1].digest, log


@pytest.fixture(scope="module")
def unhurt(tmp_path_factory) -> str:
    run_dir = tmp_path_factory.mktemp("unhurt") / "run"
    result = run_to_end(run_dir, 'run.runtime="local"', *TRAIN_HEALS)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    digest, log = check_whole(run_dir)
    assert not [e for e in log if isinstance(e, CellFailed | TrainerRestoreRequested)]
    return digest


def test_a_rank_killed_then_the_group_suspended_each_restore_the_latest_checkpoint_to_the_same_weights(
    tmp_path: Path, unhurt: str
) -> None:
    """On the local runtime, SIGKILL into actor-1 through inject-fault while rollout 4 or 5
    trains: the group comes back, restores the checkpoint of rollout 2, and rollouts 3.. are
    generated and trained again. Then actor-0 suspended by hand (the group stops, training
    pauses) and resumed: the latest checkpoint again. The very weights of the run without
    faults."""
    run = LiveRun(tmp_path / "run", 'run.runtime="local"', *TRAIN_HEALS)
    try:
        run.wait_for(r"rollout 3 \[")
        run.inject("actor-1", "sigkill")
        run.wait_for("trainer restored")
        run.wait_for(r"rollout 6 \[")
        assert run.suspend("actor-0", True)["spec"]["suspend"] is True
        run.wait_for("actor-1 suspended")
        cells = run.client.get("/cells").json()["items"]
        assert [c["status"]["phase"] for c in cells] == ["Suspended", "Suspended"]
        run.suspend("actor-0", False)
        run.wait_for("actor-1 resumed")
        run.wait_count("trainer restored", 2)
    finally:
        code, out = run.finish()
    assert code == 0, out[-3000:]
    digest, log = check_whole(run.run_dir)
    assert digest == unhurt, "the healed run trained the very weights of the run without faults"
    failed = [e for e in log if isinstance(e, CellFailed)]
    assert [(e.cell, e.hung) for e in failed] == [("actor-1", False)]
    assert "killed by SIGKILL" in failed[0].reason
    assert sorted(e.cell for e in log if isinstance(e, CellRestarted)) == ["actor-0", "actor-1"]
    assert sorted(e.cell for e in log if isinstance(e, CellResumed)) == ["actor-0", "actor-1"]
    request, again = [e for e in log if isinstance(e, TrainerRestoreRequested)]
    assert request.checkpoint is not None and request.checkpoint.endswith("rollout_000002")
    assert request.redo and request.redo[0] == 3
    assert again.checkpoint is not None and again.checkpoint.endswith("rollout_000005")
    injected = [e for e in log if isinstance(e, FaultInjected)]
    assert [(e.cell, e.mode, e.error) for e in injected] == [("actor-1", "sigkill", "")]
    assert "rollouts done again: 3" in out and "Traceback" not in out


def test_on_ray_the_saver_and_a_rank_killed_then_a_rank_hung_heal_to_the_same_weights(
    tmp_path: Path, unhurt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the ray runtime: kill -9 of the Saver's process (``ray.own_process``: started
    again, the checkpoints still written) and of a rank's process from outside, then rank 0
    frozen (SIGSTOP, through inject-fault) until the heartbeat kills it. The same weights
    again, and the run's last checkpoint is the one a resume picks."""
    monkeypatch.setenv("MILES_LOG_LEVEL", "INFO")  # the actors' pids in the run's log
    run = LiveRun(
        tmp_path / "run",
        'run.runtime="ray"',
        'ray.own_process=["saver"]',
        *TRAIN_HEALS,
        "control.heartbeat_interval_seconds=0.5",
        "control.heartbeat_timeout_seconds=1",
        "control.heartbeat_max_failures=2",
    )
    try:
        run.wait_for(r"rollout 1 \[")
        saver = re.search(r"started saver \(ray actor, pid (\d+)\)", (run.run_dir / "run.log").read_text())
        assert saver, "the Saver has a process of its own"
        os.kill(int(saver.group(1)), signal.SIGKILL)
        run.wait_for(r"rollout 2 \[")
        ranks = subprocess.run(
            ["pgrep", "-f", "ray::RankHost"], capture_output=True, text=True
        ).stdout.split()
        assert len(ranks) == 2, "each trainer rank that heals has a process of its own"
        os.kill(int(ranks[-1]), signal.SIGKILL)
        run.wait_for("trainer restored")
        run.wait_for(r"rollout 6 \[")
        run.inject("actor-0", "deadlock")
        run.wait_count("trainer restored", 2)
    finally:
        code, out = run.finish()
    assert code == 0, out[-3000:]
    digest, log = check_whole(run.run_dir)
    assert digest == unhurt
    failed = [e for e in log if isinstance(e, CellFailed) and e.cell.startswith("actor-")]
    assert [e.hung for e in failed] == [False, True], [e.reason for e in failed]
    assert failed[1].cell == "actor-0" and "died" in failed[0].reason
    assert [e.cell for e in log if isinstance(e, CellFailed | CellRestarted) and e.cell == "saver"] == [
        "saver",
        "saver",
    ], "the Saver died and was started again"
    assert choose_resume_checkpoint(run.run_dir).checkpoint == run.run_dir / "checkpoints" / "rollout_000009"


def test_past_its_restarts_a_trainer_rank_fails_the_run_with_one_line(tmp_path: Path) -> None:
    """control.max_restarts = 0: the first rank death ends the run (exit 1) in one line
    naming the cell and the limit."""
    fails_in_one_line(
        LiveRun(tmp_path / "run", 'run.runtime="local"', *TRAIN_HEALS, "control.max_restarts=0"), "actor-1"
    )
