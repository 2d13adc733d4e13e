"""Every event survives the wire codec, and the header/evolution rules hold."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from miles_events.bus.codec import (
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    event_from_json,
    event_to_json,
    event_to_json_bytes,
)
from schemas.checkpoint import DataCursor, TrainerState
from schemas.data import DataRef
from schemas.events import (
    EVENT_TYPES,
    EVENT_TYPES_BY_NAME,
    CriticMetrics,
    Event,
    MemoryPart,
    ProbeBatch,
    RankStep,
    RolloutRequested,
    SampleExcerpt,
    TensorMismatch,
    TrainMetrics,
    TrainStepFinished,
)
from schemas.evidence import CheckpointRolloutEvidence

HEADER = {"run_id": "run-7", "seq": 42, "time": 1_700_000_000.25, "source": "tester"}
REF = DataRef("shm", "rollout-3", "generator", 4096)
MANIFEST = "checksums/" + "cd" * 32 + ".msgpack"
STATE = TrainerState(
    rollout_id=3,
    weight_version="4",
    num_optimizer_steps=12,
    data=DataCursor(next_rollout_id=4, epoch=1, offset=16),
    seed=1234,
    run_id="run-7",
)
SAMPLE = SampleExcerpt(
    index=17,
    group=0,
    prompt="3+4=",
    response="7",
    label="7",
    reward=1.0,
    response_tokens=2,
    finish_reason="stop",
    weight_version="3",
    prompt_chars=4,
    response_chars=1,
)

EVIDENCE = CheckpointRolloutEvidence(
    effective_load="/runs/a/checkpoints",
    ref_load="/runs/a/base_model",
    checkpoint_iteration=1,
    engine_count=2,
    language_tensor_count=30,
    changed_language_tensor_count=30,
    reset_changed_language_tensor_count=30,
    base_language_checksum_sha256="01" * 32,
    served_language_checksum_sha256="ef" * 32,
    reset_language_checksum_sha256="23" * 32,
    bootstrap_weight_versions=["default", "default"],
    served_weight_versions=["1", "1"],
    republished_weight_versions=["2", "2"],
)

# One instance per event type with every field given a non-default value.
EXAMPLES: dict[str, dict[str, Any]] = {
    "RunStarted": dict(
        runtime="local",
        config_digest="ab" * 32,
        start_rollout_id=2,
        num_rollout=10,
        num_rollout_per_epoch=5,
        resumed=True,
        weight_version="3",
        engines=["engine-0", "engine-1"],
        rollout_only=True,
        checkpoint_iteration=1,
        trainer_ranks=2,
        trainer_sharding="fsdp2",
        regenerated=[2, 3],
    ),
    "StopRequested": dict(reason="sentinel file", now=True),
    "StepCancelled": dict(rollout_id=3, phase="generate", reason="interrupted by signal"),
    "RunFinished": dict(status="stopped", reason="user", last_rollout_id=7, weight_version="8"),
    "ActorFailed": dict(
        actor="trainer",
        error="boom",
        event_type="RolloutGenerated",
        event_seq=17,
        traceback="Traceback (most recent call last): ...",
    ),
    "DataReleased": dict(ref=REF),
    "RolloutRequested": dict(rollout_id=3),
    "RolloutGenerated": dict(
        rollout_id=3,
        batch=REF,
        num_samples=64,
        reward_mean=0.375,
        weight_versions=["2", "3"],
        response_tokens=900,
        generate_seconds=1.5,
        samples=[SAMPLE],
    ),
    "TrainStepFinished": dict(
        rollout_id=3,
        weight_version="3",
        metrics=TrainMetrics(
            loss=0.5,
            pg_loss=0.25,
            kl=0.01,
            entropy=2.0,
            grad_norm=0.75,
            clipfrac=0.125,
            train_tokens=2048,
            num_optimizer_steps=4,
        ),
        staleness_max=1,
        token_staleness=[100, 1948],
        stale_samples=1,
        stale_tokens=3,
        trained_prompts=[4, 4, 9, 9],
        train_seconds=3.0,
        critic_only=False,
        ranks=[
            RankStep(rank=0, pid=101, step_seconds=2.5, peak_memory_bytes=3 << 30, state_bytes=1 << 30),
            RankStep(rank=1, pid=102, step_seconds=2.25, peak_memory_bytes=5 << 29, state_bytes=1 << 30),
        ],
    ),
    "CriticStepFinished": dict(
        rollout_id=3,
        values=DataRef("inprocess", "critic-values-r3", "critic", 64),
        metrics=CriticMetrics(
            value_loss=0.125,
            value_clipfrac=0.25,
            value_mean=0.5,
            return_mean=0.75,
            grad_norm=1.5,
            train_tokens=2048,
            num_optimizer_steps=4,
            lr=0.001,
        ),
        train_seconds=2.0,
        ranks=[RankStep(rank=0, pid=103, step_seconds=1.5, peak_memory_bytes=1 << 30, state_bytes=1 << 29)],
    ),
    "EvalRequested": dict(rollout_id=5),
    "EvalFinished": dict(
        rollout_id=5,
        metrics={"accuracy": 0.5, "reward": 0.25},
        weight_versions=["5"],
        eval_seconds=2.0,
        samples=[SAMPLE],
    ),
    "PublishRequested": dict(rollout_id=3),
    "WeightsStaged": dict(
        weight_version="4",
        weights=REF,
        digest="cd" * 32,
        num_tensors=2,
        num_bytes=1 << 20,
        checksums_manifest=MANIFEST,
        rollout_id=3,
        stage_seconds=0.5,
        canary="0f" * 8,
        probe=ProbeBatch(prompt_ids=[[1, 2]], response_ids=[[3]], logprobs=[[-0.5]]),
    ),
    "WeightsLoaded": dict(
        engine="engine-0",
        weight_version="4",
        previous_version="3",
        digest="cd" * 32,
        num_tensors=2,
        num_bytes=1 << 20,
        checksums_manifest=MANIFEST,
        checksum_error="",
        load_seconds=0.25,
        canary="0f" * 8,
        probe_logprobs=[[-0.5]],
        restore=False,
    ),
    "WeightsPublished": dict(
        weight_version="4",
        engines=["engine-0"],
        previous_versions=["3"],
        rollout_id=3,
        stage_seconds=0.5,
        load_seconds=0.25,
        publish_seconds=0.875,
    ),
    "PublicationFailed": dict(weight_version="4", phase="load", reason="timeout", rollout_id=3),
    "PublicationVerified": dict(
        weight_version="4",
        digest="cd" * 32,
        num_tensors=2,
        engines=["engine-0"],
        rollout_id=3,
        verify_seconds=0.01,
        write_proof="canary",
        probe_max_diff=1e-5,
    ),
    "PublicationMismatch": dict(
        weight_version="4",
        mismatches=[
            TensorMismatch("engine-0", "lm_head.weight", "fedcba9876543210", "0000000000000000"),
            TensorMismatch("engine-1", "*", "cd" * 32, "ef" * 32, reason="cannot read checksums manifest"),
        ],
        expected_digest="cd" * 32,
        engine_digests={"engine-0": "ef" * 32},
        rollout_id=3,
        verify_seconds=0.01,
    ),
    "WeightsCheckRequested": dict(
        action="compare",
        selector="target",
        skip_tensor_list=["rotary_emb"],
        allow_quant_error=True,
        request_id="check-1",
    ),
    "WeightsCheckFinished": dict(
        engine="engine-0",
        action="checksum",
        success=False,
        message="mismatch",
        digest="cd" * 32,
        num_tensors=2,
        checksums_manifest=MANIFEST,
        weight_version="4",
        request_id="check-1",
    ),
    "PublicationEvidenceRequested": dict(path="/tmp/evidence.json", evidence=EVIDENCE),
    "PublicationEvidenceWritten": dict(path="/tmp/evidence.json", served_digest="ef" * 32),
    "PublicationEvidenceFailed": dict(path="/tmp/evidence.json", reason="exists already"),
    "SaveRequested": dict(rollout_id=3, reason="sentinel", publication_follows=True),
    "TrainStateStaged": dict(
        rollout_id=3,
        weights=REF,
        optimizer=DataRef("shm", "optimizer-3", "trainer", 10),
        rng=DataRef("shm", "rng-3", "trainer", 5),
        trainer_state=STATE,
        reason="last",
    ),
    "CriticStateStaged": dict(
        rollout_id=3,
        weights=DataRef("shm", "critic-weights-3", "critic", 20),
        optimizer=DataRef("shm", "critic-optimizer-3", "critic", 10),
        rng=DataRef("shm", "critic-rng-3", "critic", 5),
        num_optimizer_steps=12,
    ),
    "OffloadRequested": dict(
        target="rollout", tags=["cuda_graph", "kv_cache"], rollout_id=3, request_id="memory-5"
    ),
    "OnloadRequested": dict(target="actor", tags=[], rollout_id=None, request_id="memory-1"),
    "MemoryOffloaded": dict(
        target="rollout",
        tags=["cuda_graph", "kv_cache", "weights"],
        rollout_id=3,
        request_id="memory-5",
        parts=[
            MemoryPart(
                name="engine-0",
                device="cuda:0",
                bytes=1 << 30,
                device_free_before=10,
                device_free_after=20,
                seconds=0.5,
            )
        ],
        seconds=0.5,
    ),
    "MemoryOnloaded": dict(
        target="critic",
        tags=[],
        rollout_id=4,
        request_id="",
        parts=[MemoryPart(name="rank-1", device="cpu", bytes=64)],
        seconds=0.25,
    ),
    "CheckpointSaved": dict(
        rollout_id=3,
        path="/runs/x/checkpoints/rollout_3",
        weight_version="4",
        num_bytes=123,
        save_seconds=1.0,
    ),
    "CheckpointFailed": dict(rollout_id=3, reason="disk full"),
    "PolicySyncRequested": dict(hook="after_local_train", rollout_id=3),
    "PolicySyncFinished": dict(hook="after_local_train", rollout_id=3, stop=True, seconds=0.5),
    "PolicySyncFailed": dict(hook="initialize", rollout_id=3, reason="no peer"),
    "ModelWeightsRequested": dict(request_id="sync-1", role="critic"),
    "ModelWeightsStaged": dict(
        request_id="sync-1",
        role="critic",
        weights=DataRef("shm", "policy-sync-sync-1", "critic", 20),
        digest="ab" * 32,
        num_tensors=7,
        weight_version="3",
    ),
    "ModelWeightsLoadRequested": dict(
        request_id="sync-2",
        role="critic",
        weights=DataRef("shm", "policy-sync-sync-2", "policy_sync", 20),
        digest="cd" * 32,
    ),
    "ModelWeightsLoaded": dict(request_id="sync-2", role="critic", digest="cd" * 32, error="no fit"),
    "CheckpointRequested": dict(reason="asked for by the control server"),
    "CellSuspendRequested": dict(cell="rollout-1", suspend=True),
    "FaultInjectionRequested": dict(cell="rollout-1", mode="sigkill", sub_index=0),
    "FaultInjected": dict(cell="rollout-1", mode="sigkill", pid=4242, sub_index=0, error=""),
    "CellFailed": dict(cell="rollout-1", reason="engine-1 died", hung=False, restarts=0, rollout_id=3),
    "CellRestarted": dict(cell="rollout-1", attempt=1, pid=4243, weight_version="4", restart_seconds=3.5),
    "CellSuspended": dict(cell="rollout-1"),
    "CellResumed": dict(cell="rollout-1", pid=4244, weight_version="4"),
    "CellHealth": dict(cell="rollout-0", healthy=False, reason="engine-0 did not answer"),
    "CellHealing": dict(cell="rollout-1", step="failed", reason="ConnectError", backoff_seconds=10.0),
    "RestoreVerified": dict(
        engine="engine-1", weight_version="4", digest="cd" * 32, write_proof="canary", probe_max_diff=0.0
    ),
    "WeightsLoadStarted": dict(weight_version="4"),
    "TrainerRestoreRequested": dict(
        checkpoint="/runs/x/checkpoints/rollout_000002", rollout_id=2, redo=[3, 4]
    ),
    "TrainerRestored": dict(
        checkpoint="/runs/x/checkpoints/rollout_000002", rollout_id=2, weight_version="6", restore_seconds=0.2
    ),
}


def example(name: str) -> Event:
    return EVENT_TYPES_BY_NAME[name](**EXAMPLES[name], **HEADER)


def test_examples_cover_every_event_type_and_every_field() -> None:
    assert set(EXAMPLES) == set(EVENT_TYPES_BY_NAME)
    for name, fields in EXAMPLES.items():
        own_fields = set(EVENT_TYPES_BY_NAME[name].__struct_fields__) - set(HEADER)
        assert set(fields) == own_fields, name


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
def test_event_round_trips_through_msgpack(event_type: type[Event]) -> None:
    event = example(event_type.__name__)
    decoded = decode_event(encode_event(event))
    assert type(decoded) is event_type
    assert decoded == event


@pytest.mark.parametrize("event_type", EVENT_TYPES, ids=lambda t: t.__name__)
def test_event_round_trips_through_json(event_type: type[Event]) -> None:
    event = example(event_type.__name__)
    as_dict = event_to_json(event)
    assert as_dict["type"] == event_type.__name__
    assert event_from_json(as_dict) == event
    assert event_from_json(event_to_json_bytes(event)) == event


def test_batch_round_trips_in_order() -> None:
    events = [example(name) for name in EXAMPLES]
    assert decode_batch(encode_batch(events)) == events


def test_header_defaults_are_unstamped() -> None:
    event = RolloutRequested(rollout_id=1)
    assert (event.run_id, event.seq, event.time, event.source) == ("", 0, 0.0, "")


def test_events_are_frozen() -> None:
    event = RolloutRequested(rollout_id=1)
    with pytest.raises(AttributeError):
        event.rollout_id = 2  # type: ignore[misc]


def test_unknown_field_from_a_newer_writer_is_ignored() -> None:
    class NewerRolloutRequested(Event, frozen=True, kw_only=True, tag="RolloutRequested"):
        rollout_id: int
        priority: int = 0

    data = msgspec.msgpack.encode(NewerRolloutRequested(rollout_id=9, priority=3, seq=5))
    assert decode_event(data) == RolloutRequested(rollout_id=9, seq=5)


def test_field_missing_from_an_older_writer_gets_its_default() -> None:
    data = msgspec.msgpack.encode({"type": "RunFinished", "status": "completed"})
    event = decode_event(data)
    assert event == EVENT_TYPES_BY_NAME["RunFinished"](status="completed")
    assert event.last_rollout_id == -1  # type: ignore[attr-defined]


def test_unknown_event_type_does_not_decode() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_event(msgspec.msgpack.encode({"type": "NoSuchEvent"}))


def test_a_train_step_of_two_ranks_round_trips_with_each_ranks_numbers() -> None:
    step = example("TrainStepFinished")
    assert isinstance(step, TrainStepFinished)
    decoded = decode_event(encode_event(step))
    assert isinstance(decoded, TrainStepFinished)
    assert [(r.rank, r.pid, r.step_seconds) for r in decoded.ranks] == [(0, 101, 2.5), (1, 102, 2.25)]
    assert [r.peak_memory_bytes for r in decoded.ranks] == [3 << 30, 5 << 29]
    assert event_from_json(event_to_json_bytes(step)) == step


def test_a_train_step_and_run_start_written_before_ranks_read_as_one_unreported_rank() -> None:
    old = decode_event(
        msgspec.msgpack.encode({"type": "TrainStepFinished", "rollout_id": 1, "weight_version": "1"})
    )
    assert isinstance(old, TrainStepFinished) and old.ranks == []
    started = decode_event(
        msgspec.msgpack.encode(
            {
                "type": "RunStarted",
                "runtime": "local",
                "config_digest": "",
                "start_rollout_id": 0,
                "num_rollout": 1,
                "num_rollout_per_epoch": None,
            }
        )
    )
    assert (started.trainer_ranks, started.trainer_sharding) == (1, "none")  # type: ignore[attr-defined]
