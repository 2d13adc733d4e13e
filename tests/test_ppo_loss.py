"""PPO's pieces (``actors/trainer_backend/ppo.py``) against computations done by hand."""

from __future__ import annotations

import pytest
import torch

from actors.trainer_backend.ppo import gae, sample_advantages, token_rewards, value_loss, whiten


def close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_the_reward_sits_on_the_last_response_token_and_the_kl_penalty_on_every_token():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    rewards = torch.tensor([1.0, 0.5, 7.0])
    close(token_rewards(rewards, mask), [[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -1.0, -1.0], [0.0, 0.0, 0.0]])
    # -0.1 * (old - ref): 0.5 -> -0.05, 0 -> 0, -1 -> +0.1; padding stays 0.
    got = token_rewards(rewards, mask, old_logp=old, ref_logp=ref, kl_coef=0.1)
    close(got, [[-0.05, 0.0, 1.1], [0.05, 0.5, 0.0], [0.0, 0.0, 0.0]])


def test_gae_worked_by_hand():
    # Three tokens, reward 1 at the end, V = 0.5, 0.6, 0.7; gamma 1, lambda 0.95:
    # delta_2 = 1 + 0 - 0.7 = 0.3            A_2 = 0.3
    # delta_1 = 0 + 0.7 - 0.6 = 0.1          A_1 = 0.1 + 0.95 * 0.3 = 0.385
    # delta_0 = 0 + 0.6 - 0.5 = 0.1          A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    # returns = A + V = 0.96575, 0.985, 1.0.
    # The second sample has two tokens and padding: V after its last token is 0, gamma 1:
    # delta_1 = 2 - 0.4 = 1.6, delta_0 = 0 + 0.4 - 0.2 = 0.2, A_0 = 0.2 + 0.95 * 1.6 = 1.72.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 on padding: ignored
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lambd=0.95)
    close(advantages, [[0.46575, 0.385, 0.3], [1.72, 1.6, 0.0]])
    close(returns, [[0.96575, 0.985, 1.0], [1.92, 2.0, 0.0]])


def test_gae_with_discount_and_the_monte_carlo_and_td_ends():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.3, 0.5]])
    mask = torch.ones(1, 2)
    # gamma 0.9, lambda 0.5: delta_1 = 1 - 0.5 = 0.5; delta_0 = 0.9 * 0.5 - 0.3 = 0.15;
    # A_0 = 0.15 + 0.45 * 0.5 = 0.375.
    advantages, _ = gae(rewards, values, mask, gamma=0.9, lambd=0.5)
    close(advantages, [[0.375, 0.5]])
    # lambda 1, gamma 1: A_k = (sum of the rewards from k on) - V_k; the returns are the rewards to go.
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lambd=1.0)
    close(advantages, [[0.7, 0.5]])
    close(returns, [[1.0, 1.0]])
    # lambda 0: one-step TD errors.
    advantages, _ = gae(rewards, values, mask, gamma=1.0, lambd=0.0)
    close(advantages, [[0.2, 0.5]])


def test_whitening_uses_only_the_real_tokens():
    values = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # mean 3, population std sqrt(8/3).
    std = (8.0 / 3.0) ** 0.5
    close(whiten(values, mask), [[-2 / std, 0.0], [2 / std, 0.0]])


def test_the_value_loss_is_clipped_around_the_old_values_worked_by_hand():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.1]])
    returns = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    # token 0: unclipped (1 - 0)^2 = 1; V_clip = 0.5 + 0.2 = 0.7 -> 0.49; max 1 (not clipped).
    # token 1: unclipped (0 - 1)^2 = 1; V_clip = 0.1 - 0.1 = 0.0 -> 1 (equal: not clipped).
    terms = value_loss(values, old, returns, mask, value_clip=0.2)
    assert terms.loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    assert terms.clipfrac.item() == 0.0
    # token 0 moving the wrong way past the clip: V = 0.9 from old 0.5, return 1.5:
    # unclipped 0.36, V_clip = 0.7 -> 0.64: the clipped error counts and its gradient is 0.
    values = torch.tensor([[0.9]], requires_grad=True)
    terms = value_loss(values, torch.tensor([[0.5]]), torch.tensor([[1.5]]), torch.ones(1, 1), value_clip=0.2)
    assert terms.loss.item() == pytest.approx(0.5 * 0.64) and terms.clipfrac.item() == 1.0
    terms.loss.backward()
    assert values.grad is not None and values.grad.item() == 0.0
    # Without clipping: 0.5 * 0.36, gradient (V - R) = -0.6.
    values = torch.tensor([[0.9]], requires_grad=True)
    terms = value_loss(
        values, torch.tensor([[0.5]]), torch.tensor([[1.5]]), torch.ones(1, 1), value_clip=None
    )
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(0.18) and values.grad.item() == pytest.approx(-0.6)


def test_the_value_loss_of_micro_batches_adds_up_to_the_whole_steps():
    torch.manual_seed(0)
    values, old, returns = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    whole = value_loss(values, old, returns, mask, value_clip=0.2).loss
    tokens = float(mask.sum())
    parts = sum(
        value_loss(values[i : i + 2], old[i : i + 2], returns[i : i + 2], mask[i : i + 2], value_clip=0.2,
                   num_tokens=tokens).loss
        for i in (0, 2)
    )  # fmt: skip
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_each_samples_advantages_are_its_gae_whitened_over_the_rollout():
    rewards = [1.0, 0.0]
    values = [[0.5, 0.6, 0.7], [0.2]]
    raw = sample_advantages(rewards, values, gamma=1.0, lambd=0.95, normalize=False)
    # The first as in test_gae_worked_by_hand; the second: 0 - 0.2.
    assert raw[0] == pytest.approx([0.46575, 0.385, 0.3]) and raw[1] == pytest.approx([-0.2])
    whitened = sample_advantages(rewards, values, gamma=1.0, lambd=0.95, normalize=True)
    flat = torch.tensor([a for row in whitened for a in row])
    assert [len(row) for row in whitened] == [3, 1]
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6) and flat.std(
        unbiased=False
    ).item() == pytest.approx(1.0, rel=1e-5)
    assert sample_advantages([], [], gamma=1.0, lambd=1.0, normalize=True) == []
