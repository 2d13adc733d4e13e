"""A save's train state, from the trainer's backend to the transport.

``SaveStaging`` takes a save's snapshot (the weights in the training dtype, the optimizer's
and the RNG's state, as they are when the save is asked for), stages it through the
transport's stager, and owns the memory that costs: on a GPU, in the ``background``, the
snapshot is copied where it lives into device buckets and arenas reused save after save
(``StagingPool``, ``DeviceArenaPool``), then to pinned host memory pinned once
(``PinnedPool``), ahead of the first periodic save (``prepare_memory_soon``), and taken
again once the Saver has released every part staged from it (``released``).

``PublicationsTakenUp`` is what a background save asked for with a publication waits on:
the trainer's record of the publications it took up (staged or failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from actors.trainer_backend.base import TrainerBackend
from miles_events.device.buckets import Buckets, plan_layouts, require_finite_buckets
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
from miles_events.transport.base import Stager
from schemas.data import BucketLayout, DataRef

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PIN_WAIT_SECONDS = 60.0
"""How long closing waits for the pinning of a save's host memory under way
(``PinnedPool.prepare``: seconds for a large state) before it closes the pool anyway."""


def weights_copy(
    backend: TrainerBackend,
    dtype: torch.dtype | None = None,
    extra: tuple[BucketLayout, ...] = (),
    pool: StagingPool | None = None,
) -> Buckets:
    """A copy of the backend's weights (``named_weights``), converted to ``dtype``, in flat
    buckets on their device, followed by empty buckets laid out as ``extra`` (the caller
    fills them): one copy per bucket where the backend trains them in buckets of that dtype
    already, else packed by one ``torch.cat`` per dtype. Into buckets of ``pool`` where given
    (staged before and given back), else new ones."""
    import torch

    own = backend.weight_buckets()
    with torch.no_grad():
        if own is not None and all(dtype in (None, buffer.dtype) for buffer in own.buffers):
            layouts, device, weights = own.layouts, own.device, None
        else:
            weights = backend.named_weights(dtype)
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


@dataclass(frozen=True)
class StagedTrainState:
    """What a save staged, as the Saver reads it."""

    weights: DataRef
    optimizer: DataRef
    rng: DataRef

    @property
    def keys(self) -> set[str]:
        return {self.weights.key, self.optimizer.key, self.rng.key}


class SaveStaging:
    """The train state's staging for saves, given the backend it copies from, the stager it
    stages into (as ``owner``) and ``trainer.save_staging``'s mode. Its methods that copy or
    stage (``snapshot``, ``stage``) run on a worker thread; the others on the actor's loop."""

    def __init__(
        self, backend: TrainerBackend, stager: Stager, owner: str, mode: str, periodic: bool
    ) -> None:
        self.backend = backend
        self.stager = stager
        self.owner = owner
        self.mode = mode
        self.periodic = periodic
        """Whether the run saves periodically (``run.save_interval``)."""
        self.pinned = PinnedPool()
        """Pinned host memory for saves staged in the background, pinned once, reused."""
        self.memory_prepared = False
        """Whether the first periodic save's pinned memory was asked for ahead of it."""
        self._preparing: asyncio.Task[None] | None = None
        self.device_buckets = StagingPool()
        """On a GPU, the buckets a background save copies the weights into, until they are
        on the host; then the next save's."""
        self.device_arenas: DeviceArenaPool | None = None
        """On a GPU, the same for the optimizer's tensors."""
        self.lent: dict[str, PinnedArena | None] = {}
        """Saves whose copies on the GPU are not on the host yet: prefix -> the arena."""
        self.held: dict[str, tuple[PinnedArena, set[str]]] = {}
        """A staged save's pinned arena and the keys of its data the Saver has yet to
        release, by save."""

    # --- a save ------------------------------------------------------------------------------

    def snapshot(self, prefix: str) -> TrainStateSnapshot:
        """The train state as it is now: the weights in the training dtype, unconverted (a
        resumed run continues from exactly these bytes), packed in one bucket per dtype where
        they live; the optimizer state, copied where it lives when it is staged in the
        background (training goes on meanwhile), as it is when staged inline; the RNG state."""
        reused = self.reuses_copies()
        weights = weights_copy(self.backend, pool=self.device_buckets if reused else None)
        background = self.mode == "background" or (self.mode == "auto" and weights.device.type == "cuda")
        if reused:
            self.device_buckets.lend(prefix, weights)
            self.lent[prefix] = None
        try:
            require_finite_buckets(weights, f"checkpoint {prefix}")
            optimizer = self.backend.optimizer_state_dict()
            if reused:
                if self.device_arenas is None:
                    self.device_arenas = DeviceArenaPool(weights.device)
                arenas = self.device_arenas
                arena = arenas.take([t for t in tensors_of(optimizer) if t.device == arenas.device])
                self.lent[prefix] = arena
                optimizer = map_tensors(optimizer, partial(_copy_into, arena, arenas.device))
            elif background:  # copied where it lives: training goes on meanwhile
                optimizer = map_tensors(optimizer, lambda tensor: tensor.detach().clone())
            else:  # to the host now: what is staged is handed over, never written again
                optimizer = map_tensors(optimizer, lambda tensor: tensor.detach().to("cpu", copy=True))
            # On a GPU, the host copy waits for this point only, not for the steps after it.
            ready = capture_point(weights.device) if background else None
            return TrainStateSnapshot(weights, optimizer, self.backend.rng_state(), background, ready)
        except BaseException:
            self.copies_back(prefix)
            raise

    def stage(self, prefix: str, snapshot: TrainStateSnapshot) -> StagedTrainState:
        """``snapshot`` staged under keys of ``prefix``: in the background, copied to pinned
        host memory first (off the trainer's stream: the next step runs meanwhile), which
        stays taken until the Saver releases every part (``released``)."""
        host_weights, host_optimizer = snapshot.weights, snapshot.optimizer
        arena = None
        if snapshot.background:
            try:
                (host_weights, host_optimizer), arena = copy_to_host(
                    (snapshot.weights, snapshot.optimizer), snapshot.ready, self.pinned
                )
            finally:  # copied to the host (or failed): the next save copies into them
                self.copies_back(prefix)
        staged: list[DataRef] = []
        try:
            staged.append(self.stager.put_buckets(f"{prefix}-weights", host_weights, owner=self.owner))
            staged.append(self.stager.put_state(f"{prefix}-optimizer", host_optimizer, owner=self.owner))
            staged.append(self.stager.put_state(f"{prefix}-rng", snapshot.rng, owner=self.owner))
        except BaseException:
            for ref in staged:  # nobody will hear of them
                self.stager.free(ref)
            if arena is not None:
                self.pinned.give_back(arena)
            raise
        result = StagedTrainState(*staged)
        if arena is not None:  # read until the Saver releases what it was staged as
            self.held[prefix] = (arena, result.keys)
        return result

    def copies_back(self, prefix: str) -> None:
        """A background save's copies on the GPU are on the host, or never will be: the
        next save copies into them (once: later calls do nothing)."""
        if prefix not in self.lent:
            return
        arena = self.lent.pop(prefix)
        self.device_buckets.give_back(prefix)
        if arena is not None and self.device_arenas is not None:
            self.device_arenas.give_back(arena)

    def released(self, key: str) -> None:
        """The Saver is done with ``key``: a save's pinned memory is taken again once every
        part staged from it is released (written: the next save copies into it)."""
        for prefix, (arena, unreleased) in list(self.held.items()):
            unreleased.discard(key)
            if not unreleased:
                del self.held[prefix]
                self.pinned.give_back(arena)

    # --- the memory ----------------------------------------------------------------------------

    def reuses_copies(self) -> bool:
        """Whether a save's copies go into those of an earlier save: on a GPU, in the
        background, where ``copy_to_host`` copies them to the host before they are reused."""
        own = self.backend.weight_buckets()
        return self.mode in ("background", "auto") and own is not None and own.device.type == "cuda"

    def copies_to_host(self) -> list[torch.Tensor] | None:
        """The tensors a background save copies to the host (``copy_to_host``), as their
        shapes and dtypes go: the weights' buckets, then the optimizer's tensors on the GPU;
        None while the optimizer holds none."""
        optimizer = [tensor for tensor in tensors_of(self.backend.optimizer_state_dict()) if tensor.is_cuda]
        if not optimizer:
            return None
        return [tensor for tensor in tensors_of(self.backend.weight_buckets()) if tensor.is_cuda] + optimizer

    def prepare_memory_soon(
        self, saves_so_far: int, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]
    ) -> None:
        """Once trained weights are published, with periodic saves to come that are staged
        in the background on a GPU: pin the first save's host memory beside the rollout that
        follows rather than beside the train step that save is asked for after (pinning
        stalls every CUDA call of the process: ``PinnedPool.reserve``), on a task ``spawn``
        starts. On the ray runtime the trainer's process has nothing on the GPU then; on the
        local one the engine's decoding shares the stall instead."""
        if self.memory_prepared or saves_so_far > 0 or not self.periodic:
            return
        try:
            if not self.reuses_copies():
                return
            tensors = self.copies_to_host()
            if tensors is None:  # no step taken yet: the state a save copies is not known
                return
            self.memory_prepared = True
            signature = self.pinned.reserve(tensors)
        except Exception as error:  # the first save pins its memory then, as without this
            logger.warning("the first save's host memory could not be pinned ahead of it: %s", error)
            return
        if signature is not None:
            num_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
            self._preparing = spawn(self._prepare_memory(signature, num_bytes))

    async def _prepare_memory(self, signature: Signature, num_bytes: int) -> None:
        began = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(self.pinned.prepare, signature)
        except Exception as error:  # the first save pins it then, and fails there if it must
            logger.warning("the first save's host memory could not be pinned ahead of it: %s", error)
            return
        logger.info(
            "the first save's host memory pinned ahead of it: %.2f GB in %.2f s",
            num_bytes / 1e9,
            time.perf_counter() - began,
        )

    async def close(self) -> None:
        """Drop the memory: a pinning under way ends first (``PIN_WAIT_SECONDS`` at most).
        What is staged stays: the Saver may still be reading it."""
        if self._preparing is not None:
            await asyncio.wait({self._preparing}, timeout=PIN_WAIT_SECONDS)
        self.pinned.close()
        self.device_buckets.clear()
        self.device_arenas = None


class PublicationsTakenUp:
    """The publications the trainer has taken up (staged, or failed to stage), by the
    rollout they were asked for after: a background save asked for with a publication
    (``SaveRequested.publication_follows``) stages once it is taken up, so that the
    publication shares the process with none of the save."""

    def __init__(self) -> None:
        self.last: int | None = None
        """The rollout of the last publication taken up."""
        self.waiting = 0
        """Saves waiting for a publication now."""
        self._changed: anyio.Event | None = None

    def taken_up(self, rollout_id: int) -> bool:
        return self.last is not None and self.last >= rollout_id

    def take_up(self, rollout_id: int) -> None:
        """The publication asked for after ``rollout_id`` is staged or failed."""
        self.last = rollout_id
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def wait(self, rollout_id: int, timeout: float) -> bool:
        """Until the publication of ``rollout_id`` is taken up (True), or ``timeout``
        seconds have passed (False)."""
        self.waiting += 1
        try:
            with anyio.move_on_after(timeout):
                while not self.taken_up(rollout_id):
                    if self._changed is None:
                        self._changed = anyio.Event()
                    await self._changed.wait()
                return True
            return False
        finally:
            self.waiting -= 1


def _copy_into(arena: PinnedArena, device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into the arena's next tensor where it is on ``device`` (the arena
    was taken for those tensors, in this order), cloned where not."""
    if tensor.device != device:
        return tensor.detach().clone()
    return arena.carve(tensor).copy_(tensor.detach())
