"""The Coordinator: the seed's training loop (``train.py``) written as reactions.

Read top to bottom, the handlers are the loop:

    RunStarted               -> publish the initial weights ("always update weight first")
    publication verified     -> eval-only / eval before train / first rollout;
                                after rollout k: periodic eval, then rollout k+1 or finish
    EvalFinished             -> whatever was waiting on the eval
    TrainStepFinished(k)     -> save if periodic / last / sentinel (removing it), then publish
                                (a save due while the last is being written waits for it)
    CheckpointSaved          -> the save (and publication) waiting for it; finish once
                                nothing is pending
    StopRequested            -> after the current step's publication (or eval): save that
                                step unless it was saved, then finish
    rollout-only             -> the seed's checkpoint-backed proof (checksums, publish,
                                checksums, snapshot, reset, checksums, republish, compare,
                                checksums, evidence), then rollouts only: RolloutGenerated(k)
                                -> rollout k+1 or finish
    StopRequested            -> finish at the next decision, after the current step
    failure facts            -> RunFinished(failed) with one clear line

The Coordinator holds no model and calls no actor: it reads facts and publishes commands.
It runs in the driver, so it alone touches the sentinel file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio.to_thread

from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.rl.checkpoint_rollout import CheckpointRolloutProof
from miles_events.rl.checksum_manifest import ManifestError, read_manifest
from miles_events.rl.publication_checks import (
    CanonicalChecksums,
    canonical_checksums,
    canonical_weight_versions,
)
from miles_events.rl.versions import version_number
from schemas.config import Config
from schemas.events import (
    ActorFailed,
    CheckpointFailed,
    CheckpointSaved,
    DataReleased,
    EvalFinished,
    EvalRequested,
    PublicationEvidenceFailed,
    PublicationEvidenceRequested,
    PublicationEvidenceWritten,
    PublicationFailed,
    PublicationMismatch,
    PublicationVerified,
    PublishRequested,
    RolloutGenerated,
    RolloutRequested,
    RunFinished,
    RunStarted,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TrainStepFinished,
    WeightsCheckFinished,
    WeightsCheckRequested,
    WeightsLoaded,
    WeightsPublished,
    run_started,
)
from schemas.evidence import CHECKPOINT_ROLLOUT_SELECTOR, CHECKPOINT_ROLLOUT_SKIP_LIST

logger = logging.getLogger(__name__)


def should_run_periodic_action(
    rollout_id: int,
    interval: int | None,
    num_rollout_per_epoch: int | None = None,
    num_rollout: int | None = None,
) -> bool:
    """As in miles: every ``interval`` rollouts, at each epoch end, and (when ``num_rollout``
    is given) on the last rollout."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)


@dataclass
class PendingCheck:
    """A weight-checker action in flight: who asked, and what follows once all answered."""

    request_id: str
    then: Callable[[list[WeightsCheckFinished]], Awaitable[None]]
    replies: dict[str, WeightsCheckFinished] = field(default_factory=dict)


# Everything the loop may ask for once a publication (or the eval after it) is through.
AFTER_PUBLICATION = (EvalRequested, RolloutRequested, RunFinished, SaveRequested, WeightsCheckRequested)


class Coordinator(Actor):
    name = "coordinator"
    emits = (RunStarted,)

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        # The loop runs in the driver, beside the bus, and alone touches the sentinel file.
        return WorkerGroup(role="driver")

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        plan = self.plan = context.plan
        self.run = config.run
        self._after_eval: Callable[[], object] | None = None
        self._pending_saves: set[int] = set()
        self._save_waiting: tuple[int, str] | None = None
        """A step's save (rollout id, reason) due while the last save was being written."""
        self._saved: set[int] = set()
        """Rollouts a save was asked for."""
        self._finishing: RunFinished | None = None
        self._check: PendingCheck | None = None
        """The weight check in flight."""
        self._proof = CheckpointRolloutProof()
        self._proof_step = ""
        """Rollout-only: the step of the checkpoint-backed proof in progress ("done" after it)."""
        self._compared = False
        self._stop: str | None = None
        """Why a stop was asked for: the run finishes after the current step."""
        self.finished: RunFinished | None = None
        self.last_rollout_id = plan.start_rollout_id - 1
        self.weight_version = plan.weight_version
        self.served = dict.fromkeys(plan.engines, "default")
        """The version each engine serves, from its ``WeightsLoaded``."""

    # -- the loop ---------------------------------------------------------------------

    async def ready(self) -> None:
        """Every actor has started: the run begins."""
        await self.publish(run_started(self.plan))

    @handles(RunStarted, emits=(PublishRequested, WeightsCheckRequested))
    async def on_run_started(self, event: RunStarted) -> None:
        if self.plan.rollout_only:
            # The seed's checkpoint-backed protocol starts from the bootstrap's checksums.
            await self._proof_check("checksum", "base")
        elif self.config.verifier.check_weight_update_equal:
            # The seed's check: snapshot, reset, publish, compare (miles snapshots and
            # resets in its placement step, before the first publication).
            await self._update_check("reset_tensors" if self.plan.resumed else "snapshot")
        else:
            # Always update weights first, so the engines serve what the trainer holds.
            await self.publish(PublishRequested(rollout_id=None))

    async def _weights_check(
        self,
        action: str,
        request_id: str,
        then: Callable[[list[WeightsCheckFinished]], Awaitable[None]],
        *,
        selector: str,
        skip_tensor_list: list[str],
        allow_quant_error: bool,
    ) -> None:
        """Ask every engine for a weight-checker action; ``then`` gets their replies, in
        engine order, once all have answered."""
        self._check = PendingCheck(request_id=request_id, then=then)
        await self.publish(
            WeightsCheckRequested(
                action=action,  # type: ignore[arg-type]
                selector=selector,  # type: ignore[arg-type]
                skip_tensor_list=skip_tensor_list,
                allow_quant_error=allow_quant_error,
                request_id=request_id,
            )
        )

    @handles(
        WeightsCheckFinished,
        emits=(WeightsCheckRequested, PublishRequested, PublicationEvidenceRequested, RunFinished, *AFTER_PUBLICATION),
    )
    async def on_weights_check_finished(self, event: WeightsCheckFinished) -> None:
        pending = self._check
        if pending is None or event.request_id != pending.request_id:
            return
        pending.replies[event.engine] = event
        if set(pending.replies) < set(self.plan.engines) or self._finishing is not None:
            return
        self._check = None
        await pending.then([pending.replies[engine] for engine in self.plan.engines])

    # -- check_weight_update_equal ----------------------------------------------------

    async def _update_check(self, action: str) -> None:
        verifier = self.config.verifier

        async def then(replies: list[WeightsCheckFinished]) -> None:
            await self._on_update_check(action, replies)

        await self._weights_check(
            action,
            f"check_weight_update_equal:{action}",
            then,
            selector=verifier.check_weight_update_selector,
            skip_tensor_list=list(verifier.check_weight_update_skip_list),
            allow_quant_error=verifier.check_weight_update_allow_quant_error,
        )

    async def _on_update_check(self, action: str, replies: list[WeightsCheckFinished]) -> None:
        failed = [reply for reply in replies if not reply.success]
        if failed:
            first = failed[0]
            await self._finish(
                "failed",
                f"inference weight check {action!r} did not succeed on every engine: {first.engine}: {first.message}",
            )
        elif action == "snapshot":
            await self._update_check("reset_tensors")
        elif action == "reset_tensors":
            await self.publish(PublishRequested(rollout_id=None))
        else:  # compare: the first publication wrote every checked tensor
            self._compared = True
            await self._after_publication(None)

    # -- rollout-only from a checkpoint: the seed's proof, one event per step ---------

    async def _proof_check(self, action: str, step: str) -> None:
        self._proof_step = step

        async def then(replies: list[WeightsCheckFinished]) -> None:
            try:
                await self._on_proof_check(action, step, replies)
            except RuntimeError as error:  # the seed's checks, with the seed's messages
                await self._finish("failed", str(error))

        await self._weights_check(
            action,
            f"rollout_only:{step}",
            then,
            selector=CHECKPOINT_ROLLOUT_SELECTOR,
            skip_tensor_list=list(CHECKPOINT_ROLLOUT_SKIP_LIST),
            allow_quant_error=False,
        )

    async def _on_proof_check(self, action: str, step: str, replies: list[WeightsCheckFinished]) -> None:
        proof = self._proof
        if action == "checksum":
            checksums = await anyio.to_thread.run_sync(self._canonical_checksums, replies)
            versions = canonical_weight_versions([reply.weight_version for reply in replies])
            if step == "base":
                proof.record_base(checksums, versions)
                await self._proof_publish("publish")
            elif step == "served":
                proof.record_served(checksums, versions)
                await self._proof_check("snapshot", "snapshot")
            elif step == "reset":
                proof.record_reset(checksums)
                await self._proof_publish("republish")
            else:  # republished
                proof.record_republished(checksums)
                await self._write_evidence()
            return
        if action == "compare":
            # The seed reads the versions right after the republication, before comparing.
            proof.record_republished_versions(canonical_weight_versions([reply.weight_version for reply in replies]))
        if not all(reply.success for reply in replies):
            raise RuntimeError(f"inference weight check {action!r} did not succeed on every engine")
        if action == "snapshot":
            await self._proof_check("reset_tensors", "reset_tensors")
        elif action == "reset_tensors":
            await self._proof_check("checksum", "reset")
        else:  # compare
            await self._proof_check("checksum", "republished")

    def _canonical_checksums(self, replies: list[WeightsCheckFinished]) -> CanonicalChecksums:
        engines = []
        for reply in replies:
            if not reply.success:
                raise RuntimeError(f"inference weight checksum did not succeed: {reply.message or 'no ranks'}")
            try:
                engines.append(read_manifest(self.context.run_dir, reply.checksums_manifest, reply.digest))
            except ManifestError as error:
                raise RuntimeError(f"inference weight checksum of {reply.engine}: {error}") from None
        return canonical_checksums(engines)

    async def _proof_publish(self, step: str) -> None:
        self._proof_step = step
        await self.publish(PublishRequested(rollout_id=None))

    async def _write_evidence(self) -> None:
        run = self.run
        effective_load = run.load or run.ref_load
        reference = run.ref_load or self.config.model.path
        if effective_load is None or reference is None or self.plan.checkpoint_iteration is None:
            raise RuntimeError("rollout-only from a checkpoint without a loaded checkpoint root")
        if run.rollout_only_publication_evidence is None:
            raise RuntimeError("run.rollout_only_publication_evidence is unset")
        self._proof_step = "evidence"
        evidence = self._proof.evidence(
            effective_load=effective_load, ref_load=reference, checkpoint_iteration=self.plan.checkpoint_iteration
        )
        await self.publish(PublicationEvidenceRequested(path=run.rollout_only_publication_evidence, evidence=evidence))

    @handles(PublicationEvidenceWritten, emits=AFTER_PUBLICATION)
    async def on_publication_evidence_written(self, event: PublicationEvidenceWritten) -> None:
        if self._proof_step != "evidence":
            return
        self._proof_step = "done"
        logger.info("checkpoint-backed publication proven; evidence in %s", event.path)
        await self._after_publication(None)

    @handles(PublicationEvidenceFailed, emits=(RunFinished,))
    async def on_publication_evidence_failed(self, event: PublicationEvidenceFailed) -> None:
        await self._finish("failed", f"cannot write the publication evidence: {event.reason}")

    @handles(RolloutGenerated, emits=(DataReleased, RolloutRequested, RunFinished))
    async def on_rollout_generated(self, event: RolloutGenerated) -> None:
        """Rollout-only: the rollout is the whole step. Its batch goes back untrained, as the
        seed's loop removes the rollout's data refs before it continues."""
        if not self.plan.rollout_only:
            return
        self.last_rollout_id = event.rollout_id
        await self.publish(DataReleased(ref=event.batch))
        logger.info(
            "rollout-only-from-checkpoint completed rollout_id=%d; "
            "skipping actor/critic training, saving, and republishing",
            event.rollout_id,
        )
        if self._finishing is not None:
            return
        if self._stop is not None:
            await self._finish("stopped", self._stop)
        elif event.rollout_id + 1 < self.plan.num_rollout:
            await self._request_rollout(event.rollout_id + 1)
        else:
            await self._finish("completed")

    @handles(WeightsPublished, emits=AFTER_PUBLICATION)
    async def on_weights_published(self, event: WeightsPublished) -> None:
        self.weight_version = event.weight_version
        if not self.config.verifier.enabled:
            await self._after_publication(event.rollout_id)

    @handles(WeightsLoaded, emits=())
    async def on_weights_loaded(self, event: WeightsLoaded) -> None:
        self.served[event.engine] = event.weight_version

    @handles(PublicationVerified, emits=AFTER_PUBLICATION)
    async def on_publication_verified(self, event: PublicationVerified) -> None:
        await self._after_publication(event.rollout_id)

    @handles(PublicationMismatch, emits=AFTER_PUBLICATION)
    async def on_publication_mismatch(self, event: PublicationMismatch) -> None:
        first = event.mismatches[0] if event.mismatches else None
        detail = f"; first: {first.engine} {first.tensor}" if first else ""
        if first is not None and first.reason:
            detail += f" ({first.reason})"
        message = (
            f"weight version {event.weight_version}: {len(event.mismatches)} tensor(s) served by the "
            f"engines differ from what the trainer published{detail}"
        )
        if self.config.verifier.continue_on_mismatch:
            logger.warning("%s (continuing: verifier.continue_on_mismatch)", message)
            await self._after_publication(event.rollout_id)
        else:
            await self._finish("failed", f"publication mismatch: {message}")

    async def _after_publication(self, rollout_id: int | None) -> None:
        if self._finishing is not None:
            return
        if self._stop is not None:
            # The step's publication is through: as the seed's ``should_stop`` break, the
            # run ends here (once the step is saved).
            await self._stop_now()
            return
        start, num_rollout = self.plan.start_rollout_id, self.plan.num_rollout
        if rollout_id is None and self._needs_compare():
            await self._update_check("compare")
            return
        if rollout_id is None and self._proof_step == "publish":
            await self._proof_check("checksum", "served")
            return
        if rollout_id is None and self._proof_step == "republish":
            await self._proof_check("compare", "compare")
            return
        if rollout_id is None:
            if num_rollout == 0 and self.run.eval_interval is not None:
                await self._eval(0, then=lambda: self._finish("completed"))
            elif start >= num_rollout:
                await self._finish("completed", "no rollouts left to run")
            elif self.run.eval_interval is not None and not self.run.skip_eval_before_train:
                await self._eval(start, then=lambda: self._request_rollout(start))
            else:
                await self._request_rollout(start)
            return
        if should_run_periodic_action(rollout_id, self.run.eval_interval, self.plan.num_rollout_per_epoch):
            await self._eval(rollout_id, then=lambda: self._continue_after(rollout_id))
        else:
            await self._continue_after(rollout_id)

    def _needs_compare(self) -> bool:
        return self.config.verifier.check_weight_update_equal and not self.plan.resumed and not self._compared

    async def _continue_after(self, rollout_id: int) -> None:
        debug_exit = self.run.debug_exit_after_rollout
        if debug_exit is not None and rollout_id - self.plan.start_rollout_id + 1 >= debug_exit:
            logger.info("debug_exit_after_rollout=%d reached at rollout_id=%d", debug_exit, rollout_id)
            await self._finish("completed", f"debug_exit_after_rollout={debug_exit}")
        elif rollout_id + 1 < self.plan.num_rollout:
            await self._request_rollout(rollout_id + 1)
        else:
            await self._finish("completed")

    async def _request_rollout(self, rollout_id: int) -> None:
        await self.publish(RolloutRequested(rollout_id=rollout_id))

    async def _eval(self, rollout_id: int, then: Callable[[], object]) -> None:
        self._after_eval = then
        await self.publish(EvalRequested(rollout_id=rollout_id))

    @handles(EvalFinished, emits=AFTER_PUBLICATION)
    async def on_eval_finished(self, event: EvalFinished) -> None:
        then, self._after_eval = self._after_eval, None
        if self._finishing is not None:
            return  # once finishing, nothing new is asked for
        if self._stop is not None:
            await self._stop_now()
        elif then is not None:
            await then()  # type: ignore[misc]

    @handles(TrainStepFinished, emits=(SaveRequested, PublishRequested))
    async def on_train_step_finished(self, event: TrainStepFinished) -> None:
        rollout_id = event.rollout_id
        self.last_rollout_id = rollout_id
        if self._finishing is not None:
            return  # once finishing, nothing new is asked for
        sentinel = self.run.save_trigger_sentinel
        reason: str | None = None
        if sentinel is not None and os.path.exists(sentinel):
            reason = "sentinel"
            # One touch, one save: the file goes once its save is asked for, before the
            # next rollout (the seed removes it right after its synchronous save).
            try:
                os.remove(sentinel)
            except FileNotFoundError:
                pass
        elif should_run_periodic_action(
            rollout_id, self.run.save_interval, self.plan.num_rollout_per_epoch, self.plan.num_rollout
        ):
            reason = "last" if rollout_id == self.plan.num_rollout - 1 else "interval"
        if reason is not None and self._pending_saves:
            # One save in flight at a time (as Megatron's asynchronous saves): a save due
            # while the last is still being written waits for it, and the loop with it, so
            # that saves asked for faster than they are written hold one staged train
            # state, not a growing queue of them.
            logger.info(
                "the save of rollout %d waits for the save of rollout %s, still being written",
                rollout_id,
                ", ".join(map(str, sorted(self._pending_saves))),
            )
            self._save_waiting = (rollout_id, reason)
            return
        await self._save_then_publish(rollout_id, reason)

    async def _save_then_publish(self, rollout_id: int, reason: str | None) -> None:
        if reason is not None:
            await self._save(rollout_id, reason, publication_follows=True)
        await self.publish(PublishRequested(rollout_id=rollout_id))

    async def _stop_now(self) -> None:
        """Finish stopped, after saving the last trained step unless a save of it was asked
        for already: a stopped run resumes with nothing redone."""
        last = self.last_rollout_id
        if not self.plan.rollout_only and last >= self.plan.start_rollout_id and last not in self._saved:
            await self._save(last, "stop")
        await self._finish("stopped", self._stop or "stopped")

    async def _save(self, rollout_id: int, reason: str, publication_follows: bool = False) -> None:
        self._saved.add(rollout_id)
        self._pending_saves.add(rollout_id)
        await self.publish(
            SaveRequested(rollout_id=rollout_id, reason=reason, publication_follows=publication_follows)  # type: ignore[arg-type]
        )

    @handles(CheckpointSaved, emits=(RunFinished, SaveRequested, PublishRequested))
    async def on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        self._pending_saves.discard(event.rollout_id)
        waiting, self._save_waiting = self._save_waiting, None
        if waiting is not None and self._finishing is None:
            await self._save_then_publish(*waiting)
        elif self._finishing is not None and not self._pending_saves:
            await self._publish_finished(self._finishing)

    # -- failures and stops -------------------------------------------------------------

    @handles(CheckpointFailed, emits=(RunFinished,))
    async def on_checkpoint_failed(self, event: CheckpointFailed) -> None:
        self._pending_saves.discard(event.rollout_id)
        await self._finish("failed", f"checkpoint of rollout {event.rollout_id} failed: {event.reason}")

    @handles(PublicationFailed, emits=(RunFinished,))
    async def on_publication_failed(self, event: PublicationFailed) -> None:
        await self._finish(
            "failed", f"publication of weight version {event.weight_version} failed in phase {event.phase}: {event.reason}"
        )

    @handles(ActorFailed, emits=(RunFinished,))
    async def on_actor_failed(self, event: ActorFailed) -> None:
        on = f" on {event.event_type}" if event.event_type else ""
        await self._finish("failed", f"actor {event.actor} failed{on}: {event.error}")

    @handles(StopRequested, emits=())
    async def on_stop_requested(self, event: StopRequested) -> None:
        """Stop after the current step, its save and its publication, as the seed's
        ``should_stop`` break: the loop's next decision (after a publication or an eval)
        finishes the run instead. A step that outlives ``run.stop_grace_seconds`` is cut: a
        stop ``now`` makes the generator or the trainer end it at its next cancellation
        point (``StepCancelled``), and the run stops after the last complete step."""
        first = self._stop is None
        if first:
            self._stop = event.reason
        grace = self.run.stop_grace_seconds
        if first and not event.now and grace is not None and self._finishing is None:
            self.spawn(self._cut_after(grace, event.reason), emits=(StopRequested,))

    async def _cut_after(self, grace: float, reason: str) -> None:
        await self.context.clock.sleep(grace)
        if self._finishing is None and self.finished is None:
            logger.warning("the step did not finish within run.stop_grace_seconds = %g: cutting it", grace)
            await self.publish(
                StopRequested(reason=f"{reason} (the step was cut after {grace:g}s)", now=True)
            )

    @handles(StepCancelled, emits=(SaveRequested, RunFinished))
    async def on_step_cancelled(self, event: StepCancelled) -> None:
        """The step in progress was cut (a stop ``now``): nothing of it is kept; the run
        stops after the last complete step, saving it unless it was saved."""
        if self._finishing is not None:
            return
        self._after_eval = None
        await self._stop_now()

    async def _finish(self, status: str, reason: str = "") -> None:
        if self._finishing is not None or self.finished is not None:
            return
        served = min(self.served.values(), key=version_number, default=self.weight_version)
        finished = RunFinished(
            status=status,  # type: ignore[arg-type]
            reason=reason,
            last_rollout_id=self.last_rollout_id,
            weight_version=served,
        )
        self._finishing = finished
        # A completed or stopped run waits for its checkpoints; a failed one does not.
        if status == "failed" or not self._pending_saves:
            await self._publish_finished(finished)

    async def _publish_finished(self, finished: RunFinished) -> None:
        if self.finished is None:
            self.finished = finished
            await self.publish(finished)
