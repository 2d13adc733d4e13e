"""PPO with a critic (``trainer.use_critic``), run from the CLI on the embedded default: the
seed's order (the critic first, the policy from ``num_critic_only_steps`` on), the critic in
every checkpoint as a Hugging Face value model, and an exact resume of both."""

from __future__ import annotations

import pytest
import torch

from actors.trainer_backend.critic_backend import load_value_model
from miles_events.checkpoint.format import read_checkpoint, read_critic
from miles_events.checkpoint.resume import latest_checkpoint
from miles_events.rl.hf_model import load_model
from schemas.events import (
    CriticStepFinished,
    DataReleased,
    RolloutGenerated,
    RunStarted,
    TrainStepFinished,
    WeightsStaged,
)
from tests.test_e2e import events, published_versions, rollouts, run_cli

pytestmark = pytest.mark.slow

PPO = (
    'run.runtime="local"',
    "trainer.use_critic=true",
    "trainer.num_critic_only_steps=1",
    "trainer.lambd=0.95",
    "trainer.critic_lr=0.002",
)


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """Four rollouts whole, and the same run stopped after two and resumed."""
    root = tmp_path_factory.mktemp("ppo")
    common = (*PPO, "run.num_rollout=4", "run.save_interval=2")
    whole = run_cli(root / "whole", *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli(root / "split", *common, "run.debug_exit_after_rollout=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(root / "split", *common, "run.resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    return root


def test_the_critic_trains_first_and_the_policy_only_after_the_critic_only_steps(ppo_runs):
    log = events(ppo_runs / "whole")
    order = [
        (type(e).__name__, e.rollout_id)
        for e in log
        if isinstance(e, RolloutGenerated | CriticStepFinished | TrainStepFinished)
    ]
    assert order == [
        (name, k)
        for k in range(4)
        for name in ("RolloutGenerated", "CriticStepFinished", "TrainStepFinished")
    ]
    critic = [e for e in log if isinstance(e, CriticStepFinished)]
    trained = [e for e in log if isinstance(e, TrainStepFinished)]
    assert [e.critic_only for e in trained] == [True, False, False, False]
    assert trained[0].metrics.num_optimizer_steps == 0 and all(
        e.metrics.num_optimizer_steps for e in trained[1:]
    )
    assert all(e.metrics.num_optimizer_steps > 0 and e.metrics.train_tokens > 0 for e in critic)
    # The critic's values reach the policy's trainer, which hands them back.
    released = {e.ref.key for e in log if isinstance(e, DataReleased)}
    assert {e.values.key for e in critic} <= released
    # Every rollout is published (the seed's update_weights after every step), critic-only too.
    assert published_versions(log) == ["1", "2", "3", "4", "5"]


def test_a_critic_only_step_leaves_the_policy_as_it_was_and_the_critic_starts_at_zero(ppo_runs):
    log = events(ppo_runs / "whole")
    digests = [e.digest for e in log if isinstance(e, WeightsStaged)]
    # v1 (the initial) and v2 (after the critic-only rollout 0) are the same weights; v3 not.
    assert digests[0] == digests[1] != digests[2]
    # Built from the policy: its decoder, and a value head of zeros.
    base = ppo_runs / "whole" / "base_model"
    critic = load_value_model(str(base), "float32", torch.device("cpu"))
    policy = load_model(base)
    assert all(p.abs().sum() == 0 for p in critic.score.parameters())
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, policy.model.state_dict()[name]), name


def test_every_checkpoint_holds_the_critic_as_a_value_model_transformers_loads(ppo_runs):
    from transformers import AutoModelForTokenClassification

    checkpoint = latest_checkpoint(ppo_runs / "whole")
    model = AutoModelForTokenClassification.from_pretrained(checkpoint / "critic")
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config.num_labels == 1
    critic = read_critic(checkpoint)
    assert critic.num_optimizer_steps > 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, critic.weights[name]), name
    assert model.score.weight.abs().sum() > 0, "the value head has learnt"


def test_a_resumed_ppo_run_continues_exactly_policy_and_critic(ppo_runs):
    whole_log, split_log = events(ppo_runs / "whole"), events(ppo_runs / "split")
    starts = [e for e in split_log if isinstance(e, RunStarted)]
    assert [(s.start_rollout_id, s.resumed) for s in starts] == [(0, False), (2, True)]
    assert rollouts(split_log) == rollouts(whole_log)
    a, b = latest_checkpoint(ppo_runs / "whole"), latest_checkpoint(ppo_runs / "split")
    for name, tensor in read_checkpoint(a).weights.items():
        assert torch.equal(tensor, read_checkpoint(b).weights[name]), name
    critic_a, critic_b = read_critic(a), read_critic(b)
    assert critic_a.num_optimizer_steps == critic_b.num_optimizer_steps
    for name, tensor in critic_a.weights.items():
        assert torch.equal(tensor, critic_b.weights[name]), name
    values = lambda log: [e.metrics for e in log if isinstance(e, CriticStepFinished)]  # noqa: E731
    assert values(split_log) == values(whole_log)


def test_rollout_only_refuses_a_critic_with_the_seeds_message(tmp_path):
    result = run_cli(
        tmp_path / "run",
        *PPO,
        "run.rollout_only_from_checkpoint=true",
        f'run.load="{tmp_path}"',
        f'run.rollout_only_publication_evidence="{tmp_path / "evidence.json"}"',
        flags=("--dry-run",),
    )
    assert result.returncode == 2
    assert "checkpoint-backed rollout-only mode cannot use external sync or a critic" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_critic_of_two_ranks_on_ray_in_its_own_placement_group(tmp_path):
    result = run_cli(
        tmp_path,
        'run.runtime="ray"',
        "trainer.use_critic=true",
        "trainer.critic_num_ranks=2",
        "run.num_rollout=2",
        "run.save_interval=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(tmp_path)
    critic = [e for e in log if isinstance(e, CriticStepFinished)]
    assert [e.rollout_id for e in critic] == [0, 1]
    assert all([r.rank for r in e.ranks] == [0, 1] and len({r.pid for r in e.ranks}) == 2 for e in critic)
    trained = [e for e in log if isinstance(e, TrainStepFinished)]
    assert all(len(e.ranks) <= 1 for e in trained), "the policy keeps its own single rank"
    assert {r.pid for e in critic for r in e.ranks}.isdisjoint({r.pid for e in trained for r in e.ranks})
    assert read_critic(latest_checkpoint(tmp_path)).num_optimizer_steps == 4  # 2 rollouts of 2 steps
    assert "vloss" in result.stdout and "critic" in result.stdout


def test_a_critic_starts_from_run_critic_load(ppo_runs, tmp_path):
    source = latest_checkpoint(ppo_runs / "whole")
    # A learning rate too small to move it: the saved critic is the loaded one.
    result = run_cli(
        tmp_path,
        *PPO,
        f'run.critic_load="{ppo_runs / "whole" / "checkpoints"}"',
        "trainer.critic_lr=1e-12",
        "run.num_rollout=1",
        "run.save_interval=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded, saved = read_critic(source), read_critic(latest_checkpoint(tmp_path))
    assert loaded.weights["score.weight"].abs().sum() > 0
    for name, tensor in loaded.weights.items():
        torch.testing.assert_close(saved.weights[name], tensor, rtol=0, atol=1e-6)
    # Its optimizer steps go on from the loaded critic's.
    assert saved.num_optimizer_steps == loaded.num_optimizer_steps + 2


def test_run_critic_load_without_a_critic_in_the_checkpoint_is_one_line(tmp_path):
    grpo = run_cli(tmp_path / "grpo", 'run.runtime="local"', "run.num_rollout=1", "run.save_interval=1")
    assert grpo.returncode == 0, grpo.stderr[-2000:]
    result = run_cli(
        tmp_path / "ppo", *PPO, f'run.critic_load="{tmp_path / "grpo" / "checkpoints"}"', "run.num_rollout=1"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "run.critic_load: checkpoint" in result.stderr and "holds no critic" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
