"""The few samples of a rollout or an evaluation that its event keeps, their texts cut short.

The event log stays small whatever the batch: a fixed number of samples, each text at most
a fixed number of characters. Which samples is a pure function of the batch (the first of
each prompt's group, in group order, then the second of each, ...), so a resumed run, which
regenerates identical batches, keeps the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.events import SampleExcerpt
from schemas.rollout import Sample

ELISION = "…"
"""What stands for the cut middle of a text."""


def cut_text(text: str, max_chars: int) -> str:
    """``text`` when it has at most ``max_chars`` characters; else its beginning and its end
    joined by ``ELISION``, ``max_chars`` characters in all (the end says how a response
    finished, the beginning what it set out to do)."""
    if len(text) <= max_chars:
        return text
    kept = max(max_chars - len(ELISION), 0)
    head = (kept + 1) // 2
    tail = kept - head
    return text[:head] + ELISION + (text[-tail:] if tail else "")


def excerpt(sample: Sample, max_chars: int) -> SampleExcerpt:
    """``sample`` as its event keeps it: texts cut to ``max_chars``, the lengths before the cut."""
    return SampleExcerpt(
        index=sample.index,
        group=sample.group,
        prompt=cut_text(sample.prompt, max_chars),
        response=cut_text(sample.response, max_chars),
        label=cut_text(sample.label, max_chars),
        reward=sample.reward,
        response_tokens=len(sample.response_ids),
        finish_reason=sample.finish_reason,
        weight_version=sample.weight_version,
        prompt_chars=len(sample.prompt),
        response_chars=len(sample.response),
    )


def kept_samples(samples: Sequence[Sample], count: int, max_chars: int) -> list[SampleExcerpt]:
    """``count`` of ``samples`` (every one when there are fewer): the first sample of each
    group in group order, then the second of each, and so on; each cut to ``max_chars``."""
    if count <= 0:
        return []
    groups: dict[int, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group, []).append(sample)
    ordered = [group for _, group in sorted(groups.items())]
    chosen: list[Sample] = []
    depth = 0
    while len(chosen) < count and any(depth < len(group) for group in ordered):
        chosen.extend(group[depth] for group in ordered if depth < len(group))
        depth += 1
    return [excerpt(sample, max_chars) for sample in chosen[:count]]
