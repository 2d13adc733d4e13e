"""The Coordinator: the seed's training loop (``train.py``) written as reactions.

Read top to bottom, the handlers are the loop:

    RunStarted               -> the opening (``actors.protocols.opening``): publish the
                                initial weights ("always update weight first"), around them
                                the seed's check_weight_update_equal, or, rollout-only, the
                                seed's checkpoint-backed proof (checksums, publish, checksums,
                                snapshot, reset, checksums, republish, compare, checksums,
                                evidence)
    opening through          -> eval-only / eval before train / first rollout
    TrainStepFinished(k)     -> save if periodic / last / sentinel (removing it) / asked
                                (``CheckpointRequested``), then publish
                                (a save due while the last is being written waits for it)
    publication of k through -> periodic eval, then rollout k+1 or finish
    EvalFinished             -> what the eval was asked before (``AfterEval``)
    CheckpointSaved          -> the save (and publication) waiting for it; finish once
                                nothing is pending
    rollout-only             -> RolloutGenerated(k) -> rollout k+1 or finish
    StopRequested            -> after the current step's publication (or eval): save that
                                step unless it was saved, then finish
    failure facts            -> RunFinished(failed) with one clear line
    a trainer rank failed    -> with ``"train"`` in ``run.ft_components`` (``CellFailed``
                                actor-i): once the group is back (``CellRestarted``) and
                                the saves in flight are written, the latest checkpoint the
                                run saved is restored (``TrainerRestoreRequested`` names
                                the rollouts done again), published once restored
                                (``TrainerRestored``), and the rollouts after it asked for
                                again with the same ids
    external policy sync     -> with ``run.external_policy_sync_path``, the plugin's hooks
                                (``PolicySyncRequested``) in the seed's places: initialize
                                before the opening, after_inference_publication after each
                                publication, after_local_train between a step's training and
                                its save, finalize before a completed or stopped RunFinished

The Coordinator holds no model and calls no actor: it reads facts and publishes commands.
Which version each engine serves is the Publisher's to follow; the Coordinator hears it in
``WeightsPublished``. It runs in the driver, so it alone touches the sentinel file.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio.to_thread
import msgspec

from actors.protocols.healing import is_actor_cell
from actors.protocols.memory import MemoryCommand, MemoryPlan
from actors.protocols.opening import Opening, opening_protocol
from actors.protocols.steps import (
    PUBLISHED,
    STARTED,
    Command,
    Done,
    EngineReplies,
    EvidenceWritten,
    Failed,
    Ignored,
)
from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.rl.checksum_manifest import read_manifest
from schemas.config import Config, staleness_bound
from schemas.events import (
    ActorFailed,
    CellFailed,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CheckpointFailed,
    CheckpointRequested,
    CheckpointSaved,
    DataReleased,
    EvalFinished,
    EvalRequested,
    Event,
    MemoryOffloaded,
    MemoryOnloaded,
    OffloadRequested,
    OnloadRequested,
    PolicySyncFailed,
    PolicySyncFinished,
    PolicySyncRequested,
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
    RunStatus,
    SaveReason,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainStateStaged,
    TrainStepFinished,
    WeightsCheckFinished,
    WeightsCheckRequested,
    WeightsPublished,
    WeightsStaged,
    run_started,
)

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


class AfterEval(enum.Enum):
    """What the loop does once the eval it asked for is finished."""

    FINISH = "finish"
    """An eval-only run (``num_rollout = 0``): the eval was the run."""
    FIRST_ROLLOUT = "first rollout"
    """The eval before training: the first rollout."""
    NEXT_STEP = "next step"
    """The periodic eval after a step's publication: the next rollout, or finish."""


@dataclass
class Rewind:
    """A trainer group that failed, until it holds a checkpoint again (``"train"`` in
    ``run.ft_components``)."""

    through: int
    """The last rollout trained or in training when it failed: done again up to it."""
    restarted: bool = False
    """The group is back (``CellRestarted``)."""
    asked: bool = False
    """The restore was asked for (``TrainerRestoreRequested``)."""


@dataclass(frozen=True)
class PendingEval:
    rollout_id: int
    then: AfterEval


# What offload and onload publish (run.offload_train, run.offload_rollout).
MEMORY = (OffloadRequested, OnloadRequested)
# What the opening's steps may publish, and what the loop's start may.
OPENING = (WeightsCheckRequested, PublishRequested, PublicationEvidenceRequested, *MEMORY)
LOOP_START = (EvalRequested, RolloutRequested, RunFinished, *MEMORY)
# Once a publication is through: the opening's next step, or the loop's next step (a stop
# saves the step it ends after).
AFTER_PUBLICATION = (
    WeightsCheckRequested,
    EvalRequested,
    RolloutRequested,
    RunFinished,
    SaveRequested,
    PublishRequested,
    PolicySyncRequested,
    *MEMORY,
)
# Once the memory asked for is moved: whatever was waiting for it.
# (The opening's evidence follows weight checks only, never a memory move.)
_AFTER_ANYTHING: tuple[type[Event], ...] = (*OPENING, *LOOP_START, *AFTER_PUBLICATION)
AFTER_MEMORY = tuple(e for e in dict.fromkeys(_AFTER_ANYTHING) if e is not PublicationEvidenceRequested)


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
        self._opening: Opening = self._new_opening()
        """The protocol before the first rollout; it alone asks for weight checks."""
        self._check: EngineReplies | None = None
        """The replies to the weight check in flight."""
        self._pending_eval: PendingEval | None = None
        """The eval in flight, and what follows it."""
        self._pending_saves: set[int] = set()
        self._save_waiting: tuple[int, SaveReason] | None = None
        """A step's save (rollout id, reason) due while the last save was being written."""
        self._saved: set[int] = set()
        """Rollouts a save was asked for."""
        self._stop: str | None = None
        self._save_asked: str | None = None
        """Why a checkpoint was asked for (``CheckpointRequested``), until the next step saves."""
        """Why a stop was asked for: the run finishes after the current step."""
        self._finishing: RunFinished | None = None
        self.finished: RunFinished | None = None
        self.last_rollout_id = plan.start_rollout_id - 1
        self.served_version = "default"
        """The version every engine serves: the last ``WeightsPublished``'s (the Publisher
        follows each engine; a publication that failed part-way leaves some a version ahead)."""
        self.memory = MemoryPlan.of(config)
        """What offload and onload ask for at each point of the loop (nothing without them)."""
        self._memory_queue: deque[tuple[deque[MemoryCommand], Callable[[], Awaitable[None]]]] = deque()
        """Memory commands still to publish, each run of them with what follows it."""
        self._memory_waiting: str | None = None
        """The request id of the memory command in flight."""
        self._memory_requests = 0
        self._engines_released: set[str] = set()
        """The kinds of the engines' memory released and not resumed."""
        self._sync = config.run.external_policy_sync_path is not None
        """An external policy synchronizer runs its hooks around the loop (``PolicySyncRequested``)."""
        self._until_stopped = self._sync and config.run.external_policy_sync_run_until_stop
        """Rollouts go on past ``num_rollout`` until the synchronizer stops the run."""
        self._finalize_asked = False
        self._finalized = False
        self._requested = plan.start_rollout_id - 1
        """The last rollout asked for."""
        self._checkpoints: dict[int, str] = {}
        """The checkpoints the run saved, by rollout id."""
        self._staged_saves: set[int] = set()
        """Saves whose train state is staged and not yet written."""
        self._rewind: Rewind | None = None
        """A trainer group that failed, until it is restored."""
        self._rewound_to: int | None = None
        """The rollout a restored trainer holds, until its publication is through."""
        self._opened = False
        """The opening is through (the loop began)."""
        self._bound = staleness_bound(config)
        """Asynchronous training (``run.max_staleness``): rollouts asked for ahead of training."""
        self._published_step = plan.start_rollout_id - 1
        """The last step whose publication is through (the opening's: the one before the start)."""
        self._staged_step = plan.start_rollout_id - 1
        """The last step whose weights the trainer staged for publication."""
        self._due: tuple[int, SaveReason | None] | None = None
        """Asynchronously: a trained step whose save and publication wait for their turn."""
        self._generated_through = plan.start_rollout_id - 1
        """The last rollout generated."""
        self._publish_asked = plan.start_rollout_id - 1
        """Asynchronously: the last step whose publication was asked for (the Trainer trains
        the next rollout once it has staged it)."""
        self._cancelled_steps: set[int] = set()
        """Steps whose training was cut (``StepCancelled`` of phase train)."""
        self._stop_when_trained = False
        """Asynchronously: a stop waits for the step the Trainer is training to finish."""

    # -- the opening ------------------------------------------------------------------

    def _new_opening(self) -> Opening:
        return opening_protocol(
            self.config, self.plan, functools.partial(read_manifest, self.context.run_dir)
        )

    async def ready(self) -> None:
        """Every actor has started: the run begins."""
        await self.publish(run_started(self.plan))

    @handles(RunStarted, emits=(WeightsCheckRequested, PublishRequested, PolicySyncRequested, *MEMORY))
    async def on_run_started(self, event: RunStarted) -> None:
        # With offload, the engines and the trainer begin offloaded, as the seed creates them.
        await self._after_memory(self.memory.at_start(), self._initialize_or_open)

    async def _initialize_or_open(self) -> None:
        if self._sync:  # the seed's initialize (with the trainer onloaded), before anything is published
            await self._after_memory(
                self.memory.before_initialize(),
                functools.partial(self.publish, PolicySyncRequested(hook="initialize")),
            )
        else:
            await self._follow(self._opening.step(STARTED))

    @handles(WeightsCheckFinished, emits=(*OPENING, *LOOP_START))
    async def on_weights_check_finished(self, event: WeightsCheckFinished) -> None:
        check = self._check
        if check is None or not check.add(event) or self._finishing is not None:
            return
        self._check = None
        # A step may read the checksum manifests the replies name: off the event loop.
        await self._follow(await anyio.to_thread.run_sync(self._opening.step, check.finished()))

    @handles(PublicationEvidenceWritten, emits=LOOP_START)
    async def on_publication_evidence_written(self, event: PublicationEvidenceWritten) -> None:
        command = self._opening.step(EvidenceWritten(event.path))
        if isinstance(command, Done):
            logger.info("checkpoint-backed publication proven; evidence in %s", event.path)
        await self._follow(command)

    @handles(PublicationEvidenceFailed, emits=(RunFinished,))
    async def on_publication_evidence_failed(self, event: PublicationEvidenceFailed) -> None:
        await self._finish("failed", f"cannot write the publication evidence: {event.reason}")

    async def _follow(self, command: Command) -> None:
        """Carry out what the opening's step returned."""
        if isinstance(command, Ignored):
            return
        if isinstance(command, Failed):
            await self._finish("failed", command.reason)
        elif isinstance(command, Done):
            # The seed's ``onload_kv`` once the opening's publications are through.
            await self._after_memory(self.memory.after_publication(None), self._loop_begins)
        elif isinstance(command, PublishRequested):
            await self._publish_after_memory(command)
        else:
            if isinstance(command, WeightsCheckRequested):
                self._check = EngineReplies(command.request_id, self.plan.engines)
            await self.publish(command)

    async def _loop_begins(self) -> None:
        """The opening is through: an eval-only run evaluates, a training run starts."""
        self._opened = True
        if self._finishing is not None:
            return
        if self._stop is not None:
            await self._finish("stopped", self._stop)  # nothing trained yet: nothing to save
            return
        start, num_rollout, run = self.plan.start_rollout_id, self.plan.num_rollout, self.run
        if num_rollout == 0 and run.eval_interval is not None:
            await self._eval(0, AfterEval.FINISH)
        elif start >= num_rollout and not self._until_stopped:
            await self._finish("completed", "no rollouts left to run")
        elif run.eval_interval is not None and not run.skip_eval_before_train:
            await self._eval(start, AfterEval.FIRST_ROLLOUT)
        else:
            await self._rollouts_from(start)

    async def _rollouts_from(self, rollout_id: int) -> None:
        """Ask for rollout ``rollout_id`` (asynchronously: every one the bound allows now)."""
        if self._bound:
            await self._request_ahead()
        else:
            await self._request_rollout(rollout_id)

    # -- publications -----------------------------------------------------------------

    @handles(WeightsPublished, emits=AFTER_PUBLICATION)
    async def on_weights_published(self, event: WeightsPublished) -> None:
        self.served_version = event.weight_version
        if not self.config.verifier.enabled:
            await self._published(event.rollout_id)

    @handles(PublicationVerified, emits=AFTER_PUBLICATION)
    async def on_publication_verified(self, event: PublicationVerified) -> None:
        await self._published(event.rollout_id)

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
            await self._published(event.rollout_id)
        else:
            await self._finish("failed", f"publication mismatch: {message}")

    async def _published(self, rollout_id: int | None) -> None:
        """A publication is through. ``rollout_id`` None: the opening's (the initial
        publication, or the proof's); else the one after training rollout ``rollout_id``,
        which the engines' KV cache follows back (the seed's ``onload_kv``)."""
        if self._finishing is not None or self._rewind is not None:
            return  # going back to a checkpoint: the loop goes on from there
        if rollout_id is not None:
            self._published_step = rollout_id
        if self._sync:  # the seed's after_inference_publication, then the loop goes on
            await self.publish(PolicySyncRequested(hook="after_inference_publication", rollout_id=rollout_id))
        else:
            await self._after_published(rollout_id)

    async def _after_published(self, rollout_id: int | None) -> None:
        if rollout_id is None:
            if self._stop is not None:
                await self._finish("stopped", self._stop)  # nothing trained yet: nothing to save
            else:
                await self._follow(self._opening.step(PUBLISHED))
        else:
            await self._after_memory(
                self.memory.after_publication(rollout_id), functools.partial(self._step_published, rollout_id)
            )

    async def _step_published(self, rollout_id: int) -> None:
        """Step ``rollout_id``'s publication is through (and the engines' memory back)."""
        if self._finishing is not None or self._rewind is not None:
            return  # going back to a checkpoint: the loop goes on from there
        if self._stop is not None:
            # The step's publication is through: as the seed's ``should_stop`` break, the
            # run ends here (once the step is saved).
            await self._stop_now()
        elif rollout_id == self._rewound_to:
            self._rewound_to = None  # the restored state's publication: its eval was run before
            await self._next_step(rollout_id)
        elif should_run_periodic_action(rollout_id, self.run.eval_interval, self.plan.num_rollout_per_epoch):
            await self._eval(rollout_id, AfterEval.NEXT_STEP)
        else:
            await self._next_step(rollout_id)

    # -- the loop ---------------------------------------------------------------------

    async def _next_step(self, rollout_id: int) -> None:
        """Rollout ``rollout_id`` is done: the next one, or finish."""
        debug_exit = self.run.debug_exit_after_rollout
        if debug_exit is not None and rollout_id - self.plan.start_rollout_id + 1 >= debug_exit:
            logger.info("debug_exit_after_rollout=%d reached at rollout_id=%d", debug_exit, rollout_id)
            await self._finish("completed", f"debug_exit_after_rollout={debug_exit}")
        elif rollout_id + 1 < self.plan.num_rollout or self._until_stopped:
            await self._rollouts_from(rollout_id + 1)
        else:
            await self._finish("completed")

    async def _request_rollout(self, rollout_id: int) -> None:
        self._requested = rollout_id
        await self.publish(RolloutRequested(rollout_id=rollout_id))

    # -- asynchronous training (``run.max_staleness``) ------------------------------------
    #
    # Rollout r is sampled on the weights published after step r - 1 - k. With
    # ``staleness_policy = "wait"`` it is asked for once that publication is through, and the
    # publication of step n once rollout n + k is asked for: the Generator, which handles its
    # events in order, then meets every request and every publication in one order whatever
    # the timing, and a run is the same from the same config. With ``drop`` or ``mask`` a
    # rollout is asked for once the weights of the step k + 1 before it are staged (not yet
    # loaded or verified), and the Trainer judges each token's age. Either way publications
    # go one at a time, in step order, and the Trainer trains step n + 1 only after it staged
    # step n's publication (and save).

    def _ahead_limit(self) -> int:
        """The last rollout that may be asked for now."""
        base = self._published_step if self.run.staleness_policy == "wait" else self._staged_step
        last = self.plan.num_rollout - 1
        debug_exit = self.run.debug_exit_after_rollout
        if debug_exit is not None:
            last = min(last, self.plan.start_rollout_id + debug_exit - 1)
        return min(base + 1 + self._bound, last)

    @handles(WeightsStaged, emits=(RolloutRequested,))
    async def on_weights_staged(self, event: WeightsStaged) -> None:
        """``drop`` / ``mask``: the rollouts a step's staged weights keep within the bound are
        asked for at once (the engines meet the weights first), not after the publication."""
        if not self._bound or self.run.staleness_policy == "wait" or event.rollout_id is None:
            return
        self._staged_step = max(self._staged_step, event.rollout_id)
        if self._opened and self._rewind is None:
            await self._ask_ahead()  # a publication's turn does not depend on a staging here

    async def _request_ahead(self) -> None:
        """Ask for every rollout the staleness bound allows now."""
        if await self._ask_ahead():
            await self._publish_due()

    async def _ask_ahead(self) -> bool:
        """Ask for the rollouts the bound allows now; False when nothing new may be asked for."""
        if self._finishing is not None or self._stop is not None or self._pending_eval is not None:
            return False
        for rollout_id in range(self._requested + 1, self._ahead_limit() + 1):
            await self._request_rollout(rollout_id)
        return True

    async def _publish_due(self) -> None:
        """The trained step's save and publication, once its turn came: the publication
        before it through and (``wait``) the rollout ``k`` after it asked for."""
        if self._due is None or self._finishing is not None or self._stop is not None:
            return  # a stop saves the step instead: no publication lets the Trainer go on
        if self._pending_eval is not None:
            return  # the eval runs on the weights it was asked for; the loop goes on after it
        rollout_id, reason = self._due
        if self._published_step != rollout_id - 1:
            return
        last = self.plan.num_rollout - 1
        hold = self.run.staleness_policy == "wait" and not self.config.rollout.partial
        if hold and self._requested < min(rollout_id + self._bound, last):
            return  # (with rollout.partial a publication lands inside a rollout anyway)
        self._due = None
        self._publish_asked = rollout_id
        await self._save_and_publish(rollout_id, reason)

    async def _eval(self, rollout_id: int, then: AfterEval) -> None:
        self._pending_eval = PendingEval(rollout_id, then)
        await self.publish(EvalRequested(rollout_id=rollout_id))

    @handles(EvalFinished, emits=(RolloutRequested, RunFinished, SaveRequested, PublishRequested))
    async def on_eval_finished(self, event: EvalFinished) -> None:
        pending, self._pending_eval = self._pending_eval, None
        if self._finishing is not None or self._rewind is not None:
            return  # once finishing (or going back to a checkpoint), nothing new is asked for
        if self._stop is not None:
            await self._stop_now()
        elif pending is None:
            return
        elif pending.then is AfterEval.FINISH:
            await self._finish("completed")
        elif pending.then is AfterEval.FIRST_ROLLOUT:
            await self._rollouts_from(pending.rollout_id)
        else:
            await self._next_step(pending.rollout_id)

    @handles(RolloutGenerated, emits=(DataReleased, RolloutRequested, RunFinished, *MEMORY))
    async def on_rollout_generated(self, event: RolloutGenerated) -> None:
        """Training: the engines release their memory for the step (the seed's
        ``offload(tags)``), which the first group to train waits for. Rollout-only: the
        rollout is the whole step. Its batch goes back untrained, as the seed's loop removes
        the rollout's data refs before it continues."""
        if not self.plan.rollout_only:
            self._generated_through = max(self._generated_through, event.rollout_id)
            if self._finishing is None:
                await self._after_memory(self.memory.after_generation(event.rollout_id), _nothing)
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

    @handles(TrainStepFinished, emits=(SaveRequested, PublishRequested, PolicySyncRequested, *MEMORY))
    async def on_train_step_finished(self, event: TrainStepFinished) -> None:
        if self._rewind is not None:
            return  # the trainer's group lost it since: done again from the checkpoint
        rollout_id = event.rollout_id
        self.last_rollout_id = rollout_id
        if self._finishing is not None:
            return  # once finishing, nothing new is asked for
        if self._stop_when_trained:
            await self._stop_now()  # the step in training when the stop came: saved
            return
        if self._sync:  # the seed's after_local_train, before the step's save and publication
            await self.publish(PolicySyncRequested(hook="after_local_train", rollout_id=rollout_id))
        else:
            await self._step_trained(rollout_id)

    async def _step_trained(self, rollout_id: int) -> None:
        """Save the trained step if one is due, then publish it."""
        sentinel = self.run.save_trigger_sentinel
        reason: SaveReason | None = None
        if self._save_asked is not None:
            logger.info("saving rollout %d: %s", rollout_id, self._save_asked)
            reason, self._save_asked = "request", None
        elif sentinel is not None and os.path.exists(sentinel):
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

    async def _save_then_publish(self, rollout_id: int, reason: SaveReason | None) -> None:
        if self._bound:
            self._due = (rollout_id, reason)
            await self._publish_due()
        else:
            await self._save_and_publish(rollout_id, reason)

    async def _save_and_publish(self, rollout_id: int, reason: SaveReason | None) -> None:
        if reason is not None:
            await self._save(rollout_id, reason, publication_follows=True)
        await self._publish_after_memory(PublishRequested(rollout_id=rollout_id))

    # -- offload and onload ---------------------------------------------------------------

    async def _publish_after_memory(self, command: PublishRequested) -> None:
        """Publish once the memory moves before a publication are done (the seed's
        ``offload_train()`` after a step, then ``onload_weights``)."""
        await self._after_memory(
            self.memory.before_publication(command.rollout_id), functools.partial(self.publish, command)
        )

    async def _after_memory(self, commands: list[MemoryCommand], then: Callable[[], Awaitable[None]]) -> None:
        """Publish ``commands`` one at a time, each once the one before is answered, then
        ``then()``; behind any commands still in flight. An engine onload of nothing
        released is left out."""
        wanted = deque(c for c in commands if not self._needless(c))
        if not wanted and not self._memory_queue and self._memory_waiting is None:
            await then()
            return
        self._memory_queue.append((wanted, then))
        if self._memory_waiting is None:
            await self._next_memory_command()

    def _needless(self, command: MemoryCommand) -> bool:
        return (
            isinstance(command, OnloadRequested)
            and command.target == "rollout"
            and not self._engines_released.intersection(command.tags)
        )

    async def _next_memory_command(self) -> None:
        # A ``then()`` may queue (and publish) commands of its own: the loop stops there.
        while self._memory_queue and self._memory_waiting is None:
            commands, then = self._memory_queue[0]
            if commands:
                command = commands.popleft()
                self._memory_requests += 1
                self._memory_waiting = f"memory-{self._memory_requests}"
                await self.publish(msgspec.structs.replace(command, request_id=self._memory_waiting))
                return
            self._memory_queue.popleft()
            await then()

    @handles(MemoryOffloaded, emits=AFTER_MEMORY)
    async def on_memory_offloaded(self, event: MemoryOffloaded) -> None:
        if event.target == "rollout":
            self._engines_released.update(event.tags)
        await self._memory_answered(event.request_id)

    @handles(MemoryOnloaded, emits=AFTER_MEMORY)
    async def on_memory_onloaded(self, event: MemoryOnloaded) -> None:
        if event.target == "rollout":
            self._engines_released.difference_update(event.tags)
        await self._memory_answered(event.request_id)

    async def _memory_answered(self, request_id: str) -> None:
        if not request_id or request_id != self._memory_waiting:
            return  # a trainer group's own (it onloads and offloads itself around its step)
        self._memory_waiting = None
        if self._finishing is not None:
            self._memory_queue.clear()  # once finishing, nothing new is asked for
            return
        await self._next_memory_command()

    async def _save(self, rollout_id: int, reason: SaveReason, publication_follows: bool = False) -> None:
        self._saved.add(rollout_id)
        self._pending_saves.add(rollout_id)
        await self.publish(
            SaveRequested(rollout_id=rollout_id, reason=reason, publication_follows=publication_follows)
        )

    @handles(
        CheckpointSaved,
        emits=(RunFinished, SaveRequested, PublishRequested, TrainerRestoreRequested, *MEMORY),
    )
    async def on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        self._pending_saves.discard(event.rollout_id)
        self._staged_saves.discard(event.rollout_id)
        self._checkpoints[event.rollout_id] = event.path
        if self._rewind is not None:
            await self._restore_when_saved()
            return
        waiting, self._save_waiting = self._save_waiting, None
        if waiting is not None and self._finishing is None:
            await self._save_then_publish(*waiting)
        elif self._finishing is not None and not self._pending_saves:
            await self._publish_finished(self._finishing)

    # -- a trainer group that heals (``"train"`` in ``run.ft_components``) ------------------

    @handles(TrainStateStaged, emits=())
    async def on_train_state_staged(self, event: TrainStateStaged) -> None:
        if event.rollout_id in self._pending_saves:
            self._staged_saves.add(event.rollout_id)

    @handles(CellFailed, emits=())
    async def on_cell_failed(self, event: CellFailed) -> None:
        """A trainer rank failed: its group is restarted (by the Trainer), and the run goes
        back to the latest checkpoint. A save asked for whose state was not staged is never
        written: it is asked for again when its step is trained again."""
        if is_actor_cell(event.cell) and self._finishing is None:
            logger.warning("%s failed (%s): restoring the latest checkpoint", event.cell, event.reason)
            self._rewind_from_here()

    @handles(CellSuspended, emits=())
    async def on_cell_suspended(self, event: CellSuspended) -> None:
        """The trainer's group was suspended (its ranks stopped): as a failure, the latest
        checkpoint is restored once it is resumed."""
        if is_actor_cell(event.cell) and self._finishing is None:
            self._rewind_from_here()

    def _rewind_from_here(self) -> None:
        """The trainer's group lost its state: the run goes back to the latest checkpoint
        once it is back. Lost again while going back (a restore asked for and not answered
        is never answered), it starts over: the restore is asked for once it is back."""
        through = max(self.last_rollout_id, self._requested)
        self._rewind = Rewind(max(through, self._rewind.through) if self._rewind is not None else through)
        self._pending_eval = None
        self._save_waiting = None
        lost = self._pending_saves - self._staged_saves
        self._pending_saves -= lost
        self._saved -= lost

    @handles(CellRestarted, emits=(TrainerRestoreRequested,))
    async def on_cell_restarted(self, event: CellRestarted) -> None:
        await self._trainer_back(event.cell)

    @handles(CellResumed, emits=(TrainerRestoreRequested,))
    async def on_cell_resumed(self, event: CellResumed) -> None:
        await self._trainer_back(event.cell)

    async def _trainer_back(self, cell: str) -> None:
        """The trainer's group runs again (restarted or resumed): the restore follows."""
        if self._rewind is not None and is_actor_cell(cell) and self._finishing is None:
            self._rewind.restarted = True
            await self._restore_when_saved()

    async def _restore_when_saved(self) -> None:
        """Ask the restarted trainer for the latest checkpoint once no save is in flight
        (the save being written may be that checkpoint)."""
        rewind = self._rewind
        if rewind is None or not rewind.restarted or rewind.asked or self._pending_saves:
            return
        rewind.asked = True
        if self._checkpoints:
            rollout_id = max(self._checkpoints)
            checkpoint: str | None = self._checkpoints[rollout_id]
        else:  # none saved yet: the state the run started from
            rollout_id, checkpoint = self.plan.start_rollout_id - 1, None
        redo = list(range(rollout_id + 1, rewind.through + 1))
        logger.info(
            "restoring %s (rollout %d); rollouts done again: %s",
            checkpoint or "the run's start",
            rollout_id,
            ", ".join(map(str, redo)) or "none",
        )
        await self.publish(TrainerRestoreRequested(checkpoint=checkpoint, rollout_id=rollout_id, redo=redo))

    @handles(TrainerRestored, emits=(PublishRequested, WeightsCheckRequested, *MEMORY))
    async def on_trainer_restored(self, event: TrainerRestored) -> None:
        """The trainer holds the checkpoint: the engines are given it (a publication, the
        next version), then the rollout after it is asked for again."""
        if self._rewind is None or not self._rewind.asked or self._finishing is not None:
            return  # a restore's answer from before the group was lost again
        self._rewind = None
        self.last_rollout_id = event.rollout_id
        if not self._opened:
            # Lost during the opening: the opening again, with the restored weights.
            self._check = None
            self._opening = self._new_opening()
            await self._follow(self._opening.step(STARTED))
            return
        self._rewound_to = event.rollout_id
        await self._publish_after_memory(PublishRequested(rollout_id=event.rollout_id))

    # -- failures and stops -------------------------------------------------------------

    @handles(CheckpointFailed, emits=(RunFinished,))
    async def on_checkpoint_failed(self, event: CheckpointFailed) -> None:
        self._pending_saves.discard(event.rollout_id)
        self._staged_saves.discard(event.rollout_id)
        await self._finish("failed", f"checkpoint of rollout {event.rollout_id} failed: {event.reason}")

    @handles(PublicationFailed, emits=(RunFinished,))
    async def on_publication_failed(self, event: PublicationFailed) -> None:
        await self._finish(
            "failed",
            f"publication of weight version {event.weight_version} failed in phase {event.phase}: {event.reason}",
        )

    @handles(ActorFailed, emits=(RunFinished,))
    async def on_actor_failed(self, event: ActorFailed) -> None:
        on = f" on {event.event_type}" if event.event_type else ""
        await self._finish("failed", f"actor {event.actor} failed{on}: {event.error}")

    @handles(CheckpointRequested, emits=())
    async def on_checkpoint_requested(self, event: CheckpointRequested) -> None:
        """A checkpoint asked for (the control server's save): the step in progress is saved
        once trained, as a touch of the save-trigger sentinel would."""
        self._save_asked = event.reason or "a checkpoint was asked for"

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
        if event.phase == "train":
            self._cancelled_steps.add(event.rollout_id)
        self._pending_eval = None
        await self._stop_now()

    def _training_now(self) -> bool:
        """Asynchronously: whether the Trainer is training the step after the last one
        trained (its rollout generated and the publication before it asked for)."""
        step = self.last_rollout_id + 1
        return (
            self._bound > 0
            and step < self.plan.num_rollout
            and step <= self._generated_through
            and self._publish_asked >= self.last_rollout_id
            and step not in self._cancelled_steps
        )

    async def _stop_now(self) -> None:
        """Finish stopped, after saving the last trained step unless a save of it was asked
        for already: a stopped run resumes with nothing redone. Asynchronously, a step the
        Trainer is training meanwhile is waited for and saved (its state is the Trainer's)."""
        if self._training_now():
            self._stop_when_trained = True
            return
        self._stop_when_trained = False
        last = self.last_rollout_id
        if not self.plan.rollout_only and last >= self.plan.start_rollout_id and last not in self._saved:
            await self._save(last, "stop")
        await self._finish("stopped", self._stop or "stopped")

    async def _finish(self, status: RunStatus, reason: str = "") -> None:
        if self._finishing is not None or self.finished is not None:
            return
        finished = RunFinished(
            status=status,
            reason=reason,
            last_rollout_id=self.last_rollout_id,
            weight_version=self.served_version,
        )
        self._finishing = finished
        # A completed or stopped run waits for its checkpoints; a failed one does not.
        if status == "failed" or not self._pending_saves:
            await self._publish_finished(finished)

    async def _publish_finished(self, finished: RunFinished) -> None:
        if self._sync and not self._finalized and finished.status != "failed":
            # The seed's finalize, once, before a completed or stopped run ends.
            if not self._finalize_asked:
                self._finalize_asked = True
                self.spawn(self.publish(PolicySyncRequested(hook="finalize")), emits=(PolicySyncRequested,))
            return
        if self.finished is None:
            self.finished = finished
            await self.publish(finished)

    # -- the external policy synchronizer (``run.external_policy_sync_path``) ---------------

    @handles(PolicySyncFinished, emits=(*AFTER_PUBLICATION, PublishRequested))
    async def on_policy_sync_finished(self, event: PolicySyncFinished) -> None:
        """A hook is through: the loop goes on where it asked for it."""
        hook, rollout_id = event.hook, event.rollout_id
        if hook == "finalize":
            self._finalized = True
            if self._finishing is not None:
                await self._publish_finished(self._finishing)
            return
        if self._finishing is not None:
            return
        if hook == "initialize":
            # With offload, the seed gives the trainer's memory back before the publication.
            await self._after_memory(
                self.memory.after_initialize(), lambda: self._follow(self._opening.step(STARTED))
            )
        elif hook == "after_local_train" and rollout_id is not None:
            if event.stop and self._stop is None:
                # The seed's ``should_stop``: the run ends after this step's publication.
                self._stop = f"the external policy synchronizer stopped the run after rollout {rollout_id}"
                logger.info("%s", self._stop)
            await self._step_trained(rollout_id)
        elif hook == "after_inference_publication" and rollout_id is None:
            await self._after_memory(
                self.memory.after_initial_sync(), functools.partial(self._after_published, rollout_id)
            )
        elif hook == "after_inference_publication":
            await self._after_published(rollout_id)

    @handles(PolicySyncFailed, emits=(RunFinished,))
    async def on_policy_sync_failed(self, event: PolicySyncFailed) -> None:
        where = f" (rollout {event.rollout_id})" if event.rollout_id is not None else ""
        if event.hook == "finalize":
            self._finishing = None  # the run that was ending fails instead
        await self._finish("failed", f"external policy sync {event.hook}{where} failed: {event.reason}")


async def _nothing() -> None:
    """What follows a memory move that nothing waits for here."""
