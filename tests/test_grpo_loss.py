"""GRPO math checked against hand computations on small explicit tensors."""

from __future__ import annotations

import math

import pytest
import torch

from actors.trainer_backend import grpo
from actors.trainer_backend.grpo import (
    entropy_from_logits,
    expand_advantages,
    group_advantages,
    kl_estimate,
    logprobs_and_entropy,
    policy_loss,
    ppo_clip_token_loss,
    token_logprobs,
)

EPS = 1e-6


def close(actual: torch.Tensor | float, expected: float, tol: float = 1e-6) -> bool:
    value = float(actual.detach()) if isinstance(actual, torch.Tensor) else float(actual)
    return abs(value - expected) <= tol


# --- advantages ------------------------------------------------------------------------------


def test_advantages_are_normalised_within_each_group() -> None:
    # Groups interleaved on purpose: membership, not position, defines a group.
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0])
    groups = torch.tensor([0, 1, 0, 1, 0])
    advantages = group_advantages(rewards, groups)
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # sample std of [1, 0, 0]
    std1 = math.sqrt(((2 - 3) ** 2 + (4 - 3) ** 2) / 1)  # sample std of [2, 4]
    expected = [
        (2 / 3) / (std0 + EPS),
        -1 / (std1 + EPS),
        (-1 / 3) / (std0 + EPS),
        1 / (std1 + EPS),
        (-1 / 3) / (std0 + EPS),
    ]
    assert all(close(a, e) for a, e in zip(advantages.tolist(), expected, strict=True))


def test_advantages_divide_by_the_sample_std_not_the_population_std() -> None:
    advantages = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([7, 7]))
    # Population std would be 0.5 (advantages +-1); sample std is 1/sqrt(2).
    assert close(advantages[1], 0.5 / (1 / math.sqrt(2) + EPS))
    assert close(advantages[0], -0.5 / (1 / math.sqrt(2) + EPS))


def test_advantages_without_std_normalisation_are_centered_rewards() -> None:
    advantages = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 3.0]), torch.tensor([0, 0, 1, 1]), normalize_std=False
    )
    assert advantages.tolist() == [0.5, -0.5, -1.5, 1.5]


def test_a_group_with_identical_rewards_has_zero_advantage() -> None:
    advantages = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert advantages.tolist() == [0.0, 0.0, 0.0]


def test_a_group_of_one_sample_has_zero_advantage() -> None:
    advantages = group_advantages(torch.tensor([5.0, 1.0, 0.0]), torch.tensor([0, 1, 1]))
    assert advantages[0].item() == 0.0
    assert not torch.isnan(advantages).any()


def test_every_response_token_gets_its_sample_advantage() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tokens = expand_advantages(torch.tensor([0.5, -2.0]), mask)
    assert tokens.tolist() == [[0.5, 0.5, 0.5], [-2.0, 0.0, 0.0]]


# --- PPO clip ----------------------------------------------------------------------------------


def test_ratio_inside_the_clip_range_gives_the_unclipped_loss() -> None:
    logp, old = torch.tensor([-1.0]), torch.tensor([-1.1])
    loss, clipped = ppo_clip_token_loss(logp, old, torch.tensor([2.0]), eps_clip=0.2)
    assert close(loss[0], -2.0 * math.exp(0.1))
    assert clipped.tolist() == [0.0]


def test_ratio_above_the_clip_range_with_positive_advantage_has_zero_gradient() -> None:
    logp = torch.tensor([-0.5], requires_grad=True)
    loss, clipped = ppo_clip_token_loss(logp, torch.tensor([-1.0]), torch.tensor([1.0]), eps_clip=0.2)
    loss.sum().backward()
    assert close(loss[0], -1.2)
    assert logp.grad is not None and logp.grad.item() == 0.0
    assert clipped.tolist() == [1.0]


def test_ratio_below_the_clip_range_with_negative_advantage_has_zero_gradient() -> None:
    logp = torch.tensor([-1.5], requires_grad=True)
    loss, clipped = ppo_clip_token_loss(logp, torch.tensor([-1.0]), torch.tensor([-1.0]), eps_clip=0.2)
    loss.sum().backward()
    assert close(loss[0], 0.8)
    assert logp.grad is not None and logp.grad.item() == 0.0
    assert clipped.tolist() == [1.0]


def test_ratio_above_the_clip_range_with_negative_advantage_keeps_its_gradient() -> None:
    # The pessimistic bound: a bad action made more likely is never clipped away.
    logp = torch.tensor([-0.5], requires_grad=True)
    loss, clipped = ppo_clip_token_loss(logp, torch.tensor([-1.0]), torch.tensor([-1.0]), eps_clip=0.2)
    loss.sum().backward()
    ratio = math.exp(0.5)
    assert close(loss[0], ratio)
    assert logp.grad is not None and close(logp.grad.item(), ratio)
    assert clipped.tolist() == [0.0]


def test_clip_higher_moves_only_the_upper_bound() -> None:
    logp, old, advantage = (
        torch.tensor([0.0, 0.0]),
        torch.tensor([-math.log(1.25), math.log(1.3)]),
        torch.tensor([1.0, -1.0]),
    )
    loss, _ = ppo_clip_token_loss(logp, old, advantage, eps_clip=0.2, eps_clip_high=0.28)
    assert close(loss[0], -1.25)  # inside [0.8, 1.28]: unclipped
    assert close(loss[1], 0.8)  # the lower bound is still 1 - eps_clip
    symmetric, _ = ppo_clip_token_loss(logp, old, advantage, eps_clip=0.2)
    assert close(symmetric[0], -1.2)


# --- KL, entropy, logprobs ---------------------------------------------------------------------


def test_k1_is_the_log_ratio_of_policy_to_reference() -> None:
    kl = kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), "k1")
    assert close(kl[0], 0.5) and close(kl[1], -1.0)


def test_k3_matches_its_formula() -> None:
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    kl = kl_estimate(logp, ref, "k3")
    for value, d in zip(kl.tolist(), [-0.5, 1.0], strict=True):
        assert close(value, math.exp(d) - d - 1)


def test_k3_is_zero_where_policy_and_reference_agree() -> None:
    assert kl_estimate(torch.tensor([-0.7]), torch.tensor([-0.7]), "k3").item() == 0.0


def test_unknown_kl_estimator_is_an_error() -> None:
    with pytest.raises(ValueError, match="k2"):
        kl_estimate(torch.tensor([0.0]), torch.tensor([0.0]), "k2")  # type: ignore[arg-type]


def test_entropy_of_uniform_logits_is_log_vocab_size() -> None:
    assert close(entropy_from_logits(torch.zeros(1, 5))[0], math.log(5))


def test_entropy_of_an_explicit_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert close(entropy_from_logits(logits)[0], -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))


def test_token_logprobs_are_log_softmax_at_the_target() -> None:
    logits = torch.tensor([[0.0, math.log(2.0)], [0.0, math.log(2.0)]])
    logp = token_logprobs(logits, torch.tensor([0, 1]))
    assert close(logp[0], math.log(1 / 3)) and close(logp[1], math.log(2 / 3))


@pytest.mark.parametrize("chunk_elements", [1 << 24, 7])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 0.0), (0.0, 1.0)], ids=["both", "logp", "entropy"])
def test_the_fused_pass_gives_the_reference_values_and_gradients(
    monkeypatch: pytest.MonkeyPatch, chunk_elements: int, weights: tuple[float, float]
) -> None:
    # chunk_elements=7 cuts a [2, 3, 5] tensor into one row per chunk: chunking changes nothing.
    monkeypatch.setattr(grpo, "LOGPROB_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 3, 5, generator=generator)).requires_grad_()
    targets = torch.randint(0, 5, (2, 3), generator=generator)
    w_logp, w_entropy = torch.randn(2, 3, generator=generator), torch.randn(2, 3, generator=generator)

    def gradient(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        loss = weights[0] * (logp * w_logp).sum() + weights[1] * (entropy * w_entropy).sum()
        (grad,) = torch.autograd.grad(loss, logits)
        return grad

    logp, entropy = logprobs_and_entropy(logits, targets)
    assert entropy is not None
    expected_logp, expected_entropy = token_logprobs(logits, targets), entropy_from_logits(logits)
    assert torch.allclose(logp, expected_logp, atol=1e-6) and torch.allclose(
        entropy, expected_entropy, atol=1e-6
    )
    assert torch.allclose(gradient(logp, entropy), gradient(expected_logp, expected_entropy), atol=1e-6)


def test_the_fused_pass_without_entropy_returns_none_and_the_logprob_gradient() -> None:
    logits = torch.randn(4, 6, requires_grad=True)
    targets = torch.tensor([0, 5, 2, 2])
    logp, entropy = logprobs_and_entropy(logits, targets, with_entropy=False)
    assert entropy is None
    (fused,) = torch.autograd.grad(logp.sum(), logits)
    (reference,) = torch.autograd.grad(token_logprobs(logits, targets).sum(), logits)
    assert torch.allclose(fused, reference, atol=1e-6)


def test_the_fused_pass_keeps_no_vocab_sized_float32_copy_of_bfloat16_logits() -> None:
    logits = torch.randn(8, 1000, dtype=torch.bfloat16, requires_grad=True)
    logp, entropy = logprobs_and_entropy(logits, torch.zeros(8, dtype=torch.long))
    assert entropy is not None
    saved = logp.grad_fn.saved_tensors  # type: ignore[union-attr]
    assert all(t.numel() < logits.numel() or t.dtype == torch.bfloat16 for t in saved)
    (grad,) = torch.autograd.grad((logp + entropy).sum(), logits)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()


# --- the full loss ---------------------------------------------------------------------------


def two_sample_batch() -> dict[str, torch.Tensor]:
    # Sample 0 has two response tokens, sample 1 one (its second column is padding, filled
    # with values that would change the result if they leaked in).
    return {
        "logp": torch.tensor([[-1.0, -0.5], [-2.0, 9.0]]),
        "old_logp": torch.tensor([[-1.1, -0.2], [-1.6, -9.0]]),
        "ref_logp": torch.tensor([[-0.9, -0.7], [-1.5, 9.0]]),
        "entropy": torch.tensor([[1.2, 0.7], [0.3, 50.0]]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    }


def test_full_loss_on_two_samples_matches_a_hand_computation() -> None:
    b = two_sample_batch()
    advantages = torch.tensor([0.8, -0.6])
    terms = policy_loss(
        b["logp"], b["old_logp"], expand_advantages(advantages, b["mask"]), b["mask"],
        eps_clip=0.2, eps_clip_high=0.28, entropy=b["entropy"], entropy_coef=0.01,
        ref_logp=b["ref_logp"], kl_coef=0.1, kl_type="k3",
    )  # fmt: skip
    tokens = [(-1.0, -1.1, -0.9, 1.2, 0.8), (-0.5, -0.2, -0.7, 0.7, 0.8), (-2.0, -1.6, -1.5, 0.3, -0.6)]
    pg, kl, entropy, clipped = 0.0, 0.0, 0.0, 0
    for logp, old, ref, ent, adv in tokens:
        ratio = math.exp(logp - old)
        unclipped, clipped_term = -adv * ratio, -adv * min(max(ratio, 0.8), 1.28)
        pg += max(unclipped, clipped_term)
        clipped += clipped_term > unclipped
        kl += math.exp(ref - logp) - (ref - logp) - 1
        entropy += ent
    pg, kl, entropy = pg / 3, kl / 3, entropy / 3
    assert close(terms.pg_loss, pg)
    assert close(terms.kl, kl)
    assert close(terms.entropy, entropy)
    assert close(terms.clipfrac, clipped / 3) and clipped == 1
    assert close(terms.loss, pg + 0.1 * kl - 0.01 * entropy)


def test_loss_is_a_token_level_mean_over_the_batch() -> None:
    # Per-token losses -A * 1 = [1, 1, -2]: the token mean is 0, a per-sample mean would be -0.5.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.zeros(2, 2)
    terms = policy_loss(logp, logp, expand_advantages(torch.tensor([-1.0, 2.0]), mask), mask, eps_clip=0.2)
    assert close(terms.loss, 0.0)


def test_micro_batch_losses_over_the_step_token_count_add_up_to_the_batch_loss() -> None:
    b = two_sample_batch()
    advantages = expand_advantages(torch.tensor([0.8, -0.6]), b["mask"])
    kwargs = {"eps_clip": 0.2, "ref_logp": None}
    whole = policy_loss(b["logp"], b["old_logp"], advantages, b["mask"], **kwargs)
    parts = [
        policy_loss(
            b["logp"][i : i + 1],
            b["old_logp"][i : i + 1],
            advantages[i : i + 1],
            b["mask"][i : i + 1],
            num_tokens=3,
            **kwargs,
        )
        for i in range(2)
    ]
    assert close(sum(p.loss for p in parts), float(whole.loss))


def test_kl_is_reported_but_not_added_when_its_coefficient_is_zero() -> None:
    b = two_sample_batch()
    advantages = expand_advantages(torch.tensor([0.8, -0.6]), b["mask"])
    with_ref = policy_loss(
        b["logp"], b["old_logp"], advantages, b["mask"], eps_clip=0.2, ref_logp=b["ref_logp"]
    )
    assert float(with_ref.kl) > 0
    assert close(with_ref.loss, float(with_ref.pg_loss))


def test_entropy_bonus_lowers_the_loss_and_pushes_entropy_up() -> None:
    logits = torch.zeros(1, 1, 3)
    logits[0, 0, 0] = 2.0
    logits.requires_grad_(True)
    mask = torch.ones(1, 1)
    logp = token_logprobs(logits, torch.tensor([[0]]))
    terms = policy_loss(
        logp,
        logp.detach(),
        torch.zeros(1, 1),
        mask,
        eps_clip=0.2,
        entropy=entropy_from_logits(logits),
        entropy_coef=0.5,
    )
    assert close(terms.loss, -0.5 * float(terms.entropy))
    terms.loss.backward()
    # Gradient descent lowers the dominant logit: the distribution flattens.
    assert logits.grad is not None and logits.grad[0, 0, 0].item() > 0


def test_truncated_importance_weights_tokens_by_the_policy_over_the_sampler_cut_at_the_cap():
    from actors.trainer_backend.grpo import truncated_importance

    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.0, -3.0, -0.1]])
    weights = truncated_importance(old, rollout, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, math.exp(-0.4)]]))
    assert not weights.requires_grad


def test_importance_weights_scale_each_tokens_policy_gradient_term():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    advantages, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    plain = policy_loss(logp, logp.detach(), advantages, mask, eps_clip=0.2)
    weighted = policy_loss(
        logp, logp.detach(), advantages, mask, eps_clip=0.2, importance=torch.tensor([[1.0, 0.0]])
    )
    assert weighted.pg_loss.item() == pytest.approx(plain.pg_loss.item() / 2)
