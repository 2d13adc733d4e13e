"""The Critic actor: PPO's value model, a trainer group of its own (the seed's ``critic``).

Only a run with ``trainer.use_critic`` has one. On every ``RolloutGenerated`` it values each
response token of the rollout with its weights as they are (the values the policy's GAE
advantages are computed from), stages those values in the data plane and trains on the
rollout with PPO's clipped value loss towards their GAE returns, then says so with
``CriticStepFinished``. The Trainer trains the policy once it hears it (the seed's order:
the critic first), from ``trainer.num_critic_only_steps`` on, and releases the values.

It answers ``SaveRequested`` with ``CriticStateStaged`` (its weights, optimizer and RNG
state), which the Saver writes into the step's checkpoint beside the policy's (the seed
saves the critic at every save). It starts from a checkpoint's critic where the run plan
names one (``run.resume``, ``run.load``, ``run.critic_load``), else from the policy's base
model with a value head of zeros.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from actors.protocols.memory import RolloutGate, gates_training
from actors.trainer_backend.model_weights import weights_loaded, weights_staged
from actors.trainer_backend.offload import offload_group, onload_group
from actors.trainer_backend.rank_group import RankGroupBackend, trainer_worker_group, uses_rank_group
from actors.trainer_backend.save_staging import SaveStaging
from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.checkpoint.format import read_critic
from miles_events.device.threads import phase_threads
from miles_events.rl.finite import finite_part
from schemas.config import Config, critic_config
from schemas.events import (
    CriticMetrics,
    CriticStateStaged,
    CriticStepFinished,
    DataReleased,
    Event,
    MemoryOffloaded,
    MemoryOnloaded,
    ModelWeightsLoaded,
    ModelWeightsLoadRequested,
    ModelWeightsRequested,
    ModelWeightsStaged,
    OffloadRequested,
    OnloadRequested,
    RankStep,
    RolloutGenerated,
    SaveRequested,
    StepCancelled,
    StopRequested,
)
from schemas.rollout import CriticValues, RolloutBatch

if TYPE_CHECKING:
    from actors.trainer_backend.critic_backend import TorchCriticBackend


class Critic(Actor):
    """Consumes ``RolloutGenerated``, ``SaveRequested`` and ``DataReleased``; emits
    ``CriticStepFinished`` and ``CriticStateStaged``."""

    name = "critic"

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self._backend: TorchCriticBackend | RankGroupBackend | None = None
        self._saves: SaveStaging | None = None
        self.cancel = Cancellation()
        self._num_saves = 0
        self._gate: RolloutGate[RolloutGenerated] = RolloutGate(gates_training(config, "critic"))
        """Rollouts held until the engines released their memory (``run.offload_rollout``)."""

    @classmethod
    def wanted(cls, config: Config) -> bool:
        return config.trainer.use_critic

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        return trainer_worker_group("critic", critic_config(config))

    @classmethod
    def process_modules(cls, config: Config) -> list[str]:
        return [cls.__module__, "actors.trainer_backend.critic_backend"]

    @property
    def backend(self) -> TorchCriticBackend | RankGroupBackend:
        if self._backend is None:
            raise RuntimeError("the critic has not started")
        return self._backend

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        config = critic_config(self.config)
        if uses_rank_group(config):
            self._backend = await RankGroupBackend.start(config, self.context, role="critic")
        else:
            from actors.trainer_backend.critic_backend import TorchCriticBackend

            self._backend = await anyio.to_thread.run_sync(lambda: TorchCriticBackend(self.config))
        # Copied to the host at once: the critic's saves are small beside the policy's.
        self._saves = SaveStaging(
            self._backend, self.context.transport.stager, owner=self.name, mode="inline", periodic=False
        )
        checkpoint = self.context.plan.critic_checkpoint
        if checkpoint is not None:
            await anyio.to_thread.run_sync(self._restore, Path(checkpoint))

    def _restore(self, path: Path) -> None:
        loaded = read_critic(path)
        self.backend.load_state(loaded.weights, loaded.optimizer, loaded.rng, loaded.num_optimizer_steps)

    async def stop(self) -> None:
        try:
            if self._saves is not None:
                await self._saves.close()
        finally:
            if self._backend is not None:
                await self._backend.close()

    def interrupt(self, event: Event) -> None:
        if isinstance(event, StopRequested) and event.now:
            self.cancel.cancel(event.reason)

    # --- training --------------------------------------------------------------------------

    def _train(self, batch: RolloutBatch) -> tuple[CriticMetrics, dict[int, list[float]], list[RankStep]]:
        backend = self.backend
        with phase_threads(self.config.trainer.num_threads):
            metrics = backend.train_critic(batch, self.cancel)
        return metrics, backend.values, backend.rank_steps()

    @handles(RolloutGenerated, emits=(CriticStepFinished, StepCancelled, MemoryOnloaded, MemoryOffloaded))
    async def on_rollout_generated(self, event: RolloutGenerated) -> None:
        ready = self._gate.arrived(event.rollout_id, event)
        if ready is not None:
            await self._train_rollout(ready)

    @handles(MemoryOffloaded, emits=(CriticStepFinished, StepCancelled, MemoryOnloaded, MemoryOffloaded))
    async def on_memory_offloaded(self, event: MemoryOffloaded) -> None:
        ready = self._gate.released(event)
        if ready is not None:
            await self._train_rollout(ready)

    @handles(OffloadRequested, emits=(MemoryOffloaded,))
    async def on_offload_requested(self, event: OffloadRequested) -> None:
        """The seed's ``critic_model.offload()``."""
        if event.target == "critic":
            await self.publish(
                await offload_group(self.backend, "critic", event.rollout_id, event.request_id)
            )

    @handles(OnloadRequested, emits=(MemoryOnloaded,))
    async def on_onload_requested(self, event: OnloadRequested) -> None:
        """The seed's ``critic_model.onload()``."""
        if event.target == "critic":
            await self.publish(await onload_group(self.backend, "critic", event.rollout_id, event.request_id))

    async def _train_rollout(self, event: RolloutGenerated) -> None:
        # The batch stays the Generator's: the Trainer, which reads it after this, releases it.
        started = time.perf_counter()
        if self.backend.offloaded:  # the seed's ``train`` wakes the model up
            await self.publish(await onload_group(self.backend, "critic", event.rollout_id))

        def read_and_train() -> tuple[CriticMetrics, dict[int, list[float]], list[RankStep]]:
            batch = msgspec.msgpack.decode(
                self.context.transport.reader.get_bytes(event.batch), type=RolloutBatch
            )
            trainable = finite_part(batch, self.config.trainer.on_non_finite, "the critic")
            if not trainable.samples:
                return CriticMetrics(), {}, []
            return self._train(trainable)

        try:
            metrics, values, ranks = await anyio.to_thread.run_sync(read_and_train)
        except Cancelled as cancelled:
            await self.publish(
                StepCancelled(rollout_id=event.rollout_id, phase="train", reason=str(cancelled))
            )
            return
        if self.config.run.offload_train:  # the seed offloads the critic right after its step
            await self.publish(await offload_group(self.backend, "critic", event.rollout_id))
        ref = self.context.transport.stager.put_bytes(
            f"critic-values-r{event.rollout_id}",
            msgspec.msgpack.encode(CriticValues(rollout_id=event.rollout_id, values=values)),
            owner=self.name,
        )
        await self.publish(
            CriticStepFinished(
                rollout_id=event.rollout_id,
                values=ref,
                metrics=metrics,
                train_seconds=time.perf_counter() - started,
                ranks=ranks,
            )
        )

    @handles(DataReleased, emits=())
    async def on_data_released(self, event: DataReleased) -> None:
        if event.ref.owner != self.name:
            return
        self.context.transport.stager.free(event.ref)
        if self._saves is not None:
            self._saves.released(event.ref.key)

    # --- external policy sync ----------------------------------------------------------------

    @handles(ModelWeightsRequested, emits=(ModelWeightsStaged,))
    async def on_model_weights_requested(self, event: ModelWeightsRequested) -> None:
        if event.role == "critic":
            await self.publish(
                await weights_staged(self.backend, self.context.transport, event, self.name, "")
            )

    @handles(ModelWeightsLoadRequested, emits=(ModelWeightsLoaded,))
    async def on_model_weights_load_requested(self, event: ModelWeightsLoadRequested) -> None:
        if event.role == "critic":
            await self.publish(await weights_loaded(self.backend, self.context.transport, event))

    # --- checkpoints -----------------------------------------------------------------------

    @handles(SaveRequested, emits=(CriticStateStaged,))
    async def on_save_requested(self, event: SaveRequested) -> None:
        assert self._saves is not None
        self._num_saves += 1
        prefix = f"critic-state-r{event.rollout_id}-{self._num_saves}"
        saves = self._saves
        snapshot = await anyio.to_thread.run_sync(saves.snapshot, prefix)
        try:
            staged = await anyio.to_thread.run_sync(saves.stage, prefix, snapshot)
        finally:
            saves.copies_back(prefix)
        await self.publish(
            CriticStateStaged(
                rollout_id=event.rollout_id,
                weights=staged.weights,
                optimizer=staged.optimizer,
                rng=staged.rng,
                num_optimizer_steps=self.backend.num_optimizer_steps,
            )
        )
