"""Two runs average their policies through one shared directory, side by side, as users run
them: two ``python -m miles_events.run`` processes with the shipped plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_events.bus.event_log import read_events
from schemas.events import PolicySyncFinished, PublicationVerified, RunFinished, WeightsStaged

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"


def start(run_dir: Path, shared: Path, peer: str, seed: int) -> subprocess.Popen:
    overrides = [
        f'run.dir="{run_dir}"',
        'run.runtime="local"',
        "metrics.port=0",
        f"run.seed={seed}",
        "run.num_rollout=3",
        "run.save_interval=1000",
        "run.skip_eval_before_train=true",
        "run.eval_interval=1000",
        "data.rollout_batch_size=8",
        "data.n_samples_per_prompt=8",
        "trainer.global_batch_size=64",
        "trainer.micro_batch_size=64",
        "trainer.lr=0.01",
        # One token's choice: rewards that vary from the first rollout, so every step trains.
        'rollout.reward_fn="tests.e2e_rewards.starts_with_one"',
        'run.external_policy_sync_path="miles_events.policy_sync.shared_dir:SharedDirSync"',
        f'policy_sync.directory="{shared}"',
        "policy_sync.peers=2",
        f'policy_sync.peer="{peer}"',
        "policy_sync.timeout_seconds=120",
    ]
    args = [sys.executable, "-m", "miles_events.run", str(TINY)]
    for override in overrides:
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )


def test_two_runs_publish_the_same_averaged_policy_after_every_round(tmp_path: Path):
    shared = tmp_path / "shared"
    # Different seeds: different base models and samples; the initial round makes one policy of them.
    runs = {"a": start(tmp_path / "a", shared, "a", seed=1), "b": start(tmp_path / "b", shared, "b", seed=2)}
    for peer, process in runs.items():
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{peer}: {err[-3000:]}"
    logs = {peer: list(read_events(tmp_path / peer / "events.log")) for peer in runs}
    staged = {
        peer: {e.weight_version: e.digest for e in log if isinstance(e, WeightsStaged)}
        for peer, log in logs.items()
    }
    verified = {
        peer: {e.weight_version: e.digest for e in log if isinstance(e, PublicationVerified)}
        for peer, log in logs.items()
    }
    # The initial publication and one per step, each the same mean on both runs, verified.
    assert list(staged["a"]) == ["1", "2", "3", "4"]
    assert staged["a"] == staged["b"] == verified["a"] == verified["b"]
    # The steps trained: each round's mean differs from the one before.
    assert len(set(staged["a"].values())) == 4
    for peer, log in logs.items():
        (finished,) = [e for e in log if isinstance(e, RunFinished)]
        assert finished.status == "completed" and finished.weight_version == "4", finished.reason
        hooks = [(e.hook, e.rollout_id) for e in log if isinstance(e, PolicySyncFinished)]
        assert hooks == [
            ("initialize", None),
            ("after_inference_publication", None),
            *[(hook, k) for k in range(3) for hook in ("after_local_train", "after_inference_publication")],
            ("finalize", None),
        ], peer
    # Earlier rounds were pruned; the last round's files stay.
    assert sorted(os.listdir(shared)) == ["round-00000002"]
    assert sorted(os.listdir(shared / "round-00000002")) == [
        "a.safetensors",
        "a.sha256",
        "b.safetensors",
        "b.sha256",
    ]
