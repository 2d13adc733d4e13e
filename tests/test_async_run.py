"""Whole asynchronous runs (``run.max_staleness``) through the CLI: a run on the local
runtime is the same bit for bit from the same config, trains the prompts the synchronous
loop trains, and a run killed at random moments and resumed trains every prompt of the data
order exactly once, on both runtimes (slow: real processes, a real Ray cluster)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from miles_events.bus.event_log import read_events
from schemas.events import (
    PublicationMismatch,
    PublicationVerified,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    WeightsPublished,
    WeightsStaged,
    kept_steps,
)
from tests.support import cli_env, tiny_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NUM_ROLLOUT = 24
ASYNC = (
    f"run.num_rollout={NUM_ROLLOUT}",
    "run.max_staleness=2",
    "run.save_interval=2",
    "run.eval_interval=1000",
    "run.skip_eval_before_train=true",
    "model.builtin.hidden_size=64",
    "model.builtin.intermediate_size=128",
    "model.builtin.num_hidden_layers=2",
    "model.builtin.num_attention_heads=4",
    "model.builtin.num_key_value_heads=2",
    "data.rollout_batch_size=16",
    "data.n_samples_per_prompt=8",
    "trainer.global_batch_size=128",
    "trainer.micro_batch_size=64",
    "saver.keep_last=0",
    'console.mode="plain"',
    "metrics.enabled=false",
)


def command(run_dir: Path, *overrides: str) -> list[str]:
    return tiny_command(run_dir, *ASYNC, *overrides)


def run_to_end(run_dir: Path, *overrides: str) -> list:
    result = subprocess.run(
        command(run_dir, *overrides), capture_output=True, text=True, timeout=300, cwd=ROOT, env=cli_env()
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return list(read_events(run_dir / "events.log", on_damage=lambda damaged: None))


def killed_at_random(run_dir: Path, rng: random.Random, *overrides: str) -> bool:
    """A run started (resumed when a checkpoint is there) and killed, with every process
    of it, at a random moment within 0.8 s after its first step; False if it ended first."""
    out = run_dir.parent / f"{run_dir.name}.out"
    with out.open("w") as sink:
        process = subprocess.Popen(
            command(run_dir, "run.resume=true", *overrides),
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=cli_env(),
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while not re.search(r"^rollout \d+ \[", out.read_text(), re.M) and process.poll() is None:
        assert time.monotonic() < deadline, out.read_text()[-2000:]
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.8))
    if process.poll() is not None:
        return False
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return True


def trained_prompts(log: list) -> Counter[int]:
    """Each prompt of the data order, as many times as the steps the run kept trained it."""
    steps = kept_steps(log)
    assert [e.rollout_id for e in steps] == list(range(NUM_ROLLOUT)), "every step kept once"
    return Counter(prompt for step in steps for prompt in step.trained_prompts)


def check_verified(log: list, num_rollout: int = NUM_ROLLOUT) -> None:
    versions = [int(e.weight_version) for e in log if isinstance(e, WeightsPublished)]
    verified = [int(e.weight_version) for e in log if isinstance(e, PublicationVerified)]
    assert verified == versions and not [e for e in log if isinstance(e, PublicationMismatch)]
    finished = log[-1]
    assert isinstance(finished, RunFinished) and finished.status == "completed", finished
    assert finished.last_rollout_id == num_rollout - 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list:
    log = run_to_end(tmp_path_factory.mktemp("async") / "run", 'run.runtime="local"')
    check_verified(log)
    return log


def test_an_asynchronous_run_stays_in_its_bound_and_is_the_same_bit_for_bit(tmp_path: Path, uninterrupted):
    staleness = [len(e.token_staleness) - 1 for e in uninterrupted if type(e).__name__ == "TrainStepFinished"]
    assert max(staleness) == 2 and all(s <= 2 for s in staleness), staleness
    again = run_to_end(tmp_path / "again", 'run.runtime="local"')

    def decisions(log: list) -> dict[str, list]:
        """Each kind's events in order: what was asked for, the rewards sampled and the
        weights staged. How the kinds interleave is the machine's timing (a rollout may be
        generated before or after the save of an earlier step is asked for), not the run's."""
        by_kind: dict[str, list] = {}
        for e in log:
            if isinstance(e, WeightsStaged | RolloutGenerated) or type(e).__name__.endswith("Requested"):
                by_kind.setdefault(type(e).__name__, []).append(
                    (
                        getattr(e, "rollout_id", None),
                        getattr(e, "digest", None),
                        getattr(e, "reward_mean", None),
                    )
                )
        return by_kind

    assert decisions(again) == decisions(uninterrupted)


def test_an_asynchronous_run_trains_the_prompts_the_synchronous_loop_trains(tmp_path: Path, uninterrupted):
    synchronous = run_to_end(tmp_path / "sync", 'run.runtime="local"', "run.max_staleness=0")
    assert trained_prompts(uninterrupted) == trained_prompts(synchronous)


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_an_asynchronous_run_killed_at_random_moments_trains_every_prompt_exactly_once(
    tmp_path: Path, uninterrupted, runtime: str
):
    run_dir = tmp_path / "run"
    rng = random.Random(f"kill-{runtime}")
    kills = sum(killed_at_random(run_dir, rng, f'run.runtime="{runtime}"') for _ in range(3))
    assert kills >= 2
    log = run_to_end(run_dir, f'run.runtime="{runtime}"', "run.resume=true")
    check_verified(log)
    assert trained_prompts(log) == trained_prompts(uninterrupted)
    starts = [e for e in log if isinstance(e, RunStarted)]
    resumed = [e for e in starts if e.resumed]
    assert resumed, "a kill after a checkpoint: the run resumed from it"
    for start in resumed:
        # The log says which rollouts were asked for after the checkpoint: generated again.
        assert start.regenerated and start.regenerated[0] == start.start_rollout_id


def test_partial_rollouts_take_publications_mid_rollout_and_each_token_keeps_its_version(tmp_path: Path):
    """With ``rollout.partial`` and generation slower than training (many small chunks),
    publications land inside rollouts: samples span two versions, none past the bound; the
    trainer weighs each token by its truncated importance weight (``trainer.rollout_is_cap``)."""
    log = run_to_end(
        tmp_path / "partial",
        'run.runtime="local"',
        "run.max_staleness=1",
        "rollout.partial=true",
        "rollout.max_batch_size=16",
        "trainer.micro_batch_size=128",
        "run.num_rollout=6",
        "trainer.rollout_is_cap=2.0",
    )
    check_verified(log, num_rollout=6)
    generated = [e for e in log if isinstance(e, RolloutGenerated)]
    assert any(len(e.weight_versions) == 2 for e in generated), [e.weight_versions for e in generated]
    steps = [e for e in log if type(e).__name__ == "TrainStepFinished"]
    assert all(len(e.token_staleness) <= 2 and e.stale_tokens == 0 for e in steps)
    assert any(len(e.token_staleness) == 2 and e.token_staleness[0] for e in steps)  # tokens of two ages
    # Truncated importance weights: about 1 where the engine sampled with the trainer's weights.
    assert all(0.5 < e.metrics.importance_weight <= 2.0 for e in steps), [e.metrics for e in steps]
