"""The behavioural probe of a publication: a fixed batch of token sequences whose
log-probabilities the trainer computes with the weights it publishes and each engine with
what it serves after its load. Where an engine cannot fingerprint a tensor (vLLM on CPU
repacks its linear layers), the digests leave that tensor out; the probe is what proves it.

The batch is random token ids drawn from the run seed (``PROBE_SEQUENCES`` prompts of
``PROBE_PROMPT_TOKENS`` tokens, each followed by ``PROBE_RESPONSE_TOKENS`` response tokens
whose log-probabilities are compared), below the tokenizer's size so that every server
accepts them. Teacher-forced, so sampling plays no part: the same weights give the same
numbers up to float rounding, and a tensor that is wrong anywhere the batch passes through
moves them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

PROBE_TENSOR = "<behavioural probe>"
"""The name a probe miss goes by in a ``TensorMismatch`` (no tensor has it)."""
PROBE_SEQUENCES = 4
PROBE_PROMPT_TOKENS = 8
PROBE_RESPONSE_TOKENS = 8


DEFAULT_TOLERANCE = {"float32": 0.01}
"""``verifier.probe_tolerance`` when unset, by ``model.dtype``; 16-bit dtypes get
``HALF_PRECISION_TOLERANCE``."""
HALF_PRECISION_TOLERANCE = 0.1


def probe_tolerance(configured: float | None, dtype: str) -> float:
    """The tolerance a probe is held to: ``configured``, else the default for ``dtype``."""
    if configured is not None:
        return configured
    return DEFAULT_TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)


def probe_batch(vocab_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) of the run's probe batch, token ids in [0, vocab_size)."""
    if vocab_size < 2:
        raise ValueError(f"a probe needs a vocabulary of at least 2 tokens, got {vocab_size}")
    draw = random.Random(f"probe:{seed}")
    prompts = [
        [draw.randrange(vocab_size) for _ in range(PROBE_PROMPT_TOKENS)] for _ in range(PROBE_SEQUENCES)
    ]
    responses = [
        [draw.randrange(vocab_size) for _ in range(PROBE_RESPONSE_TOKENS)] for _ in range(PROBE_SEQUENCES)
    ]
    return prompts, responses


def max_difference(expected: Sequence[Sequence[float]], actual: Sequence[Sequence[float]]) -> float:
    """The largest |expected - actual| over every probe token; infinite when the shapes
    differ or a value is not finite."""
    if len(expected) != len(actual) or any(len(e) != len(a) for e, a in zip(expected, actual, strict=True)):
        return float("inf")
    worst = 0.0
    for row_e, row_a in zip(expected, actual, strict=True):
        for e, a in zip(row_e, row_a, strict=True):
            difference = abs(e - a)
            if not difference <= worst:  # NaN and inf included
                worst = difference if difference == difference else float("inf")
    return worst


def probe_vocab_size(model_path: str) -> int:
    """The token ids a probe may use for the model at ``model_path``: below both the model's
    vocabulary and its tokenizer's (a server refuses ids its tokenizer does not know)."""
    from miles_events.rl.hf_model import load_tokenizer

    model_vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    return min(model_vocab, len(load_tokenizer(model_path)))


def teacher_forced_logprobs(
    model: object, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
) -> list[list[float]]:
    """``model``'s log-probability of each response token after its prompt and the response
    tokens before it (a torch causal LM; no gradients, dropout off while it runs)."""
    import torch

    module: torch.nn.Module = model  # type: ignore[assignment]
    device = next(module.parameters()).device
    training = module.training
    module.eval()
    results: list[list[float]] = []
    try:
        with torch.no_grad():
            for prompt, response in zip(prompt_ids, response_ids, strict=True):
                ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long, device=device)
                logits = module(input_ids=ids).logits[0].float()
                logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
                picked = logprobs.gather(1, torch.tensor(list(response), device=device).unsqueeze(1))
                results.append([float(v) for v in picked.squeeze(1).tolist()])
    finally:
        module.train(training)
    return results
