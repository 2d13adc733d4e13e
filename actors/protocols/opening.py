"""The opening of a run: the protocols around its first publication, before the loop's
first rollout, each a state machine (``steps`` says what a step takes and returns).

- ``InitialPublication``: the seed's "always update weights first": publish, done.
- ``UpdateCheck`` (``verifier.check_weight_update_equal``): the seed's check, as miles
  does it in its placement step: snapshot, reset, publish, compare; a resumed run resets
  and publishes (its engines hold no snapshot of the checkpoint to compare with).
- ``RolloutOnlyProof`` (``run.rollout_only_from_checkpoint``): the seed's
  checkpoint-backed proof (``miles_events.rl.checkpoint_rollout``): checksums, publish,
  checksums, snapshot, reset, checksums, republish, compare, checksums, then the evidence
  file.

Every publication of the opening is ``PublishRequested(rollout_id=None)``; the kind of it
(the initial publication, or the proof's publication and republication) is the state of the
protocol that asked for it. The request ids of the weight checks are those of the recorded
runs (``check_weight_update_equal:<action>``, ``rollout_only:<step>``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping

from actors.protocols.steps import (
    DONE,
    IGNORED,
    ChecksFinished,
    Command,
    EvidenceWritten,
    Fact,
    Failed,
    Published,
    Started,
)
from miles_events.rl.checkpoint_rollout import CheckpointRolloutProof
from miles_events.rl.checksum_manifest import ManifestError
from miles_events.rl.publication_checks import (
    CanonicalChecksums,
    canonical_checksums,
    canonical_weight_versions,
)
from schemas.checksums import CheckAction, TensorCheckAction
from schemas.config import Config, VerifierConfig
from schemas.events import (
    PublicationEvidenceRequested,
    PublishRequested,
    WeightsCheckFinished,
    WeightsCheckRequested,
)
from schemas.evidence import CHECKPOINT_ROLLOUT_SELECTOR, CHECKPOINT_ROLLOUT_SKIP_LIST
from schemas.plan import RunPlan

ManifestReader = Callable[[str, str], Mapping[str, str]]
"""(manifest path, digest) -> the manifest's checksums; raises ``ManifestError``."""


# --- "always update weights first" -----------------------------------------------------


class InitialState(enum.Enum):
    READY = "ready"
    PUBLISHING = "publishing"
    DONE = "done"


class InitialPublication:
    """Publish the trainer's weights so that the engines serve what it holds."""

    def __init__(self) -> None:
        self.state = InitialState.READY

    def step(self, fact: Fact) -> Command:
        if self.state is InitialState.READY and isinstance(fact, Started):
            self.state = InitialState.PUBLISHING
            return PublishRequested(rollout_id=None)
        if self.state is InitialState.PUBLISHING and isinstance(fact, Published):
            self.state = InitialState.DONE
            return DONE
        return IGNORED


# --- check_weight_update_equal ---------------------------------------------------------


class UpdateCheckState(enum.Enum):
    """Each checking state's value is the weight-checker action it waits on."""

    READY = "ready"
    SNAPSHOT = "snapshot"
    RESET_TENSORS = "reset_tensors"
    PUBLISHING = "publishing"
    COMPARE = "compare"
    DONE = "done"
    FAILED = "failed"


_UPDATE_ACTIONS: dict[UpdateCheckState, TensorCheckAction] = {
    UpdateCheckState.SNAPSHOT: "snapshot",
    UpdateCheckState.RESET_TENSORS: "reset_tensors",
    UpdateCheckState.COMPARE: "compare",
}
"""The weight-checker action of each checking state of ``check_weight_update_equal``."""


_UPDATE_CHECKS = (UpdateCheckState.SNAPSHOT, UpdateCheckState.RESET_TENSORS, UpdateCheckState.COMPARE)


class UpdateCheck:
    """The seed's ``check_weight_update_equal``: the first publication must write every
    checked tensor. Every engine snapshots its weights and resets them; after the publication
    each compares what it serves with the snapshot. Any engine's failure fails the run."""

    def __init__(self, verifier: VerifierConfig, *, resumed: bool) -> None:
        self.verifier = verifier
        self.resumed = resumed
        self.state = UpdateCheckState.READY

    def step(self, fact: Fact) -> Command:
        state = self.state
        if state is UpdateCheckState.READY and isinstance(fact, Started):
            return self._check(UpdateCheckState.RESET_TENSORS if self.resumed else UpdateCheckState.SNAPSHOT)
        if state is UpdateCheckState.PUBLISHING and isinstance(fact, Published):
            if self.resumed:
                self.state = UpdateCheckState.DONE
                return DONE
            return self._check(UpdateCheckState.COMPARE)
        if (
            state in _UPDATE_CHECKS
            and isinstance(fact, ChecksFinished)
            and _answers(fact, self._request_id(state))
        ):
            return self._checked(state, fact.replies)
        return IGNORED

    def _checked(self, state: UpdateCheckState, replies: tuple[WeightsCheckFinished, ...]) -> Command:
        failed = [reply for reply in replies if not reply.success]
        if failed:
            self.state = UpdateCheckState.FAILED
            first = failed[0]
            return Failed(
                f"inference weight check {state.value!r} did not succeed on every engine: {first.engine}: {first.message}"
            )
        if state is UpdateCheckState.SNAPSHOT:
            return self._check(UpdateCheckState.RESET_TENSORS)
        if state is UpdateCheckState.RESET_TENSORS:
            self.state = UpdateCheckState.PUBLISHING
            return PublishRequested(rollout_id=None)
        self.state = UpdateCheckState.DONE  # compare: the first publication wrote every checked tensor
        return DONE

    @staticmethod
    def _request_id(state: UpdateCheckState) -> str:
        return f"check_weight_update_equal:{state.value}"

    def _check(self, state: UpdateCheckState) -> WeightsCheckRequested:
        self.state = state
        verifier = self.verifier
        return WeightsCheckRequested(
            action=_UPDATE_ACTIONS[state],
            selector=verifier.check_weight_update_selector,
            skip_tensor_list=list(verifier.check_weight_update_skip_list),
            allow_quant_error=verifier.check_weight_update_allow_quant_error,
            request_id=self._request_id(state),
        )


# --- rollout-only from a checkpoint ----------------------------------------------------


class ProofState(enum.Enum):
    """Each checking state's value is its step's name (the request id's tail)."""

    READY = "ready"
    BASE = "base"
    """Checksums of what the engines serve at start (the bootstrap)."""
    PUBLISHING = "publishing"
    """The checkpoint's publication."""
    SERVED = "served"
    """Checksums of what the engines serve after it."""
    SNAPSHOT = "snapshot"
    RESET_TENSORS = "reset_tensors"
    RESET = "reset"
    """Checksums after the reset."""
    REPUBLISHING = "republishing"
    """The same weights published again."""
    COMPARE = "compare"
    REPUBLISHED = "republished"
    """Checksums after the republication."""
    EVIDENCE = "evidence"
    DONE = "done"
    FAILED = "failed"


_PROOF_ACTIONS: dict[ProofState, CheckAction] = {
    ProofState.BASE: "checksum",
    ProofState.SERVED: "checksum",
    ProofState.SNAPSHOT: "snapshot",
    ProofState.RESET_TENSORS: "reset_tensors",
    ProofState.RESET: "checksum",
    ProofState.COMPARE: "compare",
    ProofState.REPUBLISHED: "checksum",
}
"""The weight-checker action each checking state waits on."""


class RolloutOnlyProof:
    """The seed's proof that the engines serve exactly the checkpoint the run loaded. Each
    failed check fails the run with the seed's message (``CheckpointRolloutProof``)."""

    def __init__(
        self,
        *,
        read_manifest: ManifestReader,
        evidence_path: str | None,
        effective_load: str | None,
        reference: str | None,
        checkpoint_iteration: int | None,
    ) -> None:
        self.read_manifest = read_manifest
        self.evidence_path = evidence_path
        self.effective_load = effective_load
        self.reference = reference
        self.checkpoint_iteration = checkpoint_iteration
        self.record = CheckpointRolloutProof()
        self.state = ProofState.READY

    def step(self, fact: Fact) -> Command:
        try:
            return self._step(fact)
        except RuntimeError as error:  # the seed's checks, with the seed's messages
            self.state = ProofState.FAILED
            return Failed(str(error))

    def _step(self, fact: Fact) -> Command:
        state = self.state
        if state is ProofState.READY and isinstance(fact, Started):
            return self._check(ProofState.BASE)
        if state is ProofState.PUBLISHING and isinstance(fact, Published):
            return self._check(ProofState.SERVED)
        if state is ProofState.REPUBLISHING and isinstance(fact, Published):
            return self._check(ProofState.COMPARE)
        if state is ProofState.EVIDENCE and isinstance(fact, EvidenceWritten):
            self.state = ProofState.DONE
            return DONE
        if (
            state in _PROOF_ACTIONS
            and isinstance(fact, ChecksFinished)
            and _answers(fact, self._request_id(state))
        ):
            return self._checked(state, fact.replies)
        return IGNORED

    def _checked(self, state: ProofState, replies: tuple[WeightsCheckFinished, ...]) -> Command:
        record = self.record
        if state is ProofState.BASE:
            record.record_base(*self._checksums(replies))
            return self._publish(ProofState.PUBLISHING)
        if state is ProofState.SERVED:
            record.record_served(*self._checksums(replies))
            return self._check(ProofState.SNAPSHOT)
        if state is ProofState.RESET:
            record.record_reset(self._checksums(replies)[0])
            return self._publish(ProofState.REPUBLISHING)
        if state is ProofState.REPUBLISHED:
            record.record_republished(self._checksums(replies)[0])
            return self._evidence()
        if state is ProofState.COMPARE:
            # The seed reads the versions right after the republication, before comparing.
            record.record_republished_versions(
                canonical_weight_versions([reply.weight_version for reply in replies])
            )
        if not all(reply.success for reply in replies):
            raise RuntimeError(
                f"inference weight check {_PROOF_ACTIONS[state]!r} did not succeed on every engine"
            )
        if state is ProofState.SNAPSHOT:
            return self._check(ProofState.RESET_TENSORS)
        if state is ProofState.RESET_TENSORS:
            return self._check(ProofState.RESET)
        return self._check(ProofState.REPUBLISHED)  # compare

    def _checksums(
        self, replies: tuple[WeightsCheckFinished, ...]
    ) -> tuple[CanonicalChecksums, tuple[str, ...]]:
        """The canonical checksums the replies' manifests hold, and the engines' versions."""
        engines = []
        for reply in replies:
            if not reply.success:
                raise RuntimeError(
                    f"inference weight checksum did not succeed: {reply.message or 'no ranks'}"
                )
            try:
                engines.append(self.read_manifest(reply.checksums_manifest, reply.digest))
            except ManifestError as error:
                raise RuntimeError(f"inference weight checksum of {reply.engine}: {error}") from None
        return canonical_checksums(engines), canonical_weight_versions(
            [reply.weight_version for reply in replies]
        )

    def _evidence(self) -> PublicationEvidenceRequested:
        if self.effective_load is None or self.reference is None or self.checkpoint_iteration is None:
            raise RuntimeError("rollout-only from a checkpoint without a loaded checkpoint root")
        if self.evidence_path is None:
            raise RuntimeError("run.rollout_only_publication_evidence is unset")
        self.state = ProofState.EVIDENCE
        evidence = self.record.evidence(
            effective_load=self.effective_load,
            ref_load=self.reference,
            checkpoint_iteration=self.checkpoint_iteration,
        )
        return PublicationEvidenceRequested(path=self.evidence_path, evidence=evidence)

    def _publish(self, state: ProofState) -> PublishRequested:
        self.state = state
        return PublishRequested(rollout_id=None)

    @staticmethod
    def _request_id(state: ProofState) -> str:
        return f"rollout_only:{state.value}"

    def _check(self, state: ProofState) -> WeightsCheckRequested:
        self.state = state
        return WeightsCheckRequested(
            action=_PROOF_ACTIONS[state],
            selector=CHECKPOINT_ROLLOUT_SELECTOR,
            skip_tensor_list=list(CHECKPOINT_ROLLOUT_SKIP_LIST),
            allow_quant_error=False,
            request_id=self._request_id(state),
        )


def _answers(fact: ChecksFinished, request_id: str) -> bool:
    """Whether ``fact`` answers the check ``request_id``."""
    return all(reply.request_id == request_id for reply in fact.replies)


Opening = InitialPublication | UpdateCheck | RolloutOnlyProof


def opening_protocol(config: Config, plan: RunPlan, read_manifest: ManifestReader) -> Opening:
    """The opening the run's config asks for (the config refuses both checks at once)."""
    run = config.run
    if plan.rollout_only:
        return RolloutOnlyProof(
            read_manifest=read_manifest,
            evidence_path=run.rollout_only_publication_evidence,
            effective_load=run.load or run.ref_load,
            reference=run.ref_load or config.model.path,
            checkpoint_iteration=plan.checkpoint_iteration,
        )
    if config.verifier.check_weight_update_equal:
        return UpdateCheck(config.verifier, resumed=plan.resumed)
    return InitialPublication()
