"""GRPO math as pure functions on tensors.

Conventions shared by every function here:

- Token tensors are *response-aligned*: shape ``[batch, max_response_len]``, column ``k`` is
  the ``k``-th response token of a sample, and ``mask`` (same shape, 1.0 for real tokens,
  0.0 for padding) says which entries exist.
- Aggregation is a token-level mean over every response token of the optimizer step
  (DAPO's and slime's default): a long response weighs more than a short one, and no
  sample-level mean dilutes the signal of long responses. Terms are *sums* divided by
  ``num_tokens`` so that a step split into micro-batches, each divided by the whole
  step's token count, adds up to exactly the loss of the undivided step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

KLType = Literal["k1", "k3"]

# Bound on |ref_logp - logp| inside k3: exp() of a larger log-ratio overflows in half
# precision and makes one token dominate the whole batch's KL in full precision.
K3_LOG_RATIO_BOUND = 20.0


def group_advantages(
    rewards: Tensor, groups: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sample GRPO advantages: ``(r - mean_g) / (std_g + eps)`` within each group ``g``.

    ``std_g`` is the *sample* standard deviation (Bessel-corrected, ``torch.std``'s
    default, as GRPO implementations in TRL and slime use). A group of one sample has no
    spread: its advantage is 0. With ``normalize_std=False`` (Dr.GRPO) the advantage is
    ``r - mean_g``.
    """
    rewards = rewards.to(torch.float32)
    advantages = torch.zeros_like(rewards)
    for group in torch.unique(groups):
        members = groups == group
        group_rewards = rewards[members]
        centered = group_rewards - group_rewards.mean()
        if normalize_std:
            std = group_rewards.std() if group_rewards.numel() > 1 else group_rewards.new_zeros(())
            centered = centered / (std + eps)
        advantages[members] = centered
    return advantages


def expand_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every response token of a sample its sample's advantage (0 on padding)."""
    return advantages.unsqueeze(-1).to(mask.dtype) * mask


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """Log-probability of ``targets`` under ``softmax(logits)`` (temperature 1), in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the token distribution at every position, in nats, in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1)


LOGPROB_CHUNK_ELEMENTS = 1 << 24
"""Logits a fused pass converts to float32 at once (64 MiB): bounds its temporary memory."""


class _FusedLogprobsEntropy(torch.autograd.Function):
    """Target log-probabilities and entropies from one log-sum-exp per position.

    Forward keeps only the logits it was given (which the graph holds anyway) and one
    float32 log-sum-exp and entropy per position, never the ``[positions, vocab]``
    log-softmax that ``token_logprobs`` and ``entropy_from_logits`` each build and keep for
    their backward; backward recomputes the softmax chunk by chunk. Both gradients in one pass:
    ``d logp_t / dz = onehot(t) - p`` and ``d H / dz = -p * (log p + H)``.
    """

    # ``ctx`` is autograd's context object, which takes whatever attributes it is given.
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
        rows = flat.shape[0]
        logsumexp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        entropy = torch.zeros(rows if with_entropy else 0, dtype=torch.float32, device=logits.device)
        chunk = max(1, LOGPROB_CHUNK_ELEMENTS // max(vocab, 1))
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            z = flat[part].float()
            lse = torch.logsumexp(z, dim=-1)
            logsumexp[part] = lse
            logp[part] = z.gather(-1, flat_targets[part].unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:
                entropy[part] = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        ctx.save_for_backward(logits, targets, logsumexp, entropy)
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        shape = targets.shape
        return logp.reshape(shape), entropy.reshape(shape) if with_entropy else entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor, None, None]:
        logits, targets, logsumexp, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        vocab = logits.shape[-1]
        flat, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
        g_logp = None if grad_logp is None else grad_logp.reshape(-1).float()
        g_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        grad = torch.empty_like(flat)
        chunk = max(1, LOGPROB_CHUNK_ELEMENTS // max(vocab, 1))
        for start in range(0, flat.shape[0], chunk):
            part = slice(start, start + chunk)
            logprobs = flat[part].float() - logsumexp[part].unsqueeze(-1)
            probs = logprobs.exp()
            g = torch.zeros_like(logprobs)
            if g_logp is not None:
                g -= probs * g_logp[part].unsqueeze(-1)
                g.scatter_add_(-1, flat_targets[part].unsqueeze(-1), g_logp[part].unsqueeze(-1))
            if g_entropy is not None:
                g -= probs * (logprobs + entropy[part].unsqueeze(-1)) * g_entropy[part].unsqueeze(-1)
            grad[part] = g.to(grad.dtype)
        return grad.reshape(logits.shape), None, None


def logprobs_and_entropy(
    logits: Tensor, targets: Tensor, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs(logits, targets)`` and (with ``with_entropy``) ``entropy_from_logits(logits)``
    in one fused pass, in float32, with gradients for both and a fraction of their memory."""
    # ``Function.apply`` is unannotated in torch; it takes and returns what ``forward`` does.
    fused: Callable[[Tensor, Tensor, bool], tuple[Tensor, Tensor]] = _FusedLogprobsEntropy.apply
    logp, entropy = fused(logits, targets, with_entropy)
    return logp, entropy if with_entropy else None


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLType = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k3).

    k1 = logp - ref_logp is unbiased but can be negative; k3 = exp(ref - logp) - (ref - logp)
    - 1 is unbiased, always >= 0, and lower-variance.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        log_ratio = (ref_logp - logp).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; known: k1, k3")


def ppo_clip_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float | None = None
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, as a loss (to minimise), and where clipping bit.

    ``ratio = exp(logp - old_logp)``; the loss is ``max(-A * ratio, -A * clip(ratio, 1 - eps_clip,
    1 + eps_clip_high))``. The second tensor is 1.0 where the clipped term is the larger one
    (the token's gradient is cut), else 0.0.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(logp.dtype)


@dataclass(frozen=True)
class LossTerms:
    """The policy loss of one (micro-)batch and its parts, each a sum over tokens / num_tokens.

    ``loss`` carries the gradient; the other terms are detached, for logging.
    """

    loss: Tensor
    pg_loss: Tensor
    kl: Tensor
    entropy: Tensor
    clipfrac: Tensor


def truncated_importance(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> Tensor:
    """``min(exp(old_logp - rollout_logp), cap)`` per token, without gradient: how much more
    likely the policy before the step makes a token than the one that sampled it, cut at
    ``cap`` (truncated importance sampling)."""
    return torch.exp((old_logp - rollout_logp).detach()).clamp(max=cap)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k3",
    num_tokens: float | None = None,
    importance: Tensor | None = None,
) -> LossTerms:
    """GRPO loss: ``pg_loss + kl_coef * kl - entropy_coef * entropy``.

    All inputs are response-aligned ``[batch, max_response_len]`` tensors; ``advantages``
    is per token (see ``expand_advantages``). ``num_tokens`` is the denominator of the
    token-level mean, by default the tokens of this batch; pass the token count of the
    whole optimizer step when this batch is one micro-batch of it. ``kl`` is reported
    whenever ``ref_logp`` is given and enters the loss with ``kl_coef``. ``importance``
    (no gradient) weighs each token's policy-gradient term (decoupled PPO's correction for
    tokens sampled by an older policy).
    """
    mask = mask.to(logp.dtype)
    denominator = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
    denominator = max(denominator, 1.0)

    def token_mean(values: Tensor) -> Tensor:
        return (values * mask).sum() / denominator

    token_loss, clipped = ppo_clip_token_loss(logp, old_logp, advantages, eps_clip, eps_clip_high)
    if importance is not None:
        token_loss = token_loss * importance.detach()
    pg_loss = token_mean(token_loss)
    loss = pg_loss
    kl = logp.new_zeros(())
    if ref_logp is not None:
        kl = token_mean(kl_estimate(logp, ref_logp, kl_type))
        if kl_coef:
            loss = loss + kl_coef * kl
    mean_entropy = logp.new_zeros(())
    if entropy is not None:
        mean_entropy = token_mean(entropy)
        if entropy_coef:
            loss = loss - entropy_coef * mean_entropy
    return LossTerms(
        loss=loss,
        pg_loss=pg_loss.detach(),
        kl=kl.detach(),
        entropy=mean_entropy.detach(),
        clipfrac=token_mean(clipped).detach(),
    )
