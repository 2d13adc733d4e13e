"""The publication saga (Publisher) and its verification (Verifier)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from actors.publisher import Publisher
from actors.verifier import Verifier
from miles_events.bus.clock import ManualClock
from miles_events.bus.testing import RecordingContext, feed
from miles_events.device.fingerprint import fingerprints
from miles_events.rl.canary import CANARY_TENSOR
from miles_events.rl.checksum import per_gpu_checksum
from miles_events.rl.checksum_manifest import write_manifest
from miles_events.rl.probe import PROBE_TENSOR
from schemas.config import Config, GeneratorConfig, PublisherConfig, VerifierConfig
from schemas.data import DataRef
from schemas.events import (
    CellResumed,
    CellSuspended,
    DataReleased,
    ProbeBatch,
    PublicationFailed,
    PublicationMismatch,
    PublicationVerified,
    PublishRequested,
    RestoreVerified,
    RunStarted,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)

REF = DataRef("inprocess", "weights-v1", "trainer")


def config(engines: int = 2, **publisher) -> Config:
    return Config(generator=GeneratorConfig(num_engines=engines), publisher=PublisherConfig(**publisher))


def summary(checksums: dict[str, str] | None, run_dir: Path | None) -> tuple[dict[str, str], str, str]:
    """(checksums, digest, manifest) as the trainer and the engines record them."""
    checksums = checksums if checksums is not None else {"w": "00aa"}
    if run_dir is None:
        return checksums, per_gpu_checksum(checksums), ""
    return checksums, *write_manifest(run_dir, checksums)


def staged(
    version: str, checksums: dict[str, str] | None = None, run_dir: Path | None = None
) -> WeightsStaged:
    checksums, digest, manifest = summary(checksums, run_dir)
    return WeightsStaged(
        weight_version=version,
        weights=REF,
        digest=digest,
        num_tensors=len(checksums),
        num_bytes=4,
        checksums_manifest=manifest,
    )


def loaded(
    engine: str,
    version: str,
    previous: str,
    checksums: dict[str, str] | None = None,
    run_dir: Path | None = None,
) -> WeightsLoaded:
    checksums, digest, manifest = summary(checksums, run_dir)
    return WeightsLoaded(
        engine=engine,
        weight_version=version,
        previous_version=previous,
        digest=digest,
        num_tensors=len(checksums),
        checksums_manifest=manifest,
    )


def started(weight_version: str = "default") -> RunStarted:
    return RunStarted(
        runtime="local",
        config_digest="x",
        start_rollout_id=0,
        num_rollout=1,
        num_rollout_per_epoch=1,
        weight_version=weight_version,
    )


def publisher(cfg: Config, clock: ManualClock | None = None) -> Publisher:
    return Publisher(cfg, RecordingContext(cfg, name="publisher", clock=clock or ManualClock()))


@pytest.mark.parametrize(
    ("transport", "runtime", "chosen"),
    [
        ("auto", "local", "inprocess"),
        ("auto", "ray", "shm"),
        ("disk", "local", "disk"),
        ("cuda_ipc", "ray", "cuda_ipc"),
    ],
)
def test_the_publisher_chooses_the_runs_data_plane_resolving_auto_by_runtime(transport, runtime, chosen):
    chosen_config = msgspec.structs.replace(
        config(transport=transport), run=msgspec.structs.replace(Config().run, runtime=runtime)
    )
    assert Publisher.data_plane(chosen_config) == chosen


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
    out = await feed(
        p, started(weight_version="5"), PublishRequested(), staged("6"), loaded("engine-0", "6", "default")
    )
    assert [e.weight_version for e in out if isinstance(e, WeightsPublished)] == ["6"]
    fresh = publisher(config(engines=1))
    out = await feed(fresh, started(), PublishRequested(), staged("6"))
    assert any(isinstance(e, PublicationFailed) for e in out), "a fresh run must start at version 1"
    await p.stop()
    await fresh.stop()


async def test_an_engine_that_never_loads_turns_into_publication_failed():
    clock = ManualClock()
    p = publisher(config(engines=2, load_timeout=5), clock)
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    await clock.advance(4.9)
    assert not [e for e in p.context.published if isinstance(e, PublicationFailed)]
    await clock.advance(0.1)
    failed = [e for e in p.context.published if isinstance(e, PublicationFailed)]
    assert len(failed) == 1 and failed[0].phase == "load" and "engine-1" in failed[0].reason


async def test_asynchronously_the_load_timeout_counts_from_the_generators_start_of_the_load():
    """A publication may wait behind the rollout being generated (``run.max_staleness``):
    its load clock starts at ``WeightsLoadStarted``, not at the staging."""
    from schemas.events import WeightsLoadStarted

    clock = ManualClock()
    cfg = config(engines=1, load_timeout=5)
    cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, max_staleness=1))
    p = publisher(cfg, clock)
    await feed(p, started(), PublishRequested(), staged("1"))
    await clock.advance(600)  # a long rollout before the load
    assert not [e for e in p.context.published if isinstance(e, PublicationFailed)]
    await feed(p, WeightsLoadStarted(weight_version="1"))
    await clock.advance(5)
    failed = [e for e in p.context.published if isinstance(e, PublicationFailed)]
    assert len(failed) == 1 and failed[0].phase == "load"


async def test_a_trainer_that_never_stages_turns_into_publication_failed():
    clock = ManualClock()
    p = publisher(config(stage_timeout=5), clock)
    await feed(p, started(), PublishRequested(rollout_id=3))
    await clock.advance(5)
    failed = [e for e in p.context.published if isinstance(e, PublicationFailed)]
    assert len(failed) == 1 and failed[0].phase == "stage" and failed[0].rollout_id == 3


async def test_no_timeout_fires_after_a_completed_publication():
    clock = ManualClock()
    p = publisher(config(engines=1, stage_timeout=5, load_timeout=5), clock)
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    await clock.advance(60)
    assert clock.sleepers == 0
    assert not [e for e in p.context.published if isinstance(e, PublicationFailed)]


def verifier(run_dir: Path, **cfg) -> Verifier:
    c = Config(verifier=VerifierConfig(**cfg))
    return Verifier(c, RecordingContext(c, name="verifier", run_dir=run_dir))


def published(version: str, engines=("engine-0", "engine-1")) -> WeightsPublished:
    return WeightsPublished(
        weight_version=version, engines=list(engines), previous_versions=["default"] * len(engines)
    )


async def test_equal_checksums_are_verified(tmp_path):
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    sums = fingerprints(tensors)
    v = verifier(tmp_path)
    out = await feed(
        v,
        staged("1", sums, tmp_path),
        loaded("engine-0", "1", "default", sums, tmp_path),
        loaded(
            "engine-1", "1", "default", fingerprints({k: t.clone() for k, t in tensors.items()}), tmp_path
        ),
        published("1"),
    )
    assert len(out) == 1 and isinstance(out[0], PublicationVerified)
    assert out[0].num_tensors == 2 and out[0].digest == per_gpu_checksum(sums)


async def test_equal_digests_are_verified_without_opening_a_manifest(tmp_path):
    v = verifier(tmp_path)
    gone = "checksums/never-written.msgpack"
    out = await feed(
        v,
        msgspec.structs.replace(staged("1"), checksums_manifest=gone),
        msgspec.structs.replace(loaded("engine-0", "1", "default"), checksums_manifest=gone),
        published("1", engines=("engine-0",)),
    )
    assert isinstance(out[0], PublicationVerified)
    assert not (tmp_path / "checksums").exists()


async def test_a_mismatch_names_every_differing_tensor_and_engine(tmp_path):
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2)}
    served = dict(tensors, b=torch.ones(2, 2) * 1.0000001)
    v = verifier(tmp_path)
    out = await feed(
        v,
        staged("2", fingerprints(tensors), tmp_path),
        loaded("engine-0", "2", "1", fingerprints(tensors), tmp_path),
        loaded("engine-1", "2", "1", fingerprints(served), tmp_path),
        published("2"),
    )
    assert isinstance(out[0], PublicationMismatch)
    assert [(m.engine, m.tensor) for m in out[0].mismatches] == [("engine-1", "b")]
    assert out[0].engine_digests == {
        "engine-0": per_gpu_checksum(fingerprints(tensors)),
        "engine-1": per_gpu_checksum(fingerprints(served)),
    }


async def test_missing_and_extra_tensors_are_mismatches(tmp_path):
    v = verifier(tmp_path)
    out = await feed(
        v,
        staged("1", {"a": "1", "b": "2"}, tmp_path),
        loaded("engine-0", "1", "default", {"a": "1", "c": "3"}, tmp_path),
        published("1", engines=("engine-0",)),
    )
    names = {(m.tensor, m.expected, m.actual) for m in out[0].mismatches}
    assert names == {("b", "2", ""), ("c", "", "3")}


async def test_the_skip_list_leaves_tensors_out_of_the_comparison(tmp_path):
    v = verifier(tmp_path, skip_tensor_list=["visual"])
    out = await feed(
        v,
        staged("1", {"a": "1", "visual.w": "2"}, tmp_path),
        loaded("engine-0", "1", "default", {"a": "1", "visual.w": "9"}, tmp_path),
        published("1", engines=("engine-0",)),
    )
    assert isinstance(out[0], PublicationVerified)


async def test_an_engine_that_sent_no_checksums_is_a_mismatch(tmp_path):
    v = verifier(tmp_path)
    out = await feed(
        v,
        staged("1", {"a": "1"}, tmp_path),
        loaded("engine-0", "1", "default", {"a": "1"}, tmp_path),
        published("1"),
    )
    assert isinstance(out[0], PublicationMismatch)
    assert [(m.engine, m.tensor) for m in out[0].mismatches] == [("engine-1", "a")]


async def test_an_engine_whose_checksum_reply_was_unusable_is_a_mismatch_naming_why(tmp_path):
    v = verifier(tmp_path)
    bad = WeightsLoaded(
        engine="engine-1",
        weight_version="1",
        previous_version="default",
        digest="",
        checksum_error="engine-1: the checksum reply reports rank 0 twice",
    )
    out = await feed(
        v,
        staged("1", {"a": "1"}, tmp_path),
        loaded("engine-0", "1", "default", {"a": "1"}, tmp_path),
        bad,
        published("1"),
    )
    [mismatch] = out[0].mismatches
    assert isinstance(out[0], PublicationMismatch)
    assert (mismatch.engine, mismatch.tensor) == ("engine-1", "*")
    assert (mismatch.expected, mismatch.actual) == (per_gpu_checksum({"a": "1"}), "")
    assert mismatch.reason == "engine-1: the checksum reply reports rank 0 twice"


async def test_an_unusable_checksum_reply_is_a_mismatch_even_when_its_digest_agrees(tmp_path):
    v = verifier(tmp_path)
    bad = msgspec.structs.replace(
        loaded("engine-0", "1", "default", {"a": "1"}, tmp_path),
        checksum_error="engine-0: rank 1 of the checksum reply has no tensors",
    )
    out = await feed(v, staged("1", {"a": "1"}, tmp_path), bad, published("1", engines=("engine-0",)))
    assert isinstance(out[0], PublicationMismatch)
    assert [(m.engine, m.tensor, m.reason) for m in out[0].mismatches] == [
        ("engine-0", "*", "engine-0: rank 1 of the checksum reply has no tensors")
    ]


async def test_the_mismatches_of_ranked_tensors_are_named_in_rank_order(tmp_path):
    v = verifier(tmp_path)
    expected = {f"rank{gpu}/w": "01" for gpu in range(12)}
    served = {f"rank{gpu}/w": "02" for gpu in range(12)}
    out = await feed(
        v,
        staged("1", expected, tmp_path),
        loaded("engine-0", "1", "default", served, tmp_path),
        published("1", engines=("engine-0",)),
    )
    assert [m.tensor for m in out[0].mismatches] == [f"rank{gpu}/w" for gpu in range(12)]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("delete", "cannot read checksums manifest checksums/"),
        ("garble", "does not decode"),
        ("swap", "holds the checksums of digest"),
    ],
)
async def test_an_unreadable_manifest_is_a_mismatch_of_that_engine_naming_the_reason(
    tmp_path, damage, reason
):
    v = verifier(tmp_path)
    bad = loaded("engine-1", "1", "default", {"a": "2"}, tmp_path)
    path = tmp_path / bad.checksums_manifest
    if damage == "delete":
        path.unlink()
    elif damage == "garble":
        path.write_bytes(b"not msgpack")
    else:
        path.write_bytes((tmp_path / write_manifest(tmp_path, {"a": "3"})[1]).read_bytes())
    out = await feed(
        v,
        staged("1", {"a": "1"}, tmp_path),
        loaded("engine-0", "1", "default", {"a": "1"}, tmp_path),
        bad,
        published("1"),
    )
    [mismatch] = out[0].mismatches
    assert (mismatch.engine, mismatch.tensor) == ("engine-1", "*")
    assert (mismatch.expected, mismatch.actual) == (per_gpu_checksum({"a": "1"}), bad.digest)
    assert reason in mismatch.reason


async def test_the_skip_list_applies_before_the_digest_on_both_sides(tmp_path):
    """The trainer and the engines leave skipped tensors out of their digests, so a publication
    that differs only there is verified on digests alone."""
    skip = ["visual"]
    trainer = fingerprints({"a": torch.ones(2), "visual.w": torch.zeros(2)}, skip)
    engine = fingerprints({"a": torch.ones(2), "visual.w": torch.ones(2)}, skip)
    assert trainer == engine == {"a": fingerprints({"a": torch.ones(2)})["a"]}
    v = verifier(tmp_path, skip_tensor_list=skip)
    out = await feed(
        v,
        staged("1", trainer),
        loaded("engine-0", "1", "default", engine),
        published("1", engines=("engine-0",)),
    )
    assert isinstance(out[0], PublicationVerified)


# --- the publication canary: proof that each load applied the payload ----------------------


@pytest.mark.parametrize(
    ("engine_canaries", "outcome"),
    [
        ({"engine-0": "c1", "engine-1": "c1"}, "canary"),
        # An engine that cannot hold a canary is verified by the digests alone.
        ({"engine-0": "c1", "engine-1": None}, "none"),
        # Another publication's canary, or none at all: the load did not apply this payload.
        ({"engine-0": "c1", "engine-1": "c0"}, "mismatch"),
        ({"engine-0": "", "engine-1": "c1"}, "mismatch"),
    ],
)
async def test_equal_digests_are_not_enough_the_canary_must_be_the_publications(
    tmp_path, engine_canaries, outcome
):
    v = verifier(tmp_path)
    inputs = [msgspec.structs.replace(staged("1"), canary="c1")]
    for engine, canary in engine_canaries.items():
        inputs.append(msgspec.structs.replace(loaded(engine, "1", "default"), canary=canary))
    (out,) = await feed(v, *inputs, published("1"))
    if outcome == "mismatch":
        assert isinstance(out, PublicationMismatch)
        (bad,) = out.mismatches
        assert (bad.tensor, bad.expected) == (CANARY_TENSOR, "c1")
        assert bad.engine in [e for e, c in engine_canaries.items() if c != "c1"]
        assert "did not apply the payload" in bad.reason
    else:
        assert isinstance(out, PublicationVerified) and out.write_proof == outcome


async def test_a_log_without_canaries_verifies_by_digests():
    v = verifier(Path("."))
    (out,) = await feed(
        v, staged("1"), loaded("engine-0", "1", "default"), published("1", engines=("engine-0",))
    )
    assert isinstance(out, PublicationVerified) and out.write_proof == "none"


PROBE = ProbeBatch(prompt_ids=[[1, 2], [3, 4]], response_ids=[[5], [6]], logprobs=[[-1.0], [-2.5]])


@pytest.mark.parametrize(
    ("answers", "outcome"),
    [
        # The same weights, up to float rounding: verified, with the largest difference.
        ({"engine-0": [[-1.0], [-2.5]], "engine-1": [[-1.0004], [-2.5]]}, "verified"),
        # One engine serves other weights where its digest cannot look.
        ({"engine-0": [[-1.0], [-2.5]], "engine-1": [[-1.3], [-2.5]]}, "differ by up to 0.3"),
        ({"engine-0": [[-1.0], [-2.5]], "engine-1": [[float("nan")], [-2.5]]}, "differ by up to inf"),
        ({"engine-0": [[-1.0], [-2.5]], "engine-1": [[-1.0]]}, "differ by up to inf"),
        ({"engine-0": [[-1.0], [-2.5]], "engine-1": None}, "did not answer"),
    ],
)
async def test_a_probed_publication_needs_every_engines_logprobs_within_the_tolerance(
    tmp_path, answers, outcome
):
    v = verifier(tmp_path, probe_tolerance=0.01)
    inputs: list = [msgspec.structs.replace(staged("1"), probe=PROBE)]
    for engine, answer in answers.items():
        inputs.append(msgspec.structs.replace(loaded(engine, "1", "default"), probe_logprobs=answer))
    (out,) = await feed(v, *inputs, published("1"))
    if outcome == "verified":
        assert isinstance(out, PublicationVerified)
        assert out.probe_max_diff == pytest.approx(0.0004)
    else:
        assert isinstance(out, PublicationMismatch), "equal digests are not enough"
        (bad,) = out.mismatches
        assert (bad.engine, bad.tensor) == ("engine-1", PROBE_TENSOR)
        assert outcome in bad.reason


async def test_an_unprobed_publication_says_so():
    v = verifier(Path("."))
    (out,) = await feed(
        v, staged("1"), loaded("engine-0", "1", "default"), published("1", engines=("engine-0",))
    )
    assert isinstance(out, PublicationVerified) and out.probe_max_diff is None


# --- engines that heal (run.ft_components) ------------------------------------------------


def healing(engines: int = 2) -> Config:
    return msgspec.structs.replace(
        config(engines), run=msgspec.structs.replace(Config().run, ft_components=["rollout"])
    )


async def test_healing_keeps_the_last_publication_until_the_next_one_is_through():
    """A restarted engine loads the last publication again: its data is released only once
    the next publication is through (without healing, at once)."""
    p = publisher(healing())
    ref = lambda v: DataRef("shm", f"weights-v{v}", "trainer")  # noqa: E731
    first = msgspec.structs.replace(staged("1"), weights=ref(1))
    out = await feed(
        p,
        started(),
        PublishRequested(),
        first,
        loaded("engine-0", "1", "default"),
        loaded("engine-1", "1", "default"),
    )
    assert not [e for e in out if isinstance(e, DataReleased)], "the served publication is kept"
    second = msgspec.structs.replace(staged("2"), weights=ref(2))
    out = await feed(
        p, PublishRequested(rollout_id=0), second, loaded("engine-0", "2", "1"), loaded("engine-1", "2", "1")
    )
    assert [e.ref for e in out if isinstance(e, DataReleased)] == [ref(1)]


async def test_a_restored_load_is_not_part_of_a_publication():
    p = publisher(healing())
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    restore = msgspec.structs.replace(loaded("engine-1", "1", "default"), restore=True)
    assert await feed(p, restore) == [], "only the saga's own loads complete it"


async def test_a_publication_goes_on_without_a_suspended_engine_and_counts_it_again_once_resumed():
    p = publisher(healing())
    await feed(
        p,
        started(),
        PublishRequested(),
        staged("1"),
        loaded("engine-0", "1", "default"),
        loaded("engine-1", "1", "default"),
    )
    out = await feed(
        p,
        CellSuspended(cell="rollout-1"),
        PublishRequested(rollout_id=0),
        staged("2"),
        loaded("engine-0", "2", "1"),
    )
    (published_event,) = [e for e in out if isinstance(e, WeightsPublished)]
    assert published_event.engines == ["engine-0"] and published_event.previous_versions == ["1"]
    # Resumed with version 2, engine-1 takes part in publication 3 again, from version 2.
    out = await feed(
        p,
        CellResumed(cell="rollout-1", pid=7, weight_version="2"),
        PublishRequested(rollout_id=1),
        staged("3"),
        loaded("engine-0", "3", "2"),
    )
    assert not [e for e in out if isinstance(e, WeightsPublished)], "engine-1 is waited for again"
    out = await feed(p, loaded("engine-1", "3", "2"))
    assert [e.engines for e in out if isinstance(e, WeightsPublished)] == [["engine-0", "engine-1"]]


async def test_an_engine_suspended_mid_publication_completes_it_with_the_others():
    p = publisher(healing())
    await feed(p, started(), PublishRequested(), staged("1"), loaded("engine-0", "1", "default"))
    out = await feed(p, CellSuspended(cell="rollout-1"))
    assert [e.engines for e in out if isinstance(e, WeightsPublished)] == [["engine-0"]]


async def test_a_restored_engine_is_verified_against_the_last_verified_publication(tmp_path):
    v = verifier(tmp_path)
    first = msgspec.structs.replace(staged("1"), canary="c1")
    good = msgspec.structs.replace(loaded("engine-0", "1", "default"), canary="c1")
    await feed(v, first, good, msgspec.structs.replace(good, engine="engine-1"), published("1"))
    restored = msgspec.structs.replace(good, engine="engine-1", restore=True)
    (out,) = await feed(v, restored)
    assert isinstance(out, RestoreVerified)
    assert (out.engine, out.weight_version, out.write_proof) == ("engine-1", "1", "canary")
    stale = msgspec.structs.replace(restored, canary="c0")
    (out,) = await feed(v, stale)
    assert isinstance(out, PublicationMismatch)
    assert [(m.engine, m.tensor) for m in out.mismatches] == [("engine-1", CANARY_TENSOR)]
