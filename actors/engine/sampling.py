"""Picking tokens from logits: the sampling rule every embedded decode loop shares."""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` ([rows, vocab]) and its log-probability.

    ``temperature == 0``: the argmax, with log-probabilities of the unscaled logits.
    Otherwise the token at ``uniform`` (one U[0, 1) per row) of the inverse CDF of the
    top-p-truncated distribution of ``logits / temperature``; its log-probability is taken
    from the untruncated tempered distribution.
    """
    if temperature == 0:
        logprobs_all = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        if uniform is None:
            raise ValueError("sampling at temperature > 0 needs one uniform draw per row")
        logprobs_all = torch.log_softmax(logits / temperature, dim=-1)
        probs = logprobs_all.exp()
        if top_p < 1.0:
            probs, order = probs.sort(dim=-1, descending=True)
            # Keep a token while the mass before it is below top_p: the smallest set that
            # reaches top_p, and always at least the most likely token.
            probs = probs * ((probs.cumsum(dim=-1) - probs) < top_p)
        else:
            order = None
        cdf = probs.cumsum(dim=-1)
        threshold = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
        picked = torch.searchsorted(cdf, threshold, right=True).clamp(max=cdf.shape[-1] - 1)
        tokens = (order.gather(-1, picked) if order is not None else picked).squeeze(-1)
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
