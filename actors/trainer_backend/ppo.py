"""PPO with a value model (the critic): token rewards, GAE and the clipped value loss, as
pure functions on response-aligned tensors (the conventions of ``grpo``: ``[batch,
max_response_len]``, ``mask`` 1.0 on real response tokens, token-level means as sums
divided by the step's token count).

Positions: ``values[:, k]`` is the critic's value of the state in which the ``k``-th
response token is chosen (the prompt and the ``k - 1`` tokens before it), read at the
position whose logits predict that token. After the last response token the episode ends:
the next state's value is 0.

Rewards are the seed's (slime's PPO): the sequence's reward on its last response token and,
with ``kl_coef``, a per-token penalty ``-kl_coef * (old_logp - ref_logp)`` on every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def token_rewards(
    rewards: Tensor,
    mask: Tensor,
    *,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token rewards ``[batch, max_response_len]``: each sample's reward on its last
    response token, less ``kl_coef`` times the k1 estimate of KL(policy || reference) on
    every token (when ``kl_coef`` and both log-probabilities are given); 0 on padding."""
    mask = mask.to(torch.float32)
    out = torch.zeros_like(mask)
    if kl_coef and old_logp is not None and ref_logp is not None:
        out = -kl_coef * (old_logp.float() - ref_logp.float()) * mask
    lengths = mask.sum(dim=-1).long()
    has_tokens = lengths > 0
    rows = torch.arange(mask.shape[0])[has_tokens]
    out[rows, lengths[has_tokens] - 1] += rewards.to(torch.float32)[has_tokens]
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each response, backwards from its end.

    ``delta_k = r_k + gamma * V_{k+1} - V_k`` (``V`` after the last token is 0) and
    ``A_k = delta_k + gamma * lambd * A_{k+1}``; the returns (the critic's targets) are
    ``A_k + V_k``. Both are 0 on padding. Computed in float32 without gradients."""
    with torch.no_grad():
        mask = mask.to(torch.float32)
        rewards = rewards.float() * mask
        values = values.float() * mask
        length = mask.shape[-1]
        advantages = torch.zeros_like(values)
        running = torch.zeros(values.shape[0], dtype=torch.float32, device=values.device)
        for k in reversed(range(length)):
            next_value = values[:, k + 1] if k + 1 < length else torch.zeros_like(running)
            delta = rewards[:, k] + gamma * next_value - values[:, k]
            running = (delta + gamma * lambd * running) * mask[:, k]
            advantages[:, k] = running
        return advantages, (advantages + values) * mask


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over the real tokens (mean and population std of the
    masked entries; the seed's ``--normalize-advantages``); 0 on padding."""
    mask = mask.to(torch.float32)
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    variance = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) / (variance.sqrt() + eps) * mask


@dataclass(frozen=True)
class ValueLossTerms:
    """The value loss of one (micro-)batch and what it is made of (detached but ``loss``)."""

    loss: Tensor
    clipfrac: Tensor
    """Share of tokens whose clipped error was the larger (their gradient is cut)."""
    value_mean: Tensor
    return_mean: Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float | None,
    num_tokens: float | None = None,
) -> ValueLossTerms:
    """PPO's clipped value loss: ``0.5 * max((V - R)^2, (V_clip - R)^2)`` per token with
    ``V_clip = V_old + clip(V - V_old, -value_clip, value_clip)`` (no clipping when
    ``value_clip`` is None), averaged over ``num_tokens`` (default: this batch's tokens)."""
    mask = mask.to(values.dtype)
    denominator = max(float(mask.sum().item()) if num_tokens is None else float(num_tokens), 1.0)

    def token_mean(x: Tensor) -> Tensor:
        return (x * mask).sum() / denominator

    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token, clipped = unclipped, torch.zeros_like(unclipped)
    else:
        bounded = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_error = (bounded - returns) ** 2
        per_token = torch.maximum(unclipped, clipped_error)
        clipped = (clipped_error > unclipped).to(values.dtype)
    return ValueLossTerms(
        loss=0.5 * token_mean(per_token),
        clipfrac=token_mean(clipped).detach(),
        value_mean=token_mean(values).detach(),
        return_mean=token_mean(returns).detach(),
    )


def sample_advantages(
    rewards: list[float],
    values: list[list[float]],
    *,
    gamma: float,
    lambd: float,
    normalize: bool,
) -> list[list[float]]:
    """Each sample's per-token GAE advantages from its reward (on its last token) and the
    critic's values of its tokens; with ``normalize`` whitened over every token of the
    samples together (the rollout)."""
    if not values:
        return []
    width = max((len(v) for v in values), default=0)
    lengths = torch.tensor([len(v) for v in values])
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32)
    padded = torch.zeros(len(values), width)
    for row, row_values in enumerate(values):
        padded[row, : len(row_values)] = torch.tensor(row_values, dtype=torch.float32)
    advantages, _ = gae(token_rewards(torch.tensor(rewards), mask), padded, mask, gamma, lambd)
    if normalize:
        advantages = whiten(advantages, mask)
    return [advantages[row, : len(v)].tolist() for row, v in enumerate(values)]
