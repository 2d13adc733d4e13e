"""Per-token provenance and the staleness bound: what training keeps of a rollout."""

from __future__ import annotations

from miles_events.rl.staleness import token_versions, within_bound
from schemas.rollout import RolloutBatch, Sample, VersionSpan


def sample(index: int, tokens: int, spans: list[tuple[int, str]] | None = None, version: str = "1") -> Sample:
    return Sample(
        index=index,
        group=index,
        prompt="p",
        label="l",
        prompt_ids=[1],
        response_ids=list(range(tokens)),
        response_logprobs=[0.0] * tokens,
        response="r",
        reward=1.0,
        weight_version=version,
        engine="engine-0",
        finish_reason="stop",
        version_spans=[VersionSpan(start, v) for start, v in spans or []],
    )


def test_spans_give_each_token_its_version_and_no_spans_the_samples_version():
    assert token_versions(sample(0, 5, [(0, "3"), (2, "4")])) == [3, 3, 4, 4, 4]
    assert token_versions(sample(0, 3, version="default")) == [0, 0, 0]


def test_a_sample_with_a_token_past_the_bound_is_dropped_and_counted():
    batch = RolloutBatch(rollout_id=5, samples=[sample(0, 4, [(0, "3"), (2, "5")]), sample(1, 2, [(0, "5")])])
    aged = within_bound(batch, trainer_version="6", bound=2, policy="drop")
    assert [s.index for s in aged.batch.samples] == [1]
    assert (aged.stale_samples, aged.stale_tokens) == (1, 2)
    assert aged.histogram == [0, 2]  # the kept sample's two tokens, one publication behind


def test_mask_keeps_the_sample_and_leaves_only_its_stale_tokens_out_of_the_loss():
    batch = RolloutBatch(rollout_id=5, samples=[sample(0, 4, [(0, "3"), (2, "5")])])
    aged = within_bound(batch, trainer_version="6", bound=2, policy="mask")
    (kept,) = aged.batch.samples
    assert kept.loss_mask == [0, 0, 1, 1]
    assert (aged.stale_samples, aged.stale_tokens, aged.histogram) == (0, 2, [0, 2])


def test_wait_never_trains_a_stale_token_either_and_no_bound_keeps_everything():
    batch = RolloutBatch(rollout_id=5, samples=[sample(0, 2, [(0, "1")])])
    assert within_bound(batch, "6", 2, "wait").batch.samples == []
    unbounded = within_bound(batch, "6", None, "wait")
    assert unbounded.batch is batch and unbounded.histogram == [0, 0, 0, 0, 0, 2]
