"""Whole runs of ``examples/vllm.toml``, through the CLI: two servers train and every
publication reaches both verified; a server killed
mid-run is restarted with the current weights, and past its restarts ends the run with one
line (slow: real vLLM servers; needs ``.venv-vllm``, see ``tests/test_vllm_engine.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_events.bus.event_log import read_events
from schemas.events import (
    CellRestarted,
    PublicationMismatch,
    PublicationVerified,
    RestoreVerified,
    RolloutGenerated,
    TrainStepFinished,
    WeightsLoaded,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_vllm")]

ROOT = Path(__file__).resolve().parents[1]


EXAMPLE = ROOT / "examples" / "vllm.toml"
"""The vLLM settings that work on CPU (a head dimension of 32; the linear weights vLLM repacks
left out of the digests and proven by the probe; publications pushed with their canary)."""

QUIET = ('console.mode="plain"', "metrics.enabled=false")


def vllm_run(run_dir: Path, *overrides: str) -> list[str]:
    """The CLI command of ``examples/vllm.toml`` with ``overrides``, in ``run_dir``."""
    command = [sys.executable, "-m", "miles_events.run", str(EXAMPLE)]
    for override in (f'run.dir="{run_dir}"', *QUIET, *overrides):
        command += ["--set", override]
    return command


def rollout_rewards(run_dir: Path) -> list[float]:
    return [e.reward_mean for e in read_events(run_dir / "events.log") if isinstance(e, RolloutGenerated)]


def test_two_vllm_engines_learn_from_two_trainer_ranks_and_every_publication_reaches_both_verified(
    tmp_path: Path,
):
    """Two real vLLM servers launched by the run, prompts spread over both, a trainer of two
    FSDP2 ranks whose gathered weights are published: every publication pushed to both
    servers through the worker extension and verified (its canary the write proof), versions
    consecutive on each engine, and the reward up."""
    run_dir = tmp_path / "run"
    num_rollout = 6
    command = vllm_run(
        run_dir,
        f"run.num_rollout={num_rollout}",
        "data.rollout_batch_size=32",
        "data.n_samples_per_prompt=8",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=64",
        "trainer.lr=0.01",
        'rollout.reward_fn="tests.e2e_rewards.starts_with_one"',
        "generator.num_engines=2",
        "trainer.num_ranks=2",
        "trainer.num_threads=1",
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = list(read_events(run_dir / "events.log"))
    loaded = [e for e in log if isinstance(e, WeightsLoaded)]
    for engine in ("engine-0", "engine-1"):
        versions = [(e.previous_version, e.weight_version) for e in loaded if e.engine == engine]
        expected = [("default", "1")] + [(str(v), str(v + 1)) for v in range(1, num_rollout + 1)]
        assert versions == expected, f"{engine} served every version, one after another"
    verified = [e for e in log if isinstance(e, PublicationVerified)]
    assert [e.weight_version for e in verified] == [str(v) for v in range(1, num_rollout + 2)]
    assert all(e.engines == ["engine-0", "engine-1"] and e.write_proof == "canary" for e in verified)
    assert not [e for e in log if isinstance(e, PublicationMismatch)]
    steps = [e for e in log if isinstance(e, TrainStepFinished)]
    assert steps and all([r.rank for r in e.ranks] == [0, 1] for e in steps)
    rewards = rollout_rewards(run_dir)
    assert rewards[-1] > rewards[0] + 0.3, f"the reward rises: {rewards}"
    engine_logs = sorted(p.name for p in (run_dir / "vllm").glob("*.log"))
    assert engine_logs == ["engine-0.log", "engine-1.log"], "each server logs under the run directory"
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftover.returncode == 1, leftover.stdout  # both servers' process groups are gone


def test_a_killed_server_is_restarted_verified_and_past_its_restarts_ends_the_run_in_one_line(tmp_path: Path):
    """kill -9 of a vLLM server while the run trains, with ``run.ft_components = ["rollout"]``:
    the server is launched again, loads the weights every engine serves (its canary and the
    probe verify it) and the run goes on; killed again past ``control.max_restarts = 1`` the
    run ends (exit 1, no hang) with one line naming the cell, the limit and that the server
    exited; nothing of the run is left running."""
    run_dir = tmp_path / "run"
    command = vllm_run(
        run_dir,
        "run.num_rollout=200",
        "data.rollout_batch_size=8",
        "data.n_samples_per_prompt=4",
        "trainer.global_batch_size=32",
        "trainer.micro_batch_size=32",
        'run.ft_components=["rollout"]',
        "control.max_restarts=1",
        "control.restart_backoff_seconds=0",
    )
    out, err = tmp_path / "stdout", tmp_path / "stderr"

    def kill_servers() -> None:
        servers = subprocess.run(
            ["pgrep", "-f", f"api_server.*{run_dir}"], capture_output=True, text=True
        ).stdout.split()
        assert servers, "the server runs with the run directory in its command line"
        for pid in servers:
            os.kill(int(pid), signal.SIGKILL)

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 420
        while text not in out.read_text():
            assert run.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r}"
            time.sleep(0.5)

    with out.open("w") as stdout, err.open("w") as stderr:
        run = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=ROOT, text=True)
        try:
            wait_for("rollout 1 [2/200]")
            kill_servers()
            wait_for("rollout-0 restarted")
            kill_servers()
            code = run.wait(timeout=180)
        finally:
            if run.poll() is None:
                run.kill()
    assert code == 1, out.read_text()[-2000:] + err.read_text()[-2000:]
    last = err.read_text().strip().splitlines()[-1]
    assert last.startswith("error: run failed: ") and "rollout-0" in last and "exited" in last, last
    assert "control.max_restarts = 1" in last, last
    assert "Traceback" not in err.read_text()
    log = list(read_events(run_dir / "events.log"))
    restored = [e for e in log if isinstance(e, RestoreVerified)]
    assert len(restored) == 1 and restored[0].write_proof == "canary", restored
    assert restored[0].probe_max_diff is not None, "the probe verified the linears vLLM repacks"
    restarted = next(e for e in log if isinstance(e, CellRestarted))
    assert restarted.weight_version == restored[0].weight_version
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftover.returncode == 1, leftover.stdout
