"""Picking tokens from logits: the sampling rule every embedded decode loop shares."""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's ``>>`` carries the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def sample_uniforms(seeds: list[int], steps: int) -> torch.Tensor:
    """``[len(seeds), steps]`` float32 U[0, 1) draws: row ``i`` is the stream of seed
    ``seeds[i]`` (SplitMix64, one value per decode step), so a sample draws the same numbers
    whatever engine, batch or chunk it is decoded in."""
    seed = torch.tensor(seeds, dtype=torch.int64).unsqueeze(1)
    z = seed + (torch.arange(1, steps + 1, dtype=torch.int64).unsqueeze(0) * _GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _MIX_1
    z = (z ^ _shift_right(z, 27)) * _MIX_2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).to(torch.float32) / float(1 << 24)


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
