"""Offload and onload (``run.offload_train``, ``run.offload_rollout``): the seed's sequence.

The seed's ``train()`` moves device memory between the engines and the trainer at fixed
points; here each point is a list of commands the Coordinator publishes one at a time, each
waiting for the fact that answers it (``MemoryOffloaded`` / ``MemoryOnloaded`` with its
``request_id``) before the next, and then the loop goes on:

====================================  ==============================================  =====================
seed                                  here (``MemoryPlan``)                           then
====================================  ==============================================  =====================
engines and trainer created offloaded ``at_start``: offload rollout (every tag),       the opening
                                      offload actor (and critic)
``onload_weights`` before the first   ``before_publication``: onload rollout weights   the publication
publication, and before each step's   (after the step's ``offload_train()``:
                                      offload actor, without a critic)
``onload_kv`` after the opening's     ``after_publication``: onload rollout            eval / next rollout
publication(s), and after each step's ``kv_cache`` + ``cuda_graph``
``offload(tags)`` after generation    ``after_generation``: offload rollout            training (the first
                                      ``cuda_graph`` + the level's tags                group to train waits
                                                                                      for it: ``RolloutGate``)
====================================  ==============================================  =====================

Trainer groups onload themselves at the start of their step (the seed's ``train`` wakes the
model up) and, with a critic, offload themselves right after it (critic, then actor, as
the seed's ``train()`` does); each says so with a fact of its own (empty ``request_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from schemas.config import Config
from schemas.events import MemoryOffloaded, MemoryTag, OffloadRequested, OnloadRequested

ALL_TAGS: tuple[MemoryTag, ...] = ("cuda_graph", "kv_cache", "weights")
WEIGHTS: list[MemoryTag] = ["weights"]
KV_CACHE: list[MemoryTag] = ["kv_cache", "cuda_graph"]
"""What the seed's ``onload_kv`` resumes (SGLang's ``GPU_MEMORY_TYPE_KV_CACHE`` and
``GPU_MEMORY_TYPE_CUDA_GRAPH``)."""

MemoryCommand = OffloadRequested | OnloadRequested


def offload_tags(levels: list[str]) -> list[MemoryTag]:
    """The tags the seed releases after generation: CUDA graphs always, then the KV cache
    and the weights where ``run.offload_rollout_level`` names them."""
    tags: list[MemoryTag] = ["cuda_graph"]
    if "kv_cache" in levels:
        tags.append("kv_cache")
    if "weight" in levels:
        tags.append("weights")
    return tags


@dataclass(frozen=True)
class MemoryPlan:
    """The commands of each point of the loop, from the run's config (none without offload)."""

    offload_train: bool
    offload_rollout: bool
    levels: tuple[str, ...]
    use_critic: bool

    @classmethod
    def of(cls, config: Config) -> MemoryPlan:
        run = config.run
        return cls(
            run.offload_train,
            run.offload_rollout,
            tuple(run.offload_rollout_level),
            config.trainer.use_critic,
        )

    def at_start(self) -> list[MemoryCommand]:
        engines = [OffloadRequested(target="rollout", tags=list(ALL_TAGS))] if self.offload_rollout else []
        return [*engines, *self._trainer_groups(OffloadRequested)]

    def _trainer_groups(self, command: type[OffloadRequested] | type[OnloadRequested]) -> list[MemoryCommand]:
        if not self.offload_train:
            return []
        return [command(target="actor"), *([command(target="critic")] if self.use_critic else [])]

    def before_initialize(self) -> list[MemoryCommand]:
        """An external policy synchronizer initializes with the trainer onloaded."""
        return self._trainer_groups(OnloadRequested)

    def after_initialize(self) -> list[MemoryCommand]:
        """Offloading both, the seed gives the trainer's memory back before the engines
        take their weights back for the first publication."""
        return self._trainer_groups(OffloadRequested) if self.offload_rollout else []

    def after_initial_sync(self) -> list[MemoryCommand]:
        """Offloading the trainer alone, the seed offloads it once the synchronizer has
        heard of the first publication."""
        return [] if self.offload_rollout else self._trainer_groups(OffloadRequested)

    def after_generation(self, rollout_id: int) -> list[MemoryCommand]:
        if not self.offload_rollout:
            return []
        return [
            OffloadRequested(target="rollout", tags=offload_tags(list(self.levels)), rollout_id=rollout_id)
        ]

    def before_publication(self, rollout_id: int | None) -> list[MemoryCommand]:
        commands: list[MemoryCommand] = []
        if rollout_id is not None and self.offload_train and not self.use_critic:
            # The seed's ``offload_train()``; with a critic each group offloaded itself.
            commands.append(OffloadRequested(target="actor", rollout_id=rollout_id))
        if self.offload_rollout:
            commands.append(OnloadRequested(target="rollout", tags=list(WEIGHTS), rollout_id=rollout_id))
        return commands

    def after_publication(self, rollout_id: int | None) -> list[MemoryCommand]:
        if not self.offload_rollout:
            return []
        return [OnloadRequested(target="rollout", tags=list(KV_CACHE), rollout_id=rollout_id)]


def gates_training(config: Config, role: str) -> bool:
    """Whether ``role``'s group waits for the engines' memory to be released before it
    trains a rollout: the first group to train it (the critic with one, else the actor),
    when ``run.offload_rollout`` releases it."""
    first = "critic" if config.trainer.use_critic else "actor"
    return config.run.offload_rollout and role == first


T = TypeVar("T")


@dataclass
class RolloutGate(Generic[T]):
    """Rollouts held until the engines released their memory after generating them
    (``MemoryOffloaded`` of ``rollout`` for that rollout id); open when not ``closed``."""

    closed: bool
    _held: dict[int, T] = field(default_factory=dict)
    _released: set[int] = field(default_factory=set)

    def arrived(self, rollout_id: int, item: T) -> T | None:
        """``item`` for rollout ``rollout_id`` arrived: returned when it may go on now."""
        if not self.closed or rollout_id in self._released:
            self._released.discard(rollout_id)
            return item
        self._held[rollout_id] = item
        return None

    def released(self, event: MemoryOffloaded) -> T | None:
        """The engines' memory is released: the rollout held for it, if it arrived."""
        if event.target != "rollout" or event.rollout_id is None or not self.closed:
            return None
        if event.rollout_id in self._held:
            return self._held.pop(event.rollout_id)
        self._released.add(event.rollout_id)
        return None
