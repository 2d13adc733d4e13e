"""The Trainer actor: trains the policy on rollouts, stages weights and train state.

It owns the trainer's weight version. The version is ``"default"`` until the first
publication; the n-th publication stages version ``str(n)``; a resumed trainer continues
from the version saved in its checkpoint, so engines never see a version twice.

Data-plane ownership: the trainer owns what it stages. Published weights stay staged until
the next version is staged (engines may still be loading the current one), until their
consumer publishes ``DataReleased`` for them, or until ``stop``. Train state staged for a
save is freed when the Saver, done writing, publishes ``DataReleased`` for it; it is not
freed at ``stop``, since the Saver may still be reading it then (the transport's close at
the end of the run drops whatever is left).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors.protocols.healing import actor_cell, check_restart, deliver_fault, is_actor_cell, restart_backoff
from actors.protocols.memory import RolloutGate, gates_training
from actors.trainer_backend import backend_module, build_backend
from actors.trainer_backend.base import TrainerBackend
from actors.trainer_backend.model_weights import weights_loaded, weights_staged
from actors.trainer_backend.offload import offload_group, onload_group
from actors.trainer_backend.rank_group import RankGroupBackend, trainer_worker_group, uses_rank_group
from actors.trainer_backend.save_staging import (
    PublicationsTakenUp,
    SaveStaging,
    TrainStateSnapshot,
    weights_copy,
)
from miles_events.bus.actor import (
    Actor,
    ActorContext,
    RankDied,
    RankFailed,
    WorkerGroup,
    brief_error,
    handles,
)
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.bus.clock import wait_for
from miles_events.checkpoint.format import read_checkpoint
from miles_events.device.buckets import Buckets, fingerprint_buckets, plan_layouts, require_finite_buckets
from miles_events.device.fingerprint import tensor_fingerprint
from miles_events.device.staging import StagingPool
from miles_events.device.threads import phase_threads
from miles_events.rl.canary import CANARY_TENSOR, publication_canary
from miles_events.rl.checksum_manifest import manifest_path, remove_manifest, write_manifest
from miles_events.rl.finite import finite_part
from miles_events.rl.hf_model import modeling_module, torch_dtype
from miles_events.rl.probe import probe_batch, probe_vocab_size
from miles_events.rl.prompts import data_cursor, load_prompts
from miles_events.rl.staleness import Staleness, within_bound
from miles_events.rl.versions import next_version, version_number
from schemas.checkpoint import TrainerState
from schemas.config import Config, engines_heal, skip_tensor_list, staleness_bound, trainer_heals
from schemas.data import DataRef
from schemas.events import (
    CellFailed,
    CellHealth,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CellSuspendRequested,
    CriticStepFinished,
    DataReleased,
    Event,
    FaultInjected,
    FaultInjectionRequested,
    MemoryOffloaded,
    MemoryOnloaded,
    ModelWeightsLoaded,
    ModelWeightsLoadRequested,
    ModelWeightsRequested,
    ModelWeightsStaged,
    OffloadRequested,
    OnloadRequested,
    ProbeBatch,
    PublicationVerified,
    PublishRequested,
    RankStep,
    RestoreVerified,
    RolloutGenerated,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainMetrics,
    TrainStateStaged,
    TrainStepFinished,
    WeightsPublished,
    WeightsStaged,
)
from schemas.rollout import CriticValues, RolloutBatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

RANK_FAULTS = (RankDied, RankFailed)
"""How a rank that died or hung shows in a call on the group: what a trainer that heals
(``"train"`` in ``run.ft_components``) restarts its group for."""

HEALING = (CellFailed, CellRestarted)
"""What a handler of a trainer that heals may publish beside its own events."""

PUBLICATION_WAIT_SECONDS = 60.0
"""How long a save staged in the background waits for the publication asked for with it
to be staged before it stages anyway (that publication always comes right behind it)."""


def staleness_max(trainer_version: str, sample_versions: list[str]) -> int:
    """How many publications the oldest sample's weights lag behind the trainer's."""
    if not sample_versions:
        return 0
    return version_number(trainer_version) - min(version_number(v) for v in sample_versions)


class Trainer(Actor):
    """Consumes ``RolloutGenerated``, ``PublishRequested``, ``SaveRequested`` and ``DataReleased``;
    emits ``DataReleased`` + ``TrainStepFinished``, ``WeightsStaged`` and ``TrainStateStaged``."""

    name = "trainer"

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self._backend: TrainerBackend | None = None
        self.cancel = Cancellation()
        self.weight_version = "default"
        self.num_prompts = 0
        self.resumed_from: str | None = None
        """The checkpoint directory restored at start, if any."""
        self._published: DataRef | None = None
        self._held: dict[str, DataRef] = {}
        """Publications before the last that engines may still load again (engines that
        heal), until the Publisher releases them."""
        self._manifests: dict[str, str] = {}
        """Weight version -> the checksum manifest written for it, until it is verified."""
        self._num_saves = 0
        self._staging = StagingPool()
        """The publications' staging buckets, allocated once and reused once released."""
        self._saves: SaveStaging | None = None
        self.publications = PublicationsTakenUp()
        """The publications taken up (staged or failed), which a background save asked for
        with one waits for."""
        self._last_trained: tuple[int, str] | None = None
        """(rollout id, the version it improved upon) of the last rollout trained."""
        self._generated: dict[int, RolloutGenerated] = {}
        self._valued: dict[int, CriticStepFinished] = {}
        """PPO: rollouts generated, and rollouts the critic valued, until both are in."""
        self._probe_ids: tuple[list[list[int]], list[list[int]]] | None = None
        """The run's probe batch (prompt ids, response ids), when publications carry a probe."""
        self._offloaded_probe: ProbeBatch | None = None
        """The probe answered with the weights as they were offloaded (``run.offload_train``):
        the offloaded model runs no forward."""
        self._restarts = 0
        """Restarts of the group in the run (``control.max_restarts`` bounds them)."""
        self._hung: set[int] = set()
        """Ranks the heartbeat found hung (and killed)."""
        self._watcher: asyncio.Task[None] | None = None
        self._suspended = False
        """The group was stopped on purpose (an ``actor-{i}`` cell suspended) until resumed."""
        self._restoring = False
        """The group lost its state (failed, or suspended) and holds the run's start until the
        Coordinator's ``TrainerRestoreRequested``: what it was asked before that is not done
        (the Coordinator asks for it again from the checkpoint)."""
        self._gate: RolloutGate[RolloutGenerated] = RolloutGate(
            gates_training(config, "actor") and not context.plan.rollout_only
        )
        """Rollouts held until the engines released their memory (``run.offload_rollout``)."""
        self._bound = staleness_bound(config)
        """Asynchronous training (``run.max_staleness``): rollouts arrive ahead of their turn."""
        self._ahead: dict[int, RolloutGenerated] = {}
        """Asynchronously: rollouts generated, until their turn."""
        self._turn = context.plan.start_rollout_id
        """Asynchronously: the rollout trained next, once ``_turn_open``."""
        self._turn_open = True
        """The step before ``_turn`` is published (staged, and saved if asked): the weights
        and the state a publication or a save of it reads are not moved on before."""

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        group = trainer_worker_group("actor", config)
        if trainer_heals(config):
            # Every rank in a process of its own, rank 0 included: on ray the group holds a
            # bundle for the Trainer and one per rank.
            group = dataclasses.replace(group, num_ranks=group.num_ranks + 1)
        return group

    @classmethod
    def process_modules(cls, config: Config) -> list[str]:
        # Its backend (torch), and the model's transformers module (the built-in model is
        # built in this process: ``miles_events.runtime.base.Preparation``).
        modeling = modeling_module(config.model)
        return [cls.__module__, backend_module(config.trainer.backend), *([modeling] if modeling else [])]

    @property
    def backend(self) -> TrainerBackend:
        if self._backend is None:
            raise RuntimeError("the trainer has not started")
        return self._backend

    @property
    def saves(self) -> SaveStaging:
        """The train state's staging for saves, and the memory it holds."""
        if self._saves is None:
            raise RuntimeError("the trainer has not started")
        return self._saves

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        data = self.config.data
        if data.prompt_data:
            # Only the count is needed: the data cursor saved with each checkpoint.
            self.num_prompts = len(
                load_prompts(data.prompt_data, data.input_key, data.label_key, chat=data.apply_chat_template)
            )
        config = self.config
        if uses_rank_group(config):
            await self._start_group()
        else:
            self._backend = await anyio.to_thread.run_sync(lambda: build_backend(config))
        assert self._backend is not None
        self._saves = SaveStaging(
            self._backend,
            self.context.transport.stager,
            owner=self.name,
            mode=config.trainer.save_staging,
            periodic=config.run.save_interval is not None,
        )
        if self.context.plan.probe:
            assert config.model.path is not None
            vocab = await anyio.to_thread.run_sync(probe_vocab_size, config.model.path)
            self._probe_ids = probe_batch(vocab, config.run.seed)
        await self._load_start_state()
        plan = self.context.plan
        if plan.load_checkpoint is not None:
            # The saved version on resume; "default" for rollout-only (its first publication is "1").
            self.weight_version = plan.weight_version
            self.resumed_from = plan.load_checkpoint

    async def _load_start_state(self) -> None:
        """The state the run starts from: the checkpoint the plan chose (and verified: not
        hashed again) and the KL reference."""
        plan = self.context.plan
        if plan.load_checkpoint is not None:
            await anyio.to_thread.run_sync(self._load_checkpoint, Path(plan.load_checkpoint), False)
        if plan.reference_checkpoint is not None:
            await anyio.to_thread.run_sync(self._load_reference, Path(plan.reference_checkpoint))

    def _load_checkpoint(self, path: Path, verify: bool) -> None:
        loaded = read_checkpoint(path, verify=verify)
        state = loaded.trainer_state
        self.backend.load_state(loaded.weights, loaded.optimizer, loaded.rng, state.num_optimizer_steps)

    def _load_reference(self, path: Path) -> None:
        self.backend.load_reference(read_checkpoint(path, verify=False).weights)

    async def stop(self) -> None:
        self._stop_watching()
        try:
            if self._saves is not None:
                await self._saves.close()
            for held in [*self._held.values(), *([self._published] if self._published else [])]:
                self._free(held)
            self._held.clear()
            self._published = None
            self._staging.clear()
        finally:
            if self._backend is not None:
                await self._backend.close()

    def _free(self, ref: DataRef) -> None:
        self.context.transport.stager.free(ref)

    # --- healing (``"train"`` in ``run.ft_components``) -------------------------------------
    #
    # A rank that dies or hangs fails the call the group is in; the handler that made it
    # restarts the whole group (every rank in a process of its own) in its place, and says
    # so (``CellFailed``, ``CellRestarted``). The restarted group holds the state the run
    # started from; the Coordinator then asks for the latest checkpoint the run saved
    # (``TrainerRestoreRequested``) and has the rollouts after it done again. The heartbeat,
    # beside the handlers, only kills a rank that stopped answering.

    async def _start_group(self) -> None:
        heals = trainer_heals(self.config)
        backend = await RankGroupBackend.start(
            self.config, self.context, own_processes="all" if heals else True
        )
        self._backend = backend
        if self._saves is not None:
            self._saves.backend = backend
        if heals:
            self._hung.clear()
            self._watcher = self.spawn(self._watch_health(backend), emits=(CellHealth,))

    def _stop_watching(self) -> None:
        """Cancel the heartbeat of the group that is going away."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _restart_group(self, failure: RankDied | RankFailed, rollout_id: int | None) -> None:
        """The group failed (``failure``): stop every rank and start the group again, after
        its backoff, with the state the run started from; ``RestartsSpent`` (the run fails
        in one line) past ``control.max_restarts``."""
        if self._suspended:
            logger.info("the trainer's group is suspended: %s", failure)
            return  # stopped on purpose: its resume starts it, and the run goes back then
        self._restoring = True
        control = self.config.control
        failed_at = time.perf_counter()
        rank = failure.rank if failure.rank is not None else 0
        hung = rank in self._hung or (
            isinstance(failure, RankFailed) and isinstance(failure.error, TimeoutError)
        )
        reason = str(failure).splitlines()[0]
        while True:
            await self.publish(
                CellFailed(
                    cell=actor_cell(rank),
                    reason=reason,
                    hung=hung,
                    restarts=self._restarts,
                    rollout_id=rollout_id,
                )
            )
            self._stop_watching()
            if self._backend is not None:
                await self._backend.close()
                self._backend = None
            what = f"{actor_cell(rank)} (trainer rank {rank})"
            self._restarts = check_restart(what, self._restarts, control, reason)
            await self.context.clock.sleep(restart_backoff(self._restarts, control))
            try:
                await self._start_group()
                await self._load_start_state()
            except RANK_FAULTS as error:
                rank = error.rank if error.rank is not None else 0
                reason, hung = f"the trainer group did not start again: {brief_error(error)}", False
                continue
            break
        self._last_trained = None
        assert isinstance(self._backend, RankGroupBackend)
        for index, pid in enumerate(self._backend.pids):
            await self.publish(
                CellRestarted(
                    cell=actor_cell(index),
                    attempt=self._restarts,
                    pid=pid,
                    weight_version=self.weight_version,
                    restart_seconds=time.perf_counter() - failed_at,
                )
            )

    async def _watch_health(self, group: RankGroupBackend) -> None:
        """Each ``control.heartbeat_interval_seconds``, every rank answers a call from its
        process within ``heartbeat_timeout_seconds``; one that misses
        ``heartbeat_max_failures`` in a row (stopped, or stuck outside Python) is killed, so
        that the call waiting on it fails and the group is restarted."""
        control = self.config.control
        missed = [0] * len(group.workers)
        while True:
            await self.context.clock.sleep(control.heartbeat_interval_seconds)
            for rank in range(len(group.workers)):
                timeout = control.heartbeat_timeout_seconds
                try:
                    await wait_for(group.heartbeat(rank), timeout, self.context.clock)
                except TimeoutError:
                    reason = f"trainer rank {rank} did not answer its heartbeat within {timeout:g}s"
                except Exception as error:
                    # Gone: the call waiting on it fails and the group is restarted there.
                    await self.publish(
                        CellHealth(cell=actor_cell(rank), healthy=False, reason=brief_error(error))
                    )
                    return
                else:
                    if missed[rank]:
                        await self.publish(CellHealth(cell=actor_cell(rank), healthy=True))
                    missed[rank] = 0
                    continue
                missed[rank] += 1
                if missed[rank] == 1:
                    await self.publish(CellHealth(cell=actor_cell(rank), healthy=False, reason=reason))
                if missed[rank] >= control.heartbeat_max_failures:
                    logger.warning("%s (%d checks in a row): killing it", reason, missed[rank])
                    self._hung.add(rank)
                    await group.kill(rank)
                    return

    async def _suspend(self) -> None:
        """Stop the group now (an ``actor-{i}`` cell suspended: the trainer's ranks are one
        group): the step in progress fails and is done again once the group is resumed."""
        backend = self._backend
        if self._suspended or not isinstance(backend, RankGroupBackend):
            return
        self._suspended = True
        self._restoring = True
        self._stop_watching()
        for rank in range(len(backend.workers)):
            await backend.kill(rank)
        for rank in range(len(backend.workers)):
            await self.publish(CellSuspended(cell=actor_cell(rank)))

    @handles(CellSuspendRequested, emits=(CellResumed, *HEALING))
    async def on_cell_suspend_requested(self, event: CellSuspendRequested) -> None:
        """A resume of the suspended group (a suspension is taken at once, out of band): it
        starts again with the state the run started from, and the Coordinator has the
        latest checkpoint restored."""
        if event.suspend or not is_actor_cell(event.cell) or not self._suspended:
            return
        self._suspended = False
        if self._backend is not None:
            await self._backend.close()
            self._backend = None
        try:
            await self._start_group()
            await self._load_start_state()
        except RANK_FAULTS as error:
            await self._restart_group(error, None)
            return
        assert isinstance(self._backend, RankGroupBackend)
        for rank, pid in enumerate(self._backend.pids):
            await self.publish(
                CellResumed(cell=actor_cell(rank), pid=pid, weight_version=self.weight_version)
            )

    async def _inject(self, event: FaultInjectionRequested) -> None:
        """Deliver a fault to the process of the cell's rank (``actor-{rank}``)."""
        rank = int(event.cell.removeprefix("actor-"))
        backend = self._backend
        pids = (
            [backend.pids[rank]] if isinstance(backend, RankGroupBackend) and rank < len(backend.pids) else []
        )
        pid, error = deliver_fault(event.cell, pids, event.sub_index, event.mode)
        if error:
            logger.warning("fault not injected: %s", error)
        await self.publish(
            FaultInjected(cell=event.cell, mode=event.mode, pid=pid, sub_index=event.sub_index, error=error)
        )

    @handles(TrainerRestoreRequested, emits=(TrainerRestored, *HEALING))
    async def on_trainer_restore_requested(self, event: TrainerRestoreRequested) -> None:
        """Load the checkpoint the Coordinator chose (verified: it was written in this run,
        and is read back only now), or keep the run's start the group was started with."""
        if self._suspended:
            return  # suspended again meanwhile: its resume has the Coordinator ask again
        started = time.perf_counter()
        if event.checkpoint is not None:
            try:
                await anyio.to_thread.run_sync(self._load_checkpoint, Path(event.checkpoint), True)
            except RANK_FAULTS as error:
                if not trainer_heals(self.config):
                    raise
                await self._restart_group(error, None)
                return  # the Coordinator asks again once the group is back
        if self._suspended:
            return  # suspended while it loaded: its resume has the Coordinator ask again
        self._restoring = False
        logger.info(
            "the trainer holds %s again (rollout %d); its next publication follows version %s",
            event.checkpoint or "the run's start",
            event.rollout_id,
            self.weight_version,
        )
        await self.publish(
            TrainerRestored(
                checkpoint=event.checkpoint,
                rollout_id=event.rollout_id,
                weight_version=self.weight_version,
                restore_seconds=time.perf_counter() - started,
            )
        )

    # --- training --------------------------------------------------------------------------

    interrupt_types = (StopRequested, FaultInjectionRequested, CellSuspendRequested)

    def interrupt(self, event: Event) -> None:
        if isinstance(event, StopRequested) and event.now:
            self.cancel.cancel(event.reason)
        elif isinstance(event, FaultInjectionRequested) and is_actor_cell(event.cell):
            self.spawn(self._inject(event), emits=(FaultInjected,))
        elif isinstance(event, CellSuspendRequested) and event.suspend and is_actor_cell(event.cell):
            self.spawn(self._suspend(), emits=(CellSuspended,))

    @handles(
        RolloutGenerated,
        emits=(DataReleased, TrainStepFinished, StepCancelled, MemoryOnloaded, MemoryOffloaded, *HEALING),
    )
    async def on_rollout_generated(self, event: RolloutGenerated) -> None:
        if self.context.plan.rollout_only:
            return  # rollout-only from a checkpoint: nothing is trained (the loop releases the batch)
        if self._bound:
            self._ahead[event.rollout_id] = event
            await self._train_in_turn()
            return
        if not self.config.trainer.use_critic:
            ready = self._gate.arrived(event.rollout_id, event)
            if ready is not None:
                await self._train_rollout(ready, None)
            return
        # PPO: the critic values the rollout first (the seed's order); trained once it has.
        self._generated[event.rollout_id] = event
        await self._train_when_valued(event.rollout_id)

    async def _train_in_turn(self) -> None:
        """Asynchronously: train the rollouts whose turn came, in rollout order, each once the
        step before it is published."""
        while self._turn_open and self._turn in self._ahead:
            event = self._ahead.pop(self._turn)
            self._turn += 1
            self._turn_open = False
            await self._train_rollout(event, None)

    @handles(
        CriticStepFinished,
        emits=(DataReleased, TrainStepFinished, StepCancelled, MemoryOnloaded, MemoryOffloaded, *HEALING),
    )
    async def on_critic_step_finished(self, event: CriticStepFinished) -> None:
        self._valued[event.rollout_id] = event
        await self._train_when_valued(event.rollout_id)

    # --- offload and onload ------------------------------------------------------------------

    @handles(
        MemoryOffloaded,
        emits=(DataReleased, TrainStepFinished, StepCancelled, MemoryOnloaded, MemoryOffloaded, *HEALING),
    )
    async def on_memory_offloaded(self, event: MemoryOffloaded) -> None:
        ready = self._gate.released(event)
        if ready is not None:
            await self._train_rollout(ready, None)

    @handles(OffloadRequested, emits=(MemoryOffloaded,))
    async def on_offload_requested(self, event: OffloadRequested) -> None:
        """The seed's ``actor_model.offload()``."""
        if event.target == "actor":
            await self._offload(event.rollout_id, event.request_id)

    @handles(OnloadRequested, emits=(MemoryOnloaded,))
    async def on_onload_requested(self, event: OnloadRequested) -> None:
        """The seed's ``actor_model.onload()``."""
        if event.target == "actor":
            await self._onload(event.rollout_id, event.request_id)

    async def _offload(self, rollout_id: int | None, request_id: str = "") -> None:
        if not self.backend.offloaded:
            self._offloaded_probe = await anyio.to_thread.run_sync(self._probe)
            self._staging.drop_idle()
        await self.publish(await offload_group(self.backend, "actor", rollout_id, request_id))

    async def _onload(self, rollout_id: int | None, request_id: str = "") -> None:
        await self.publish(await onload_group(self.backend, "actor", rollout_id, request_id))
        self._offloaded_probe = None

    async def _train_when_valued(self, rollout_id: int) -> None:
        if rollout_id in self._generated and rollout_id in self._valued:
            await self._train_rollout(self._generated.pop(rollout_id), self._valued.pop(rollout_id))

    async def _train_rollout(self, event: RolloutGenerated, valued: CriticStepFinished | None) -> None:
        """Train on the rollout (with PPO, on the GAE advantages of the critic's values
        ``valued``; before ``num_critic_only_steps``, not at all), then release its data."""
        if self._restoring:
            # Asked for before the group lost its state: done again after the restore.
            for ref in [event.batch] + ([valued.values] if valued is not None else []):
                await self.publish(DataReleased(ref=ref))
            return
        started = time.perf_counter()
        # The version being improved upon: the one in force when the batch arrives.
        version = self.weight_version
        trainer = self.config.trainer
        critic_only = valued is not None and event.rollout_id < trainer.num_critic_only_steps
        reader = self.context.transport.reader
        if not critic_only and self.backend.offloaded:
            await self._onload(event.rollout_id)  # the seed's ``train`` wakes the model up

        def read_and_train() -> tuple[RolloutBatch, TrainMetrics, list[RankStep], Staleness | None]:
            batch = msgspec.msgpack.decode(reader.get_bytes(event.batch), type=RolloutBatch)
            if critic_only:
                return batch, TrainMetrics(), [], None
            aged = within_bound(
                finite_part(batch, trainer.on_non_finite),
                version,
                self._bound or None,
                self.config.run.staleness_policy,
            )
            trainable = aged.batch
            if not trainable.samples:
                return batch, TrainMetrics(), [], aged
            if valued is not None:
                trainable = self._with_advantages(trainable, reader.get_bytes(valued.values))
            with phase_threads(trainer.num_threads):
                metrics = self.backend.train(trainable, self.cancel)
            return batch, metrics, self.backend.rank_steps(), aged

        cancelled: Cancelled | None = None
        fault: RankDied | RankFailed | None = None
        try:
            batch, metrics, ranks, aged = await anyio.to_thread.run_sync(read_and_train)
            if not critic_only and valued is None and not self.config.run.offload_train:
                # The seed's ``clear_memory()`` (not with a critic). A group that fails (or is
                # suspended) here has lost the step with its state, as one failing in it.
                await anyio.to_thread.run_sync(self.backend.clear_memory)
        except Cancelled as error:
            cancelled = error
        except RANK_FAULTS as error:
            if not trainer_heals(self.config):
                raise
            fault = error
        finally:
            # Released even when training raises (the seed's ``finally``): its owner frees it.
            for ref in [event.batch] + ([valued.values] if valued is not None else []):
                await self.publish(DataReleased(ref=ref))
        if fault is not None:
            await self._restart_group(fault, event.rollout_id)
            return
        if cancelled is not None:
            await self.publish(
                StepCancelled(rollout_id=event.rollout_id, phase="train", reason=str(cancelled))
            )
            return
        if not critic_only:
            self._last_trained = (event.rollout_id, version)
            if self.config.run.offload_train and valued is not None:
                await self._offload(event.rollout_id)  # with a critic, each group after its step
        await self.publish(
            TrainStepFinished(
                rollout_id=event.rollout_id,
                weight_version=version,
                metrics=metrics,
                staleness_max=staleness_max(version, [s.weight_version for s in batch.samples]),
                token_staleness=aged.histogram if aged is not None else [],
                stale_samples=aged.stale_samples if aged is not None else 0,
                stale_tokens=aged.stale_tokens if aged is not None else 0,
                trained_prompts=[s.index for s in aged.batch.samples]
                if aged and metrics.train_tokens
                else [],
                train_seconds=time.perf_counter() - started,
                critic_only=critic_only,
                ranks=ranks,
            )
        )

    def _with_advantages(self, batch: RolloutBatch, values_data: bytes) -> RolloutBatch:
        """``batch`` with every sample's GAE advantages from the critic's values of it."""
        from actors.trainer_backend.ppo import sample_advantages

        trainer = self.config.trainer
        valued = msgspec.msgpack.decode(values_data, type=CriticValues).values
        missing = [i for i in range(len(batch.samples)) if i not in valued]
        if missing:
            raise ValueError(
                f"rollout {batch.rollout_id}: the critic valued {len(valued)} of {len(batch.samples)} samples "
                f"(none for sample position {missing[0]})"
            )
        values = [valued[i] for i in range(len(batch.samples))]
        advantages = sample_advantages(
            [s.reward for s in batch.samples],
            values,
            gamma=trainer.gamma,
            lambd=trainer.lambd,
            normalize=trainer.normalize_advantages,
        )
        return msgspec.structs.replace(
            batch,
            samples=[
                msgspec.structs.replace(sample, advantages=a)
                for sample, a in zip(batch.samples, advantages, strict=True)
            ],
        )

    # --- publication -----------------------------------------------------------------------

    def _probe(self) -> ProbeBatch | None:
        """The publication's behavioural probe with the weights as they are now."""
        if self._probe_ids is None:
            return None
        if self.backend.offloaded:
            return self._offloaded_probe
        prompts, responses = self._probe_ids
        return ProbeBatch(prompts, responses, self.backend.probe_logprobs(prompts, responses))

    def _stage_weights(self, version: str, dtype: torch.dtype) -> StagedWeights:
        # The payload also carries this publication's canary, which only a load that
        # applies it can show (miles_events.rl.canary); it is in no digest. It has a bucket
        # of its own (uint8), after the weights' buckets.
        canary = {CANARY_TENSOR: publication_canary(self.context.run_id, version)}
        key = f"weights-v{version}"
        buckets = weights_copy(self.backend, dtype, extra=plan_layouts(canary), pool=self._staging)
        self._staging.lend(key, buckets)
        try:
            Buckets(buckets.layouts[-1:], buckets.buffers[-1:]).pack(canary)
            require_finite_buckets(buckets, f"weight version {version}")
            # The skip list applies here as on the engines: digests are compared whole.
            checksums = fingerprint_buckets(buckets, [*skip_tensor_list(self.config), CANARY_TENSOR])
            ref = self.context.transport.stager.publish_buckets(key, buckets, owner=self.name)
        except BaseException:
            self._staging.give_back(key)  # nobody has read it
            raise
        digest, manifest = write_manifest(self.context.run_dir, checksums)
        return StagedWeights(
            ref=ref,
            digest=digest,
            manifest=manifest,
            num_tensors=len(checksums),
            num_bytes=buckets.tensor_bytes,
            canary=tensor_fingerprint(canary[CANARY_TENSOR]),
        )

    @handles(
        PublishRequested,
        emits=(
            WeightsStaged,
            DataReleased,
            TrainStepFinished,
            StepCancelled,
            MemoryOnloaded,
            MemoryOffloaded,
            *HEALING,
        ),
    )
    async def on_publish_requested(self, event: PublishRequested) -> None:
        await self._publish_step(event)
        if self._bound and event.rollout_id is not None and event.rollout_id == self._turn - 1:
            self._turn_open = True  # its weights are staged: the next rollout may train
            await self._train_in_turn()

    async def _publish_step(self, event: PublishRequested) -> None:
        try:
            if self._restoring:
                return  # asked for before the group lost its state: the restore's comes after
            await self._publish_weights(event)
            self.saves.prepare_memory_soon(self._num_saves, lambda work: self.spawn(work, emits=()))
        except RANK_FAULTS as error:
            if not trainer_heals(self.config):
                raise
            await self._restart_group(error, event.rollout_id)
        finally:  # staged or failed: a save waiting for it goes on
            if event.rollout_id is not None:
                self.publications.take_up(event.rollout_id)

    async def _publish_weights(self, event: PublishRequested) -> None:
        started = time.perf_counter()
        version = next_version(self.weight_version)
        engine_dtype = torch_dtype(self.config.model.dtype)
        staged = await anyio.to_thread.run_sync(self._stage_weights, version, engine_dtype)
        probe = await anyio.to_thread.run_sync(self._probe)
        previous, self._published = self._published, staged.ref
        if previous is not None and engines_heal(self.config):
            # The last publication stays until the Publisher releases it, after this one:
            # an engine restarted meanwhile loads it again.
            self._held[previous.key] = previous
        elif previous is not None:  # its readers have not said they are done: not reused
            self._staging.forget(previous.key)
            self._free(previous)
        self.weight_version = version
        self._manifests[version] = staged.manifest
        await self.publish(
            WeightsStaged(
                weight_version=version,
                weights=staged.ref,
                digest=staged.digest,
                num_tensors=staged.num_tensors,
                num_bytes=staged.num_bytes,
                checksums_manifest=staged.manifest,
                rollout_id=event.rollout_id,
                stage_seconds=time.perf_counter() - started,
                canary=staged.canary,
                probe=probe,
            )
        )

    @handles(PublicationVerified, emits=())
    async def on_publication_verified(self, event: PublicationVerified) -> None:
        # Every engine serves these digests: nobody will need the tensor names behind them.
        self._drop_manifest(event.weight_version)

    @handles(WeightsPublished, emits=())
    async def on_weights_published(self, event: WeightsPublished) -> None:
        if not self.config.verifier.enabled:
            self._drop_manifest(event.weight_version)

    @handles(RestoreVerified, emits=())
    async def on_restore_verified(self, event: RestoreVerified) -> None:
        # A restarted engine wrote the manifest of a verified publication again.
        remove_manifest(self.context.run_dir, manifest_path(event.digest))

    def _drop_manifest(self, weight_version: str) -> None:
        manifest = self._manifests.pop(weight_version, None)
        if manifest is not None:
            remove_manifest(self.context.run_dir, manifest)

    @handles(DataReleased, emits=())
    async def on_data_released(self, event: DataReleased) -> None:
        if event.ref.owner != self.name:
            return
        # Every engine is done with it, though its copies may still be running on the GPU.
        self._staging.give_back(event.ref.key, self.context.transport.stager.reads_of(event.ref))
        self._free(event.ref)
        self.saves.released(event.ref.key)
        if self._published is not None and self._published.key == event.ref.key:
            self._published = None
        self._held.pop(event.ref.key, None)

    # --- external policy sync ----------------------------------------------------------------

    @handles(ModelWeightsRequested, emits=(ModelWeightsStaged,))
    async def on_model_weights_requested(self, event: ModelWeightsRequested) -> None:
        if event.role == "actor":
            transport = self.context.transport
            await self.publish(
                await weights_staged(self.backend, transport, event, self.name, self.weight_version)
            )

    @handles(ModelWeightsLoadRequested, emits=(ModelWeightsLoaded, MemoryOnloaded, MemoryOffloaded))
    async def on_model_weights_load_requested(self, event: ModelWeightsLoadRequested) -> None:
        if event.role != "actor":
            return
        # Offloaded, the trainer wakes up to load them, so that the next publication's probe
        # is answered with them, and goes back to sleep.
        offloaded = self.backend.offloaded
        if offloaded:
            await self._onload(None)
        try:
            loaded = await weights_loaded(self.backend, self.context.transport, event)
        finally:
            if offloaded:
                await self._offload(None)
        await self.publish(loaded)

    # --- checkpoints -----------------------------------------------------------------------

    @handles(SaveRequested, emits=(TrainStateStaged, *HEALING))
    async def on_save_requested(self, event: SaveRequested) -> None:
        if self._restoring:
            return  # asked for before the group lost its state: asked again when trained again
        if self._bound and self._last_trained is not None and self._last_trained[0] > event.rollout_id:
            # Asynchronously the Coordinator asks for a step's save before the next is trained;
            # the state here is a later step's, which a checkpoint of this one must not hold.
            raise RuntimeError(
                f"asked to save rollout {event.rollout_id} after training rollout {self._last_trained[0]}"
            )
        self._num_saves += 1
        # The counter keeps keys unique when one rollout is saved twice (say, sentinel then last).
        prefix = f"train-state-r{event.rollout_id}-{self._num_saves}"
        try:
            snapshot = await anyio.to_thread.run_sync(self.saves.snapshot, prefix)
        except RANK_FAULTS as error:
            if not trainer_heals(self.config):
                raise
            await self._restart_group(error, event.rollout_id)
            return
        trainer_state = self._trainer_state(event.rollout_id)
        if snapshot.background:
            # The host copy, serialisation and staging go on beside the next events; the
            # Saver hears of the state when it is staged. They start once the publication
            # asked for with this save is taken up, which then shares the process with none
            # of it (a staging beside it, as beside the first save's pinning, is far slower).
            after_publication = event.publication_follows and not self.publications.taken_up(event.rollout_id)
            self.spawn(
                self._stage_and_announce(event, prefix, snapshot, trainer_state, after_publication),
                emits=(TrainStateStaged,),
            )
        else:
            await self._stage_and_announce(event, prefix, snapshot, trainer_state)

    async def _stage_and_announce(
        self,
        event: SaveRequested,
        prefix: str,
        snapshot: TrainStateSnapshot,
        trainer_state: TrainerState,
        after_publication: bool = False,
    ) -> None:
        try:
            if after_publication:
                if not await self.publications.wait(event.rollout_id, PUBLICATION_WAIT_SECONDS):
                    logger.warning(
                        "the publication asked for with the save of rollout %d was not staged within %gs: "
                        "staging the save",
                        event.rollout_id,
                        PUBLICATION_WAIT_SECONDS,
                    )
            staged = await anyio.to_thread.run_sync(self.saves.stage, prefix, snapshot)
        finally:
            self.saves.copies_back(prefix)  # staged, failed or cancelled: not read again
        await self.publish(
            TrainStateStaged(
                rollout_id=event.rollout_id,
                weights=staged.weights,
                optimizer=staged.optimizer,
                rng=staged.rng,
                trainer_state=trainer_state,
                reason=event.reason,
            )
        )

    def _trainer_state(self, rollout_id: int) -> TrainerState:
        # The version the saved weights had when trained: a save asked for after the step's
        # publication (a stop) records what one asked for before it would, so a resumed run
        # republishes these weights under the same number as the uninterrupted run did.
        version = self.weight_version
        if self._last_trained is not None and self._last_trained[0] == rollout_id:
            version = self._last_trained[1]
        return TrainerState(
            rollout_id=rollout_id,
            weight_version=version,
            num_optimizer_steps=self.backend.num_optimizer_steps,
            data=data_cursor(rollout_id + 1, self.config.data.rollout_batch_size, self.num_prompts),
            seed=self.config.run.seed,
            run_id=self.context.run_id,
            lineage=self.context.plan.lineage or self.context.run_id,
        )


@dataclass(frozen=True)
class StagedWeights:
    """A publication's weights as staged (``Trainer._stage_weights``)."""

    ref: DataRef
    digest: str
    manifest: str
    """The checksum manifest written for it (``miles_events.rl.checksum_manifest``)."""
    num_tensors: int
    """Tensors in the digest."""
    num_bytes: int
    """Bytes staged."""
    canary: str
    """The fingerprint of the publication's canary."""
