"""The Coordinator's opening protocols as state machines, transition by transition: each
state, the fact it waits on, the command it returns, and its failure edges."""

from __future__ import annotations

import pytest

from actors.protocols.opening import (
    InitialPublication,
    InitialState,
    ProofState,
    RolloutOnlyProof,
    UpdateCheck,
    UpdateCheckState,
    opening_protocol,
)
from actors.protocols.steps import (
    DONE,
    IGNORED,
    PUBLISHED,
    STARTED,
    ChecksFinished,
    EngineReplies,
    EvidenceWritten,
    Failed,
)
from miles_events.rl.checksum_manifest import ManifestError
from miles_events.rl.publication_checks import checksum_digest
from schemas.config import Config, RunConfig, VerifierConfig
from schemas.events import (
    PublicationEvidenceRequested,
    PublishRequested,
    WeightsCheckFinished,
    WeightsCheckRequested,
)
from schemas.plan import RunPlan

ENGINES = ("engine-0", "engine-1")


def replies(
    request_id: str, action: str, success: bool = True, message: str = "", **fields
) -> ChecksFinished:
    return ChecksFinished(tuple(
        WeightsCheckFinished(engine=engine, action=action, success=success, message=message, request_id=request_id,
                             **fields)
        for engine in ENGINES
    ))  # fmt: skip


# --- EngineReplies ---------------------------------------------------------------------------


def test_a_check_is_finished_once_every_engine_answered_it_in_engine_order():
    check = EngineReplies("r", ENGINES)
    second = WeightsCheckFinished(engine="engine-1", action="snapshot", success=True, request_id="r")
    first = WeightsCheckFinished(engine="engine-0", action="snapshot", success=True, request_id="r")
    assert not check.add(second)
    assert not check.add(
        WeightsCheckFinished(engine="engine-0", action="snapshot", success=True, request_id="other")
    )
    assert check.add(first)
    assert check.finished() == ChecksFinished((first, second))


# --- InitialPublication ----------------------------------------------------------------------


def test_the_initial_publication_publishes_then_is_done():
    protocol = InitialPublication()
    assert protocol.step(STARTED) == PublishRequested(rollout_id=None)
    assert protocol.state is InitialState.PUBLISHING
    assert protocol.step(PUBLISHED) is DONE
    assert protocol.state is InitialState.DONE


def test_the_initial_publication_ignores_what_it_does_not_wait_on():
    protocol = InitialPublication()
    assert protocol.step(PUBLISHED) is IGNORED and protocol.state is InitialState.READY
    protocol.step(STARTED)
    assert protocol.step(STARTED) is IGNORED and protocol.step(EvidenceWritten("p")) is IGNORED
    assert protocol.state is InitialState.PUBLISHING
    protocol.step(PUBLISHED)
    assert protocol.step(PUBLISHED) is IGNORED and protocol.state is InitialState.DONE


# --- UpdateCheck (check_weight_update_equal) -------------------------------------------------


VERIFIER = VerifierConfig(
    check_weight_update_equal=True,
    check_weight_update_selector="target",
    check_weight_update_skip_list=["lm_head"],
    check_weight_update_allow_quant_error=True,
)


def update_replies(action: str, success: bool = True, message: str = "") -> ChecksFinished:
    return replies(f"check_weight_update_equal:{action}", action, success, message)


def test_the_update_check_is_snapshot_reset_publish_compare():
    protocol = UpdateCheck(VERIFIER, resumed=False)
    snapshot = protocol.step(STARTED)
    assert snapshot == WeightsCheckRequested(
        action="snapshot",
        selector="target",
        skip_tensor_list=["lm_head"],
        allow_quant_error=True,
        request_id="check_weight_update_equal:snapshot",
    )
    assert protocol.state is UpdateCheckState.SNAPSHOT
    reset = protocol.step(update_replies("snapshot"))
    assert isinstance(reset, WeightsCheckRequested) and reset.action == "reset_tensors"
    assert reset.request_id == "check_weight_update_equal:reset_tensors"
    assert protocol.state is UpdateCheckState.RESET_TENSORS
    assert protocol.step(update_replies("reset_tensors")) == PublishRequested(rollout_id=None)
    assert protocol.state is UpdateCheckState.PUBLISHING
    compare = protocol.step(PUBLISHED)
    assert isinstance(compare, WeightsCheckRequested) and compare.action == "compare"
    assert protocol.state is UpdateCheckState.COMPARE
    assert protocol.step(update_replies("compare")) is DONE
    assert protocol.state is UpdateCheckState.DONE


def test_a_resumed_update_check_resets_publishes_and_compares_nothing():
    protocol = UpdateCheck(VERIFIER, resumed=True)
    reset = protocol.step(STARTED)
    assert isinstance(reset, WeightsCheckRequested) and reset.action == "reset_tensors"
    assert protocol.step(update_replies("reset_tensors")) == PublishRequested(rollout_id=None)
    assert protocol.step(PUBLISHED) is DONE and protocol.state is UpdateCheckState.DONE


@pytest.mark.parametrize("action", ["snapshot", "reset_tensors", "compare"])
def test_an_update_check_step_that_fails_on_an_engine_fails_naming_it(action):
    protocol = UpdateCheck(VERIFIER, resumed=False)
    protocol.step(STARTED)
    for before in ("snapshot", "reset_tensors", "compare")[
        : ("snapshot", "reset_tensors", "compare").index(action)
    ]:
        protocol.step(update_replies(before))
        if before == "reset_tensors":
            protocol.step(PUBLISHED)
    failed = ChecksFinished((
        WeightsCheckFinished(engine="engine-0", action=action, success=True, request_id=f"check_weight_update_equal:{action}"),
        WeightsCheckFinished(engine="engine-1", action=action, success=False, message="3 tensors differ",
                             request_id=f"check_weight_update_equal:{action}"),
    ))  # fmt: skip
    assert protocol.step(failed) == Failed(
        f"inference weight check {action!r} did not succeed on every engine: engine-1: 3 tensors differ"
    )
    assert protocol.state is UpdateCheckState.FAILED
    assert protocol.step(PUBLISHED) is IGNORED and protocol.step(update_replies(action)) is IGNORED


def test_the_update_check_ignores_replies_to_another_check_and_early_publications():
    protocol = UpdateCheck(VERIFIER, resumed=False)
    assert protocol.step(update_replies("snapshot")) is IGNORED and protocol.state is UpdateCheckState.READY
    protocol.step(STARTED)
    assert protocol.step(update_replies("compare")) is IGNORED
    assert protocol.step(PUBLISHED) is IGNORED
    assert protocol.state is UpdateCheckState.SNAPSHOT


# --- RolloutOnlyProof ------------------------------------------------------------------------


MANIFESTS = {
    "base": {"rank0/a": "1", "rank0/b": "2"},
    "served": {"rank0/a": "3", "rank0/b": "2"},
    "reset": {"rank0/a": "5", "rank0/b": "6"},
}


def read(manifest: str, digest: str) -> dict[str, str]:
    if manifest not in MANIFESTS:
        raise ManifestError(f"{manifest}: no such manifest")
    return MANIFESTS[manifest]


def proof(**overrides) -> RolloutOnlyProof:
    fields = dict(
        read_manifest=read,
        evidence_path="/tmp/evidence.json",
        effective_load="/ckpt",
        reference="/hf",
        checkpoint_iteration=2,
    )
    return RolloutOnlyProof(**{**fields, **overrides})


def proof_replies(
    step: str, manifest: str = "", version: str = "default", success: bool = True, message: str = ""
) -> ChecksFinished:
    action = {"snapshot": "snapshot", "reset_tensors": "reset_tensors", "compare": "compare"}.get(
        step, "checksum"
    )
    return replies(
        f"rollout_only:{step}",
        action,
        success,
        message,
        checksums_manifest=manifest,
        digest="d",
        weight_version=version,
    )


def checked(command, action: str, step: str) -> bool:
    return (
        isinstance(command, WeightsCheckRequested)
        and command.action == action
        and command.request_id == f"rollout_only:{step}"
        and not command.allow_quant_error
    )


PROOF_FACTS = [
    (ProofState.READY, STARTED, ProofState.BASE),
    (ProofState.BASE, proof_replies("base", "base"), ProofState.PUBLISHING),
    (ProofState.PUBLISHING, PUBLISHED, ProofState.SERVED),
    (ProofState.SERVED, proof_replies("served", "served", "1"), ProofState.SNAPSHOT),
    (ProofState.SNAPSHOT, proof_replies("snapshot", version="1"), ProofState.RESET_TENSORS),
    (ProofState.RESET_TENSORS, proof_replies("reset_tensors", version="1"), ProofState.RESET),
    (ProofState.RESET, proof_replies("reset", "reset", "1"), ProofState.REPUBLISHING),
    (ProofState.REPUBLISHING, PUBLISHED, ProofState.COMPARE),
    (ProofState.COMPARE, proof_replies("compare", version="2"), ProofState.REPUBLISHED),
    (ProofState.REPUBLISHED, proof_replies("republished", "served", "2"), ProofState.EVIDENCE),
    (ProofState.EVIDENCE, EvidenceWritten("/tmp/evidence.json"), ProofState.DONE),
]


def proof_at(state: ProofState, **overrides) -> RolloutOnlyProof:
    """A proof driven through every step before ``state``."""
    protocol = proof(**overrides)
    for before, fact, _ in PROOF_FACTS:
        if before is state:
            break
        protocol.step(fact)
    assert protocol.state is state
    return protocol


def test_the_proof_goes_through_every_step_of_the_seed():
    protocol = proof()
    commands = []
    for before, fact, after in PROOF_FACTS:
        assert protocol.state is before
        commands.append(protocol.step(fact))
        assert protocol.state is after
    assert checked(commands[0], "checksum", "base")
    assert commands[1] == PublishRequested(rollout_id=None)
    assert checked(commands[2], "checksum", "served")
    assert checked(commands[3], "snapshot", "snapshot")
    assert checked(commands[4], "reset_tensors", "reset_tensors")
    assert checked(commands[5], "checksum", "reset")
    assert commands[6] == PublishRequested(rollout_id=None)
    assert checked(commands[7], "compare", "compare")
    assert checked(commands[8], "checksum", "republished")
    evidence = commands[9]
    assert isinstance(evidence, PublicationEvidenceRequested) and evidence.path == "/tmp/evidence.json"
    assert evidence.evidence.checkpoint_iteration == 2 and evidence.evidence.engine_count == 2
    assert evidence.evidence.served_weight_versions == ["1", "1"]
    assert evidence.evidence.republished_weight_versions == ["2", "2"]
    served = ((("rank0/a", "3"), ("rank0/b", "2")),) * 2
    assert evidence.evidence.served_language_checksum_sha256 == checksum_digest(served)
    assert commands[10] is DONE


@pytest.mark.parametrize("state", [s for s, _, _ in PROOF_FACTS])
def test_each_proof_state_ignores_every_fact_but_its_own(state):
    protocol = proof_at(state)
    own = next(fact for s, fact, _ in PROOF_FACTS if s is state)
    for _, fact, _ in PROOF_FACTS:
        if fact != own:
            assert protocol.step(fact) is IGNORED, fact
    assert protocol.state is state


@pytest.mark.parametrize(
    ("state", "fact", "message"),
    [
        (
            ProofState.BASE,
            proof_replies("base", success=False, message="not supported"),
            "inference weight checksum did not succeed: not supported",
        ),
        (
            ProofState.BASE,
            proof_replies("base", "gone"),
            "inference weight checksum of engine-0: gone: no such manifest",
        ),
        (
            ProofState.BASE,
            proof_replies("base", "base", version=""),
            "inference weight version is invalid: ''",
        ),
        (
            ProofState.SERVED,
            proof_replies("served", "base", "1"),
            "checkpoint-backed rollout publication left every language tensor identical to the HF bootstrap",
        ),
        (
            ProofState.SERVED,
            proof_replies("served", "served", "2"),
            "initial checkpoint publication did not transition every inference weight version from 'default' to '1'",
        ),
        (
            ProofState.SNAPSHOT,
            proof_replies("snapshot", success=False),
            "inference weight check 'snapshot' did not succeed on every engine",
        ),
        (
            ProofState.RESET_TENSORS,
            proof_replies("reset_tensors", success=False),
            "inference weight check 'reset_tensors' did not succeed on every engine",
        ),
        (
            ProofState.RESET,
            proof_replies("reset", "served", "1"),
            "inference weight reset left every selected language tensor unchanged",
        ),
        (
            ProofState.COMPARE,
            proof_replies("compare", version="1"),
            "checkpoint republication did not increment every inference weight version exactly once",
        ),
        (
            ProofState.COMPARE,
            proof_replies("compare", version="2", success=False),
            "inference weight check 'compare' did not succeed on every engine",
        ),
        (
            ProofState.REPUBLISHED,
            proof_replies("republished", "reset", "2"),
            "checkpoint-backed rollout weights changed across exact republication",
        ),
    ],
    ids=[
        "checksum",
        "manifest",
        "version",
        "no-op load",
        "versions",
        "snapshot",
        "reset",
        "no-op reset",
        "increment",
        "compare",
        "republished",
    ],
)
def test_each_failed_proof_step_fails_with_the_seeds_message_and_then_ignores_everything(
    state, fact, message
):
    protocol = proof_at(state)
    command = protocol.step(fact)
    assert isinstance(command, Failed) and command.reason.startswith(message), command
    assert protocol.state is ProofState.FAILED
    assert all(protocol.step(f) is IGNORED for _, f, _ in PROOF_FACTS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"effective_load": None}, "rollout-only from a checkpoint without a loaded checkpoint root"),
        ({"checkpoint_iteration": None}, "rollout-only from a checkpoint without a loaded checkpoint root"),
        ({"evidence_path": None}, "run.rollout_only_publication_evidence is unset"),
    ],
)
def test_a_proof_with_nothing_to_write_its_evidence_about_fails_at_the_evidence(overrides, message):
    protocol = proof_at(ProofState.REPUBLISHED, **overrides)
    assert protocol.step(proof_replies("republished", "served", "2")) == Failed(message)
    assert protocol.state is ProofState.FAILED


# --- which opening -----------------------------------------------------------------------------


def plan(**fields) -> RunPlan:
    return RunPlan(start_rollout_id=0, num_rollout=2, num_rollout_per_epoch=None, engines=ENGINES, **fields)


def test_the_config_chooses_the_opening():
    assert isinstance(opening_protocol(Config(), plan(), read), InitialPublication)
    checking = Config(verifier=VerifierConfig(check_weight_update_equal=True))
    assert isinstance(opening_protocol(checking, plan(), read), UpdateCheck)
    assert opening_protocol(checking, plan(resumed=True), read).resumed
    rollout_only = Config(
        run=RunConfig(
            load="/ckpt", rollout_only_from_checkpoint=True, rollout_only_publication_evidence="/tmp/e.json"
        )
    )
    proof_opening = opening_protocol(rollout_only, plan(rollout_only=True, checkpoint_iteration=3), read)
    assert isinstance(proof_opening, RolloutOnlyProof)
    assert (proof_opening.effective_load, proof_opening.checkpoint_iteration) == ("/ckpt", 3)
