"""The publication saga (Publisher) and its verification (Verifier)."""

from __future__ import annotations

import asyncio

import torch

from actors.publisher import Publisher
from actors.verifier import Verifier
from miles_events.rl.checksum import checksums_digest, fingerprints
from schemas.config import Config, GeneratorConfig, PublisherConfig, VerifierConfig
from schemas.data import DataRef
from schemas.events import (
    DataReleased,
    PublicationFailed,
    PublicationMismatch,
    PublicationVerified,
    PublishRequested,
    RunStarted,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)
from tests.support import RecordingContext, feed

REF = DataRef("inprocess", "weights-v1", "trainer")


def config(engines: int = 2, **publisher) -> Config:
    return Config(generator=GeneratorConfig(num_engines=engines), publisher=PublisherConfig(**publisher))


def staged(version: str, checksums: dict[str, str] | None = None) -> WeightsStaged:
    checksums = checksums if checksums is not None else {"w": "00aa"}
    return WeightsStaged(weight_version=version, weights=REF, checksums=checksums,
                         digest=checksums_digest(checksums), num_tensors=len(checksums), num_bytes=4)


def loaded(engine: str, version: str, previous: str, checksums: dict[str, str] | None = None) -> WeightsLoaded:
    checksums = checksums if checksums is not None else {"w": "00aa"}
    return WeightsLoaded(engine=engine, weight_version=version, previous_version=previous,
                         checksums=checksums, digest=checksums_digest(checksums))


def started(weight_version: str = "default") -> RunStarted:
    return RunStarted(runtime="local", config_digest="x", start_rollout_id=0, num_rollout=1,
                      num_rollout_per_epoch=1, weight_version=weight_version)


def publisher(cfg: Config) -> Publisher:
    return Publisher(cfg, RecordingContext(cfg, name="publisher"))


async def test_published_only_once_every_engine_loaded():
    p = publisher(config(engines=2))
    out = await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    assert not [e for e in out if isinstance(e, WeightsPublished)]
    out = await feed(p, loaded("engine-1", "1", "default"))
    published = [e for e in out if isinstance(e, WeightsPublished)]
    assert len(published) == 1 and published[0].weight_version == "1"
    assert published[0].previous_versions == ["default", "default"]
    assert any(isinstance(e, DataReleased) and e.ref == REF for e in out)
    await p.stop()


async def test_versions_go_default_to_1_then_add_exactly_one():
    p = publisher(config(engines=1))
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    out = await feed(p, PublishRequested(rollout_id=0), staged("2"), loaded("engine-0", "2", "1"))
    assert [e.weight_version for e in out if isinstance(e, WeightsPublished)] == ["2"]
    out = await feed(p, PublishRequested(rollout_id=1), staged("4"))
    failed = [e for e in out if isinstance(e, PublicationFailed)]
    assert failed and failed[0].phase == "version" and "exactly one" in failed[0].reason
    await p.stop()


async def test_a_resumed_run_continues_from_the_saved_version():
    p = publisher(config(engines=1))
    out = await feed(p, started(weight_version="5"), PublishRequested(), staged("6"), loaded("engine-0", "6", "default"))
    assert [e.weight_version for e in out if isinstance(e, WeightsPublished)] == ["6"]
    fresh = publisher(config(engines=1))
    out = await feed(fresh, started(), PublishRequested(), staged("6"))
    assert any(isinstance(e, PublicationFailed) for e in out), "a fresh run must start at version 1"
    await p.stop()
    await fresh.stop()


async def test_an_engine_that_never_loads_turns_into_publication_failed():
    p = publisher(config(engines=2, load_timeout=0.05))
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    await asyncio.sleep(0.15)
    failed = [e for e in p.context.published if isinstance(e, PublicationFailed)]
    assert len(failed) == 1 and failed[0].phase == "load" and "engine-1" in failed[0].reason


async def test_a_trainer_that_never_stages_turns_into_publication_failed():
    p = publisher(config(stage_timeout=0.05))
    await feed(p, started(), PublishRequested(rollout_id=3))
    await asyncio.sleep(0.15)
    failed = [e for e in p.context.published if isinstance(e, PublicationFailed)]
    assert len(failed) == 1 and failed[0].phase == "stage" and failed[0].rollout_id == 3


async def test_no_timeout_fires_after_a_completed_publication():
    p = publisher(config(engines=1, stage_timeout=0.05, load_timeout=0.05))
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    await asyncio.sleep(0.15)
    assert not [e for e in p.context.published if isinstance(e, PublicationFailed)]


def verifier(**cfg) -> Verifier:
    c = Config(verifier=VerifierConfig(**cfg))
    return Verifier(c, RecordingContext(c, name="verifier"))


def published(version: str, engines=("engine-0", "engine-1")) -> WeightsPublished:
    return WeightsPublished(weight_version=version, engines=list(engines), previous_versions=["default"] * len(engines))


async def test_equal_checksums_are_verified():
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    sums = fingerprints(tensors)
    v = verifier()
    out = await feed(v, staged("1", sums), loaded("engine-0", "1", "default", sums),
                     loaded("engine-1", "1", "default", fingerprints({k: t.clone() for k, t in tensors.items()})),
                     published("1"))
    assert len(out) == 1 and isinstance(out[0], PublicationVerified)
    assert out[0].num_tensors == 2 and out[0].digest == checksums_digest(sums)


async def test_a_mismatch_names_every_differing_tensor_and_engine():
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    served = dict(tensors, b=torch.ones(2, 2) * 1.0000001)
    v = verifier()
    out = await feed(v, staged("2", fingerprints(tensors)),
                     loaded("engine-0", "2", "1", fingerprints(tensors)),
                     loaded("engine-1", "2", "1", fingerprints(served)), published("2"))
    assert isinstance(out[0], PublicationMismatch)
    assert [(m.engine, m.tensor) for m in out[0].mismatches] == [("engine-1", "b")]


async def test_missing_and_extra_tensors_are_mismatches():
    v = verifier()
    out = await feed(v, staged("1", {"a": "1", "b": "2"}), loaded("engine-0", "1", "default", {"a": "1", "c": "3"}),
                     published("1", engines=("engine-0",)))
    names = {(m.tensor, m.expected, m.actual) for m in out[0].mismatches}
    assert names == {("b", "2", ""), ("c", "", "3")}


async def test_the_skip_list_leaves_tensors_out_of_the_comparison():
    v = verifier(skip_tensor_list=["visual"])
    out = await feed(v, staged("1", {"a": "1", "visual.w": "2"}), loaded("engine-0", "1", "default", {"a": "1", "visual.w": "9"}),
                     published("1", engines=("engine-0",)))
    assert isinstance(out[0], PublicationVerified)


async def test_an_engine_that_sent_no_checksums_is_a_mismatch():
    v = verifier()
    out = await feed(v, staged("1", {"a": "1"}), loaded("engine-0", "1", "default", {"a": "1"}), published("1"))
    assert isinstance(out[0], PublicationMismatch)
    assert [(m.engine, m.tensor) for m in out[0].mismatches] == [("engine-1", "a")]
