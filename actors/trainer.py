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
import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from actors.trainer_backend import backend_module, build_backend
from actors.trainer_backend.base import TrainerBackend
from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.checkpoint.format import read_checkpoint
from miles_events.device.buckets import Buckets, fingerprint_buckets, plan_layouts, require_finite_buckets
from miles_events.device.fingerprint import tensor_fingerprint
from miles_events.device.host_copy import (
    DeviceArenaPool,
    PinnedArena,
    PinnedPool,
    Signature,
    capture_point,
    copy_to_host,
    map_tensors,
    tensors_of,
)
from miles_events.device.staging import StagingPool
from miles_events.device.threads import phase_threads
from miles_events.rl.canary import CANARY_TENSOR, publication_canary
from miles_events.rl.checksum_manifest import remove_manifest, write_manifest
from miles_events.rl.finite import (
    NonFiniteError,
    describe_samples,
    non_finite_rewards,
    )
from miles_events.rl.hf_model import modeling_module, torch_dtype
from miles_events.rl.probe import probe_batch, probe_vocab_size
from miles_events.rl.prompts import data_cursor, load_prompts
from miles_events.rl.versions import next_version, version_number
from schemas.checkpoint import TrainerState
from schemas.config import Config
from schemas.data import BucketLayout, DataRef
from schemas.events import (
    DataReleased,
    ProbeBatch,
    PublicationVerified,
    PublishRequested,
    RolloutGenerated,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TrainMetrics,
    TrainStateStaged,
    TrainStepFinished,
    WeightsPublished,
    WeightsStaged,
)
from schemas.rollout import RolloutBatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PUBLICATION_WAIT_SECONDS = 60.0
"""How long a save staged in the background waits for the publication asked for with it
to be staged before it stages anyway (that publication always comes right behind it)."""

PIN_WAIT_SECONDS = 60.0
"""How long the trainer's stop waits for the pinning of a save's host memory under way
(``PinnedPool.prepare``: seconds for a large state) before it closes the pool anyway."""


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
        self._manifests: dict[str, str] = {}
        """Weight version -> the checksum manifest written for it, until it is verified."""
        self._num_saves = 0
        self._staging = StagingPool()
        """The publications' staging buckets, allocated once and reused once released."""
        self._pinned = PinnedPool()
        """Pinned host memory for saves staged in the background, pinned once, reused."""
        self._save_memory_prepared = False
        """Whether the first periodic save's pinned memory was asked for ahead of it."""
        self._preparing_save_memory: asyncio.Task[None] | None = None
        self._snapshot_buckets = StagingPool()
        """On a GPU, the buckets a background save copies the weights into, until they are
        on the host; then the next save's."""
        self._snapshot_arenas: DeviceArenaPool | None = None
        """On a GPU, the same for the optimizer's tensors."""
        self._snapshot_lent: dict[str, PinnedArena | None] = {}
        """Saves whose copies on the GPU are not on the host yet: prefix -> the arena."""
        self._publication_staged: dict[int, anyio.Event] = {}
        """Rollout id -> set once the publication asked for with its save is staged."""
        self._last_publication: int | None = None
        """The rollout of the last publication taken up (staged or failed)."""
        self._arenas: dict[str, tuple[PinnedArena, set[str]]] = {}
        """A staged save's pinned arena and the keys of its data the Saver has yet to
        release, by save."""
        self._last_trained: tuple[int, str] | None = None
        """(rollout id, the version it improved upon) of the last rollout trained."""
        self._probe_ids: tuple[list[list[int]], list[list[int]]] | None = None
        """The run's probe batch (prompt ids, response ids), when publications carry a probe."""

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        return WorkerGroup(role="actor", cpus_per_rank=1)

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

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        data = self.config.data
        if data.prompt_data:
            # Only the count is needed: the data cursor saved with each checkpoint.
            self.num_prompts = len(load_prompts(data.prompt_data, data.input_key, data.label_key))
        config = self.config
        self._backend = await anyio.to_thread.run_sync(lambda: build_backend(config))
        if self.context.plan.probe:
            assert config.model.path is not None
            vocab = await anyio.to_thread.run_sync(probe_vocab_size, config.model.path)
            self._probe_ids = probe_batch(vocab, config.run.seed)
        plan = self.context.plan
        if plan.load_checkpoint is not None:
            await anyio.to_thread.run_sync(self._restore, Path(plan.load_checkpoint))
        if plan.reference_checkpoint is not None:
            await anyio.to_thread.run_sync(self._load_reference, Path(plan.reference_checkpoint))

    def _restore(self, path: Path) -> None:
        # The plan chose and verified this checkpoint for this run: not hashed again.
        loaded = read_checkpoint(path, verify=False)
        state = loaded.trainer_state
        self.backend.load_state(loaded.weights, loaded.optimizer, loaded.rng, state.num_optimizer_steps)
        # The saved version on resume; "default" for rollout-only (its first publication is "1").
        self.weight_version = self.context.plan.weight_version
        self.resumed_from = str(path)

    def _load_reference(self, path: Path) -> None:
        self.backend.load_reference(read_checkpoint(path, verify=False).weights)

    async def stop(self) -> None:
        if self._preparing_save_memory is not None:  # a pinning under way ends before the pool closes
            await asyncio.wait({self._preparing_save_memory}, timeout=PIN_WAIT_SECONDS)
        self._pinned.close()
        if self._published is not None:
            self._free(self._published)
            self._published = None
        self._staging.clear()
        self._snapshot_buckets.clear()
        self._snapshot_arenas = None

    def _free(self, ref: DataRef) -> None:
        self.context.transport.free(ref)

    # --- training --------------------------------------------------------------------------

    def interrupt(self, event: StopRequested) -> None:
        if event.now:
            self.cancel.cancel(event.reason)

    @handles(RolloutGenerated, emits=(DataReleased, TrainStepFinished, StepCancelled))
    async def on_rollout_generated(self, event: RolloutGenerated) -> None:
        if self.context.plan.rollout_only:
            return  # rollout-only from a checkpoint: nothing is trained (the loop releases the batch)
        started = time.perf_counter()
        # The version being improved upon: the one in force when the batch arrives.
        version = self.weight_version

        def read_and_train() -> tuple[RolloutBatch, TrainMetrics]:
            data = self.context.transport.get_bytes(event.batch)
            batch = msgspec.msgpack.decode(data, type=RolloutBatch)
            trainable = self._finite_part(batch)
            if not trainable.samples:
                return batch, TrainMetrics()
            with phase_threads(self.config.trainer.num_threads):
                return batch, self.backend.train(trainable, self.cancel)

        try:
            batch, metrics = await anyio.to_thread.run_sync(read_and_train)
        except Cancelled as cancelled:
            await self.publish(DataReleased(ref=event.batch))
            await self.publish(StepCancelled(rollout_id=event.rollout_id, phase="train", reason=str(cancelled)))
            return
        except BaseException:
            # Released even when training raises (the seed's ``finally``): its owner frees it.
            await self.publish(DataReleased(ref=event.batch))
            raise
        await self.publish(DataReleased(ref=event.batch))
        self._last_trained = (event.rollout_id, version)
        await self.publish(
            TrainStepFinished(
                rollout_id=event.rollout_id,
                weight_version=version,
                metrics=metrics,
                staleness_max=staleness_max(version, [s.weight_version for s in batch.samples]),
                train_seconds=time.perf_counter() - started,
            )
        )

    def _finite_part(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch to train on, as ``trainer.on_non_finite`` says for non-finite rewards."""
        rewards = [s.reward for s in batch.samples]
        bad = non_finite_rewards(rewards)
        if not bad:
            return batch
        policy = self.config.trainer.on_non_finite
        what = describe_samples(batch.rollout_id, bad, rewards)
        if policy == "fail":
            raise NonFiniteError(f"{what} (trainer.on_non_finite = 'fail')")
        if policy == "skip_step":
            logger.warning("%s: the rollout is not trained on (trainer.on_non_finite = 'skip_step')", what)
            return msgspec.structs.replace(batch, samples=[])
        logger.warning("%s: those samples are left out (trainer.on_non_finite = 'skip_sample')", what)
        drop = set(bad)
        return msgspec.structs.replace(batch, samples=[s for i, s in enumerate(batch.samples) if i not in drop])

    # --- publication -----------------------------------------------------------------------

    def _probe(self) -> ProbeBatch | None:
        """The publication's behavioural probe with the weights as they are now."""
        if self._probe_ids is None:
            return None
        prompts, responses = self._probe_ids
        return ProbeBatch(prompts, responses, self.backend.probe_logprobs(prompts, responses))

    def _stage_weights(self, version: str, dtype: torch.dtype) -> tuple[DataRef, str, str, int, int, str]:
        """(ref, digest, checksum manifest, tensors in the digest, bytes staged, canary)."""
        # The payload also carries this publication's canary, which only a load that
        # applies it can show (miles_events.rl.canary); it is in no digest. It has a bucket
        # of its own (uint8), after the weights' buckets.
        canary = {CANARY_TENSOR: publication_canary(self.context.run_id, version)}
        key = f"weights-v{version}"
        buckets = self._weights_copy(dtype, extra=plan_layouts(canary), pool=self._staging)
        self._staging.lend(key, buckets)
        try:
            Buckets(buckets.layouts[-1:], buckets.buffers[-1:]).pack(canary)
            require_finite_buckets(buckets, f"weight version {version}")
            # The skip list applies here as on the engines: digests are compared whole.
            checksums = fingerprint_buckets(buckets, [*self.config.verifier.skip_tensor_list, CANARY_TENSOR])
            ref = self.context.transport.put_buckets(key, buckets, owner=self.name)
        except BaseException:
            self._staging.give_back(key)  # nobody has read it
            raise
        digest, manifest = write_manifest(self.context.run_dir, checksums)
        return ref, digest, manifest, len(checksums), buckets.tensor_bytes, tensor_fingerprint(canary[CANARY_TENSOR])

    def _weights_copy(
        self, dtype: torch.dtype | None = None, extra: tuple[BucketLayout, ...] = (), pool: StagingPool | None = None
    ) -> Buckets:
        """A copy of the weights (``named_weights``), converted to ``dtype``, in flat buckets
        on their device, followed by empty buckets laid out as ``extra`` (the caller fills
        them): one copy per bucket where the backend trains them in buckets of that dtype
        already, else packed by one ``torch.cat`` per dtype. Into buckets of ``pool`` where
        given (staged before and given back), else new ones."""
        import torch

        own = self.backend.weight_buckets()
        with torch.no_grad():
            if own is not None and all(dtype in (None, buffer.dtype) for buffer in own.buffers):
                layouts, device, weights = own.layouts, own.device, None
            else:
                weights = self.backend.named_weights(dtype)
                layouts = plan_layouts(weights)
                device = next(iter(weights.values())).device if weights else torch.device("cpu")
            every = layouts + tuple(extra)
            copy = pool.take(every, device) if pool is not None else Buckets.allocate(every, device)
            part = Buckets(layouts, copy.buffers[: len(layouts)])
            if weights is None:
                assert own is not None
                part.copy_from(own)
            else:
                part.pack(weights)
        return copy

    @handles(PublishRequested, emits=(WeightsStaged,))
    async def on_publish_requested(self, event: PublishRequested) -> None:
        try:
            await self._publish_weights(event)
            self._prepare_save_memory_soon()
        finally:  # staged or failed: a save waiting for it goes on
            if event.rollout_id is not None:
                self._last_publication = event.rollout_id
                staged = self._publication_staged.pop(event.rollout_id, None)
                if staged is not None:
                    staged.set()

    async def _publish_weights(self, event: PublishRequested) -> None:
        started = time.perf_counter()
        version = next_version(self.weight_version)
        engine_dtype = torch_dtype(self.config.model.dtype)
        ref, digest, manifest, num_tensors, num_bytes, canary = await anyio.to_thread.run_sync(
            self._stage_weights, version, engine_dtype
        )
        probe = await anyio.to_thread.run_sync(self._probe)
        previous, self._published = self._published, ref
        if previous is not None:  # its readers have not said they are done: not reused
            self._staging.forget(previous.key)
            self._free(previous)
        self.weight_version = version
        self._manifests[version] = manifest
        await self.publish(
            WeightsStaged(
                weight_version=version,
                weights=ref,
                digest=digest,
                num_tensors=num_tensors,
                num_bytes=num_bytes,
                checksums_manifest=manifest,
                rollout_id=event.rollout_id,
                stage_seconds=time.perf_counter() - started,
                canary=canary,
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

    def _drop_manifest(self, weight_version: str) -> None:
        manifest = self._manifests.pop(weight_version, None)
        if manifest is not None:
            remove_manifest(self.context.run_dir, manifest)

    @handles(DataReleased, emits=())
    async def on_data_released(self, event: DataReleased) -> None:
        if event.ref.owner != self.name:
            return
        # Every engine is done with it, though its copies may still be running on the GPU.
        self._staging.give_back(event.ref.key, self.context.transport.reads_of(event.ref))
        self._free(event.ref)
        for prefix, (arena, unreleased) in list(self._arenas.items()):
            unreleased.discard(event.ref.key)
            if not unreleased:  # written: the next save copies into the same pinned memory
                del self._arenas[prefix]
                self._pinned.give_back(arena)
        if self._published is not None and self._published.key == event.ref.key:
            self._published = None

    # --- checkpoints -----------------------------------------------------------------------

    def _snapshot_train_state(self, prefix: str) -> TrainStateSnapshot:
        """The train state as it is now: the weights in the training dtype, unconverted (a
        resumed run continues from exactly these bytes), packed in one bucket per dtype where
        they live; the optimizer state, copied where it lives when it is staged in the
        background (training goes on meanwhile), as it is when staged inline; the RNG state."""
        mode = self.config.trainer.save_staging
        reused = self._reuses_snapshot_copies()
        weights = self._weights_copy(pool=self._snapshot_buckets if reused else None)
        background = mode == "background" or (mode == "auto" and weights.device.type == "cuda")
        if reused:
            self._snapshot_buckets.lend(prefix, weights)
            self._snapshot_lent[prefix] = None
        try:
            require_finite_buckets(weights, f"checkpoint {prefix}")
            optimizer = self.backend.optimizer_state_dict()
            if reused:
                if self._snapshot_arenas is None:
                    self._snapshot_arenas = DeviceArenaPool(weights.device)
                arenas = self._snapshot_arenas
                arena = arenas.take([t for t in tensors_of(optimizer) if t.device == arenas.device])
                self._snapshot_lent[prefix] = arena
                optimizer = map_tensors(optimizer, partial(_copy_into, arena, arenas.device))
            elif background:  # copied where it lives: training goes on meanwhile
                optimizer = map_tensors(optimizer, lambda tensor: tensor.detach().clone())
            else:  # to the host now: what is staged is handed over, never written again
                optimizer = map_tensors(optimizer, lambda tensor: tensor.detach().to("cpu", copy=True))
            # On a GPU, the host copy waits for this point only, not for the steps after it.
            ready = capture_point(weights.device) if background else None
            return TrainStateSnapshot(weights, optimizer, self.backend.rng_state(), background, ready)
        except BaseException:
            self._snapshot_given_back(prefix)
            raise

    def _prepare_save_memory_soon(self) -> None:
        """Once trained weights are published, with periodic saves to come that are staged
        in the background on a GPU: pin the first save's host memory beside the rollout that
        follows rather than beside the train step that save is asked for after (pinning
        stalls every CUDA call of the process: ``PinnedPool.reserve``). On the ray runtime
        the trainer's process has nothing on the GPU then; on the local one the engine's
        decoding shares the stall instead."""
        if self._save_memory_prepared or self._num_saves > 0 or self.config.run.save_interval is None:
            return
        try:
            if not self._reuses_snapshot_copies():
                return
            tensors = self._save_copies_to_host()
            if tensors is None:  # no step taken yet: the state a save copies is not known
                return
            self._save_memory_prepared = True
            signature = self._pinned.reserve(tensors)
        except Exception as error:  # the first save pins its memory then, as without this
            logger.warning("the first save's host memory could not be pinned ahead of it: %s", error)
            return
        if signature is not None:
            num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            self._preparing_save_memory = self.spawn(self._prepare_save_memory(signature, num_bytes), emits=())

    async def _prepare_save_memory(self, signature: Signature, num_bytes: int) -> None:
        began = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(self._pinned.prepare, signature)
        except Exception as error:  # the first save pins it then, and fails there if it must
            logger.warning("the first save's host memory could not be pinned ahead of it: %s", error)
            return
        logger.info(
            "the first save's host memory pinned ahead of it: %.2f GB in %.2f s",
            num_bytes / 1e9, time.perf_counter() - began,
        )

    def _save_copies_to_host(self) -> list[torch.Tensor] | None:
        """The tensors a background save copies to the host (``copy_to_host``), as their
        shapes and dtypes go: the weights' buckets, then the optimizer's tensors on the GPU;
        None while the optimizer holds none."""
        optimizer = [tensor for tensor in tensors_of(self.backend.optimizer_state_dict()) if tensor.is_cuda]
        if not optimizer:
            return None
        return [tensor for tensor in tensors_of(self.backend.weight_buckets()) if tensor.is_cuda] + optimizer

    def _reuses_snapshot_copies(self) -> bool:
        """Whether a save's copies go into those of an earlier save: on a GPU, in the
        background, where ``copy_to_host`` copies them to the host before they are reused."""
        own = self.backend.weight_buckets()
        mode = self.config.trainer.save_staging
        return mode in ("background", "auto") and own is not None and own.device.type == "cuda"

    def _snapshot_given_back(self, prefix: str) -> None:
        """A background save's copies on the GPU are on the host, or never will be: the
        next save copies into them (once: later calls do nothing)."""
        if prefix not in self._snapshot_lent:
            return
        arena = self._snapshot_lent.pop(prefix)
        self._snapshot_buckets.give_back(prefix)
        if arena is not None and self._snapshot_arenas is not None:
            self._snapshot_arenas.give_back(arena)

    def _stage_train_state(self, prefix: str, snapshot: TrainStateSnapshot) -> tuple[DataRef, DataRef, DataRef]:
        transport = self.context.transport
        host_weights, host_optimizer = snapshot.weights, snapshot.optimizer
        arena = None
        if snapshot.background:
            # Off the trainer's stream, into pinned memory: the next step runs meanwhile.
            try:
                (host_weights, host_optimizer), arena = copy_to_host(
                    (snapshot.weights, snapshot.optimizer), snapshot.ready, self._pinned
                )
            finally:  # copied to the host (or failed): the next save copies into them
                self._snapshot_given_back(prefix)
        staged: list[DataRef] = []
        try:
            staged.append(transport.put_buckets(f"{prefix}-weights", host_weights, owner=self.name))
            staged.append(transport.put_state(f"{prefix}-optimizer", host_optimizer, owner=self.name))
            staged.append(transport.put_state(f"{prefix}-rng", snapshot.rng, owner=self.name))
        except BaseException:
            for ref in staged:  # nobody will hear of them
                self._free(ref)
            if arena is not None:
                self._pinned.give_back(arena)
            raise
        weights, optimizer, rng = staged
        if arena is not None:  # read until the Saver releases what it was staged as
            self._arenas[prefix] = (arena, {weights.key, optimizer.key, rng.key})
        return weights, optimizer, rng

    @handles(SaveRequested, emits=(TrainStateStaged,))
    async def on_save_requested(self, event: SaveRequested) -> None:
        self._num_saves += 1
        # The counter keeps keys unique when one rollout is saved twice (say, sentinel then last).
        prefix = f"train-state-r{event.rollout_id}-{self._num_saves}"
        snapshot = await anyio.to_thread.run_sync(self._snapshot_train_state, prefix)
        trainer_state = self._trainer_state(event.rollout_id)
        if snapshot.background:
            # The host copy, serialisation and staging go on beside the next events; the
            # Saver hears of the state when it is staged. They start once the publication
            # asked for with this save is staged, which then shares the process with none
            # of it (a staging beside it, as beside the first save's pinning, is far slower).
            staged = None
            taken_up = self._last_publication is not None and self._last_publication >= event.rollout_id
            if event.publication_follows and not taken_up:
                staged = self._publication_staged.setdefault(event.rollout_id, anyio.Event())
            self.spawn(
                self._stage_and_announce(event, prefix, snapshot, trainer_state, after=staged), emits=(TrainStateStaged,)
            )
        else:
            await self._stage_and_announce(event, prefix, snapshot, trainer_state)

    async def _stage_and_announce(
        self,
        event: SaveRequested,
        prefix: str,
        snapshot: TrainStateSnapshot,
        trainer_state: TrainerState,
        after: anyio.Event | None = None,
    ) -> None:
        try:
            if after is not None:
                with anyio.move_on_after(PUBLICATION_WAIT_SECONDS) as waited:
                    await after.wait()
                if waited.cancelled_caught:
                    logger.warning(
                        "the publication asked for with the save of rollout %d was not staged within %gs: "
                        "staging the save",
                        event.rollout_id,
                        PUBLICATION_WAIT_SECONDS,
                    )
            weights, optimizer, rng = await anyio.to_thread.run_sync(self._stage_train_state, prefix, snapshot)
        finally:
            if after is not None and self._publication_staged.get(event.rollout_id) is after:
                del self._publication_staged[event.rollout_id]
            self._snapshot_given_back(prefix)  # staged, failed or cancelled: not read again
        await self.publish(
            TrainStateStaged(
                rollout_id=event.rollout_id,
                weights=weights,
                optimizer=optimizer,
                rng=rng,
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
class TrainStateSnapshot:
    """A save's train state, copied away from what training changes where it is staged in
    the ``background``."""

    weights: Buckets
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    background: bool
    ready: Any = None
    """On a GPU, a CUDA event where the copies were taken: what the host copy waits for."""


def _copy_into(arena: PinnedArena, device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into the arena's next tensor where it is on ``device`` (the arena
    was taken for those tensors, in this order), cloned where not."""
    if tensor.device != device:
        return tensor.detach().clone()
    return arena.carve(tensor).copy_(tensor.detach())
