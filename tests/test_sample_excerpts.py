"""The samples a rollout's event keeps: which ones, and how their texts are cut."""

from __future__ import annotations

import pytest

from miles_events.rl.sample_excerpts import ELISION, cut_text, excerpt, kept_samples
from schemas.rollout import Sample


def sample(group: int, member: int, prompt: str = "3+4=", response: str = "7") -> Sample:
    return Sample(
        index=100 + group,
        group=group,
        prompt=prompt,
        label=str(group),
        prompt_ids=[1, 2, 3],
        response_ids=[4] * (member + 1),
        response_logprobs=[-0.5] * (member + 1),
        response=response,
        reward=float(member),
        weight_version="2",
        engine="engine-0",
        finish_reason="stop",
    )


def batch(groups: int, per_group: int) -> list[Sample]:
    return [sample(g, m) for g in range(groups) for m in range(per_group)]


def test_a_short_text_is_kept_whole() -> None:
    assert cut_text("3+4=", 4) == "3+4="
    assert cut_text("", 1) == ""


@pytest.mark.parametrize("limit", [1, 2, 5, 10, 11])
def test_a_long_text_keeps_its_beginning_and_its_end_within_the_limit(limit: int) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(40))
    cut = cut_text(text, limit)
    assert len(cut) == limit
    head, _, tail = cut.partition(ELISION)
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) - len(tail) in (0, 1)


def test_the_first_sample_of_each_prompt_comes_first() -> None:
    kept = kept_samples(batch(groups=6, per_group=8), 4, 400)
    assert [(s.group, s.reward) for s in kept] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0)]


def test_with_few_prompts_the_second_sample_of_each_follows() -> None:
    kept = kept_samples(batch(groups=2, per_group=3), 5, 400)
    assert [(s.group, s.reward) for s in kept] == [(0, 0.0), (1, 0.0), (0, 1.0), (1, 1.0), (0, 2.0)]


def test_groups_are_taken_in_group_order_whatever_order_they_arrive_in() -> None:
    samples = batch(groups=3, per_group=2)
    shuffled = [samples[i] for i in (3, 0, 5, 1, 4, 2)]
    assert [(s.group, s.reward) for s in kept_samples(shuffled, 4, 400)] == [
        (0, 0.0),
        (1, 1.0),  # the first of group 1 to arrive
        (2, 1.0),
        (0, 1.0),
    ]


def test_a_batch_smaller_than_the_count_is_kept_whole_and_zero_keeps_none() -> None:
    samples = batch(groups=2, per_group=1)
    assert len(kept_samples(samples, 10, 400)) == 2
    assert kept_samples(samples, 0, 400) == []
    assert kept_samples([], 4, 400) == []


def test_an_excerpt_cuts_its_texts_and_keeps_the_lengths_and_scores_whole() -> None:
    long = sample(0, 4, prompt="p" * 50 + "Q", response="r" * 30 + "A")
    kept = excerpt(long, 9)
    assert (len(kept.prompt), len(kept.response)) == (9, 9)
    assert kept.prompt.endswith("Q") and kept.response.endswith("A")
    assert (kept.prompt_chars, kept.response_chars) == (51, 31)
    assert (kept.reward, kept.response_tokens, kept.index, kept.group) == (4.0, 5, 100, 0)
    assert (kept.label, kept.finish_reason, kept.weight_version) == ("0", "stop", "2")
