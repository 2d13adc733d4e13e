"""How old each sampled token is, and what training does with tokens past the bound.

A token's staleness is the trainer's weight version when it trains on the token minus the
version the token was sampled with (``Sample.version_spans``): 0 in the synchronous loop,
at most ``run.max_staleness`` in an asynchronous one.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from miles_events.rl.versions import version_number
from schemas.rollout import RolloutBatch, Sample


def token_versions(sample: Sample) -> list[int]:
    """The weight version number of each response token of ``sample``."""
    count = len(sample.response_ids)
    if not sample.version_spans:
        return [version_number(sample.weight_version)] * count
    versions: list[int] = []
    spans = sample.version_spans
    for position, span in enumerate(spans):
        end = spans[position + 1].start if position + 1 < len(spans) else count
        versions.extend([version_number(span.weight_version)] * max(0, min(end, count) - span.start))
    return versions


@dataclass(frozen=True)
class Staleness:
    """What ``within_bound`` found in one rollout."""

    batch: RolloutBatch
    """The part to train on."""
    histogram: list[int]
    """Tokens trained at each staleness (index: publications behind)."""
    stale_samples: int
    """Samples left out."""
    stale_tokens: int
    """Tokens past the bound: of the samples left out, or masked."""


def within_bound(batch: RolloutBatch, trainer_version: str, bound: int | None, policy: str) -> Staleness:
    """``batch`` with no token more than ``bound`` publications behind ``trainer_version``
    (None: no bound): a sample with such a token is left out (``drop``, ``wait``), or those
    tokens are masked out of the loss (``mask``)."""
    current = version_number(trainer_version)
    histogram: list[int] = []
    kept: list[Sample] = []
    stale_samples = stale_tokens = 0
    for sample in batch.samples:
        ages = [max(0, current - v) for v in token_versions(sample)]
        stale = [bound is not None and age > bound for age in ages]
        if any(stale):
            stale_tokens += sum(stale)
            if policy != "mask":
                stale_samples += 1
                continue
            old_mask = sample.loss_mask or [1] * len(ages)
            mask = [0 if s else m for s, m in zip(stale, old_mask, strict=True)]
            sample = msgspec.structs.replace(sample, loss_mask=mask)
        for age, trained in zip(ages, sample.loss_mask or [1] * len(ages), strict=True):
            if trained:
                if age >= len(histogram):
                    histogram.extend([0] * (age + 1 - len(histogram)))
                histogram[age] += 1
        kept.append(sample)
    part = (
        batch
        if len(kept) == len(batch.samples) and not stale_tokens
        else msgspec.structs.replace(batch, samples=kept)
    )
    return Staleness(part, histogram, stale_samples, stale_tokens)
