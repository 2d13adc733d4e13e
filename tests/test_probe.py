"""The behavioural probe's pieces: a batch fixed by the run seed, the difference measure,
and the trainer's and an engine's halves agreeing on the same weights."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from actors.engine.torch_engine import TorchEngine
from miles_events.rl.hf_model import load_model
from miles_events.rl.probe import (
    PROBE_PROMPT_TOKENS,
    PROBE_RESPONSE_TOKENS,
    PROBE_SEQUENCES,
    max_difference,
    probe_batch,
    probe_vocab_size,
    teacher_forced_logprobs,
)


def test_the_probe_batch_is_fixed_by_the_seed_and_inside_the_vocabulary():
    prompts, responses = probe_batch(50, seed=3)
    assert (prompts, responses) == probe_batch(50, seed=3)
    assert probe_batch(50, seed=4) != (prompts, responses)
    assert len(prompts) == len(responses) == PROBE_SEQUENCES
    assert all(len(p) == PROBE_PROMPT_TOKENS for p in prompts) and all(
        len(r) == PROBE_RESPONSE_TOKENS for r in responses
    )
    assert all(0 <= t < 50 for row in prompts + responses for t in row)


def test_the_difference_is_the_largest_and_anything_malformed_is_infinite():
    assert max_difference([[-1.0, -2.0]], [[-1.0, -2.25]]) == 0.25
    assert max_difference([[-1.0]], [[float("nan")]]) == math.inf
    assert max_difference([[-1.0]], [[-1.0], [-2.0]]) == math.inf
    assert max_difference([[-1.0, -2.0]], [[-1.0]]) == math.inf


@pytest.fixture(scope="module")
def model_dir(built_in_model: Callable[[int], Path]) -> Path:
    return built_in_model(5)


def test_the_engine_and_the_trainer_agree_on_the_same_weights_and_not_on_others(model_dir: Path):
    prompts, responses = probe_batch(probe_vocab_size(str(model_dir)), seed=1)
    trainer_model = load_model(model_dir).train()
    engine = TorchEngine.from_pretrained(model_dir)
    expected = teacher_forced_logprobs(trainer_model, prompts, responses)
    assert max_difference(expected, engine.probe_logprobs(prompts, responses)) < 1e-6
    assert trainer_model.training, "the trainer's model is left in training mode"
    with torch.no_grad():
        engine.model.get_parameter("model.layers.0.mlp.down_proj.weight").mul_(-1.0)
    assert max_difference(expected, engine.probe_logprobs(prompts, responses)) > 0.01


def test_the_logprobs_are_those_of_the_full_forward(model_dir: Path):
    model = load_model(model_dir).eval()
    prompts, responses = probe_batch(probe_vocab_size(str(model_dir)), seed=2)
    (row,) = teacher_forced_logprobs(model, prompts[:1], responses[:1])
    ids = torch.tensor([prompts[0] + responses[0]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompts[0])
    assert row == pytest.approx(
        [logprobs[start - 1 + i, t].item() for i, t in enumerate(responses[0])], abs=1e-6
    )


def test_the_default_tolerance_follows_the_dtype_and_a_setting_wins():
    from miles_events.rl.probe import probe_tolerance

    assert probe_tolerance(None, "float32") == 0.01
    assert probe_tolerance(None, "bfloat16") == probe_tolerance(None, "float16") == 0.1
    assert probe_tolerance(0.5, "float32") == 0.5
