"""Rollout samples as the Generator hands them to the Trainer (through the data plane)."""

from __future__ import annotations

import msgspec


class VersionSpan(msgspec.Struct, frozen=True, array_like=True):
    """From response token ``start`` on (to the next span), the tokens were sampled with
    weight version ``weight_version``."""

    start: int
    weight_version: str


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    """Position of the prompt in the dataset (the data order is a pure function of the seed)."""
    group: int
    """Samples of one prompt share a group; GRPO normalises rewards within it."""
    prompt: str
    label: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    """Log-probability of each response token under the engine that sampled it."""
    response: str
    reward: float
    weight_version: str
    engine: str
    finish_reason: str
    """``"stop"`` (a stop token or string) or ``"length"`` (max new tokens)."""
    version_spans: list[VersionSpan] = []
    """The weight version of each response token, as spans in token order (the first starts
    at 0); empty: every token is of ``weight_version``."""
    loss_mask: list[int] = []
    """1 for each response token trained on, 0 for one left out (a stale token under
    ``run.staleness_policy = "mask"``); empty: every token."""
    advantages: list[float] = []
    """Each response token's advantage, where the trainer is given them (PPO with a critic:
    the GAE of the critic's values); empty: GRPO's group-normalised reward for every token."""


class RolloutBatch(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: int
    samples: list[Sample]


class CriticValues(msgspec.Struct, frozen=True, kw_only=True):
    """The critic's values of a rollout, as ``CriticStepFinished`` stages them: sample
    position (in the rollout's trainable samples) -> the value of the state in which each
    of its response tokens was chosen."""

    rollout_id: int
    values: dict[int, list[float]]
