"""Runs whose trainer is two ranks, through the CLI as a user starts them: on both runtimes
every publication verified, the checkpoint one Hugging Face directory, resume exact across
a stop and across rank counts, and a rank that dies or hangs ending the run with one line
naming it, leaving no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_events.bus.event_log import read_events
from miles_events.checkpoint.format import read_checkpoint
from miles_events.checkpoint.resume import latest_checkpoint
from schemas.events import (
    PublicationVerified,
    RunStarted,
    TrainStepFinished,
    WeightsStaged,
)
from tests.test_e2e import ROOT, SMALL, TINY, events, published_versions, rollouts, run_cli

pytestmark = pytest.mark.slow

TWO_RANKS = ("trainer.num_ranks=2", "trainer.num_threads=1")
UPDATE_TOLERANCE = 1e-4
"""As in tests/test_trainer_ranks.py: two trainings' updates differ by at most this part of
the update's L2 norm when they differ only in how the ranks add up the gradient."""


def digests(log: list) -> dict[str, str]:
    """Weight version -> the digest staged for it (the last staging of a version)."""
    return {e.weight_version: e.digest for e in log if isinstance(e, WeightsStaged)}


def update_difference(
    base: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> float:
    apart = sum(float(((a[n].double() - b[n].double()) ** 2).sum()) for n in a) ** 0.5
    update = sum(float(((a[n].double() - base[n].double()) ** 2).sum()) for n in a) ** 0.5
    return apart / update


COMMON = ("run.num_rollout=3", "run.save_interval=2", "trainer.num_threads=1")
"""Three rollouts, checkpoints after the second and the last."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Whole two-rank runs on each runtime, and the first two rollouts of the same run with
    two ranks and with one (a checkpoint after the second), which the tests resume."""
    made = {}
    for name, overrides in {
        "local": ('run.runtime="local"', "trainer.num_ranks=2"),
        "ray": ('run.runtime="ray"', "trainer.num_ranks=2"),
        "first-2": ('run.runtime="local"', "trainer.num_ranks=2", "run.debug_exit_after_rollout=2"),
        "first-1": ('run.runtime="local"', "trainer.num_ranks=1", "run.debug_exit_after_rollout=2"),
    }.items():
        run_dir = tmp_path_factory.mktemp(name)
        made[name] = (run_dir, run_cli(run_dir, *COMMON, *overrides))
    return made


def resumed(runs, first: str, ranks: int, into: Path) -> tuple[list, list]:
    """``first``'s run dir copied to ``into`` and resumed there with ``ranks`` ranks: the
    events of the first part, and of the resume."""
    source, result = runs[first]
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(source, into)
    before = events(into)
    result = run_cli(into, 'run.runtime="local"', *COMMON, f"trainer.num_ranks={ranks}", "run.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    return before, events(into)[len(before) :]


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_a_two_rank_run_verifies_every_publication(runs, runtime):
    run_dir, result = runs[runtime]
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(run_dir)
    (started,) = [e for e in log if isinstance(e, RunStarted)]
    assert (started.trainer_ranks, started.trainer_sharding) == (2, "fsdp2")
    published = published_versions(log)
    assert published == ["1", "2", "3", "4"]
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == published
    steps = [e for e in log if isinstance(e, TrainStepFinished)]
    assert len(steps) == 3
    for step in steps:
        assert [r.rank for r in step.ranks] == [0, 1]
        assert len({r.pid for r in step.ranks}) == 2, "each rank has a process of its own"
        assert all(r.state_bytes > 0 and r.step_seconds > 0 for r in step.ranks)


def test_both_runtimes_train_two_ranks_alike(runs):
    local, ray = (events(runs[r][0]) for r in ("local", "ray"))
    assert rollouts(local) == rollouts(ray)
    assert digests(local) == digests(ray)


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_a_two_rank_checkpoint_is_one_directory_transformers_loads(runs, runtime):
    run_dir, _result = runs[runtime]
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    saved = read_checkpoint(checkpoint)
    for name, tensor in model.state_dict().items():
        if name in saved.weights:
            assert torch.equal(tensor, saved.weights[name]), name
    assert set(saved.optimizer["state"]) <= set(model.state_dict()), "keyed by parameter name"


def test_two_ranks_train_what_one_rank_trains(runs):
    assert_two_ranks_train_what_one_trains(runs["first-2"][0], runs["first-1"][0])


def assert_two_ranks_train_what_one_trains(two_dir: Path, one_dir: Path) -> None:
    """The runs' first rollout (the same samples, the same weights) trained alike, and their
    checkpoints' updates within ``UPDATE_TOLERANCE``."""
    two = [e.metrics for e in events(two_dir) if isinstance(e, TrainStepFinished)]
    one = [e.metrics for e in events(one_dir) if isinstance(e, TrainStepFinished)]
    # The first rollout is the same one: same samples, same weights.
    assert two[0].train_tokens == one[0].train_tokens
    assert two[0].loss == pytest.approx(one[0].loss, abs=1e-6)
    assert two[0].grad_norm == pytest.approx(one[0].grad_norm, rel=1e-5)
    one_weights = read_checkpoint(latest_checkpoint(one_dir)).weights
    two_weights = read_checkpoint(latest_checkpoint(two_dir)).weights
    base_model = AutoModelForCausalLM.from_pretrained(one_dir / "base_model").state_dict()
    base_weights = {name: base_model[name] for name in one_weights}
    assert update_difference(base_weights, one_weights, two_weights) <= UPDATE_TOLERANCE


def test_a_resumed_two_rank_run_ends_with_bitwise_the_weights_of_an_uninterrupted_one(runs, tmp_path):
    _first, second = resumed(runs, "first-2", 2, tmp_path / "run")
    whole = events(runs["local"][0])
    split = events(tmp_path / "run")
    assert rollouts(split) == rollouts(whole)
    assert digests(split) == digests(whole)
    assert [e.weight_version for e in second if isinstance(e, PublicationVerified)] == ["3", "4"]
    a = read_checkpoint(latest_checkpoint(runs["local"][0]))
    b = read_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert a.trainer_state.rollout_id == b.trainer_state.rollout_id == 2
    for name, tensor in a.weights.items():
        assert torch.equal(tensor, b.weights[name]), name


@pytest.mark.parametrize(("first", "after"), [("first-2", 1), ("first-1", 2)])
def test_a_checkpoint_resumes_with_another_rank_count(runs, tmp_path, first, after):
    before, second = resumed(runs, first, after, tmp_path / "run")
    (started,) = [e for e in second if isinstance(e, RunStarted)]
    assert started.resumed and started.trainer_ranks == after
    # The resume republishes the saved weights: the same bytes as the first run published.
    republished = next(e for e in second if isinstance(e, WeightsStaged))
    assert republished.weight_version == "3"
    assert republished.digest == digests(before)["3"]
    assert [e.weight_version for e in second if isinstance(e, PublicationVerified)] == ["3", "4"]


# --- a rank that dies or hangs --------------------------------------------------------------


def start_long_run(run_dir: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{run_dir}"',
            "--set", "metrics.port=0", "--set", 'console.mode="plain"']  # fmt: skip
    for override in (*SMALL, 'run.runtime="local"', "run.num_rollout=50", *TWO_RANKS, *overrides):
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )


def rank_pids_once_trained(run_dir: Path, driver: subprocess.Popen, within: float = 120.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        log = run_dir / "events.log"
        if log.exists():
            steps = [e for e in read_events(log) if isinstance(e, TrainStepFinished)]
            if steps:
                return [r.pid for r in steps[0].ranks]
        time.sleep(0.2)
    raise AssertionError(f"no train step within {within}s")


def gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_rank_killed_mid_run_ends_it_with_one_line_naming_the_rank(tmp_path):
    driver = start_long_run(tmp_path / "run")
    try:
        pids = rank_pids_once_trained(tmp_path / "run", driver)
        os.kill(pids[1], signal.SIGKILL)
        _out, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert f"trainer rank 1 (pid {pids[1]}) died: killed by SIGKILL" in lines[0], lines[0]
    assert "Traceback" not in err
    assert gone(driver.pid)


def test_a_rank_that_hangs_ends_the_run_within_the_collective_timeout(tmp_path):
    driver = start_long_run(tmp_path / "run", "trainer.collective_timeout=5")
    try:
        pids = rank_pids_once_trained(tmp_path / "run", driver)
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        _out, err = driver.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        driver.kill()
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert driver.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    # Stopped in a collective, rank 0's times out; stopped between calls, rank 1 is late.
    assert "actor trainer failed" in line, line
    assert (
        "Timed out waiting 5000ms" in line
        or f"rank 1 (pid {pids[1]}): TimeoutError: did not return within 5s" in line
    ), line
    assert f"still in the call: rank 1 (pid {pids[1]})" in line, line
    assert ".cc:" not in line, "no C++ source location"
    assert took < 60
    assert gone(pids[1]), "the hung rank's process is ended with the run"
