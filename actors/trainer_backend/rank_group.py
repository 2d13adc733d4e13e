"""The trainer as a group of N ranks: ``TrainerRank`` in each rank's process, and
``RankGroupBackend``, the ``TrainerBackend`` the Trainer actor drives them through.

The Trainer actor starts the ranks as its worker group (``miles_events.bus.workers``, each
rank in a process of its own but rank 0, which shares the actor's): each builds a
``TorchTrainerBackend`` over a ``ProcessGroup`` (``actors.trainer_backend.parallel``; the
Megatron backend over a ``MegatronGroup``, ``megatron_backend``),
meeting the others at a TCP store whose port the actor holds (chosen free when it is
opened: no race for it). Every backend call then goes to every rank at once, with the same
arguments (a rollout goes whole to each rank, which trains its part of it) but for state
loaded from a checkpoint, which rank 0 alone is handed and broadcasts. What comes back
comes from rank 0: the weights gathered for a publication or a save, the optimizer state,
the metrics. A call that fails on any rank fails at once, naming the rank, its process and
the ranks that had not returned, without waiting for them (they may be waiting for it in a
collective, until their timeout).
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.from_thread

from actors.trainer_backend.base import TrainerBackend
from miles_events.bus.actor import OwnProcesses, RankFailed, Role, WorkerGroup, call_each, close_workers
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.device.threads import phase_thread_count, phase_threads
from miles_events.rl.finite import NonFiniteError
from schemas.config import critic_config, resolved_sharding
from schemas.events import CriticMetrics, MemoryPart, RankStep, TrainMetrics
from schemas.rollout import RolloutBatch

if TYPE_CHECKING:
    import torch

    from miles_events.bus.actor import ActorContext, RankPlace, Worker
    from miles_events.transport.base import Transport
    from schemas.config import Config

R = TypeVar("R")

FAILED_CLOSE_SECONDS = 5.0
"""How long each rank of a group that failed may take to close before its process is ended:
a rank stuck in a collective, or stopped, never closes."""

TRAINING_OUTCOMES = (Cancelled, NonFiniteError)
"""A rank's errors that are the step's outcome, the same on every rank (a cancellation
point passed together, a non-finite loss or norm reduced over all ranks): raised as the
single-process trainer raises them, not as a rank's failure."""

CANCEL_POLL_SECONDS = 0.05
"""How often a rollout's training looks for a cancellation to pass on to the ranks."""


RENDEZVOUS_SECONDS = 120.0
"""The least time the ranks are given to meet: each is a process that starts, imports torch
and builds its model first, which a busy host slows far beyond a collective's time."""


def rendezvous_seconds(collective_timeout: float) -> float:
    """How long the ranks' rendezvous may take: the collective timeout, or
    ``RENDEZVOUS_SECONDS`` where that is longer."""
    return max(collective_timeout, RENDEZVOUS_SECONDS)


def trainer_worker_group(role: Role, config: Config) -> WorkerGroup:
    """The worker group of a trainer role (``actor``: the policy's; ``critic``: PPO's
    critic, given the critic's config): its ranks and what each reserves."""
    trainer = config.trainer
    return WorkerGroup(
        role=role,
        num_ranks=trainer.num_ranks,
        cpus_per_rank=trainer.cpus_per_rank,
        gpus_per_rank=trainer.gpus_per_rank,
    )


def uses_rank_group(config: Config) -> bool:
    """Whether the trainer runs as a group of ranks (a process group), even of one."""
    return resolved_sharding(config.trainer) != "none"


class TrainerRank:
    """One rank of the trainer's group, in the process hosting it."""

    def __init__(
        self, config: Config, place: RankPlace, store_address: tuple[str, int], role: str = "actor"
    ) -> None:
        import torch

        from actors.trainer_backend.parallel import ProcessGroup
        from actors.trainer_backend.torch_backend import TorchTrainerBackend

        if role == "critic":  # the run's config reaches every rank: the critic's own view of it
            config = critic_config(config)
        self.rank = place.rank
        self.config = config
        self.sharers = place.ranks_sharing_cores
        torch.set_num_threads(phase_thread_count(config.trainer.num_threads, self.sharers))
        if torch.cuda.is_available():
            # Each rank sees its own GPU on the ray runtime; spawned here, rank r takes GPU r.
            torch.cuda.set_device(place.rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        sharding = resolved_sharding(config.trainer)
        assert sharding != "none"
        meeting = rendezvous_seconds(config.trainer.collective_timeout)
        self.backend: TorchTrainerBackend
        self.parallel: ProcessGroup
        backend: type[TorchTrainerBackend]
        if config.trainer.backend == "megatron":  # a critic's config is always torch's
            from actors.trainer_backend.megatron_backend import MegatronGroup, MegatronTrainerBackend

            self.parallel = MegatronGroup(config, place.rank, store_address, device, meeting)
            backend = MegatronTrainerBackend
        else:
            self.parallel = ProcessGroup(
                sharding,
                place.rank,
                config.trainer.num_ranks,
                store_address,
                config.trainer.collective_timeout,
                device,
                meeting,
            )
            if role == "critic":
                from actors.trainer_backend.critic_backend import TorchCriticBackend

                backend = TorchCriticBackend
            else:
                backend = TorchTrainerBackend
        try:
            self.backend = backend(config, self.parallel)
        except BaseException:
            self.parallel.close()  # the process (rank 0's is the Trainer's) leaves the group
            raise
        self._lock = threading.Lock()
        self._cancellations: dict[int, Cancellation] = {}
        """Each training call's cancellation, by its number: one asked for before its call
        arrives (a notification may overtake the call) is there when it does."""

    def _cancellation(self, call: int) -> Cancellation:
        with self._lock:
            return self._cancellations.setdefault(call, Cancellation())

    def _training(self, call: int, train: Callable[[Cancellation], R]) -> R:
        """``train(cancellation)`` with the phase's threads; ``call`` numbers the group's
        training calls (each one's cancellation, asked for before or during it)."""
        cancellation = self._cancellation(call)
        try:
            with phase_threads(self.config.trainer.num_threads, self.sharers):
                return train(cancellation)
        finally:
            with self._lock:
                self._cancellations.pop(call, None)

    def train(self, batch: RolloutBatch, call: int) -> tuple[TrainMetrics, list[RankStep], int]:
        """Train on this rank's part of ``batch``; ``call`` numbers the group's training calls."""
        metrics = self._training(call, lambda cancellation: self.backend.train(batch, cancellation))
        return metrics, self.backend.rank_steps(), self.backend.num_optimizer_steps

    def train_critic(
        self, batch: RolloutBatch, call: int
    ) -> tuple[CriticMetrics, list[RankStep], int, dict[int, list[float]]]:
        """The critic's ``train``: its metrics, and the values this rank computed."""
        from actors.trainer_backend.critic_backend import TorchCriticBackend

        backend = self.backend
        assert isinstance(backend, TorchCriticBackend)
        metrics = self._training(call, lambda cancellation: backend.train_critic(batch, cancellation))
        return metrics, backend.rank_steps(), backend.num_optimizer_steps, backend.values

    def cancel(self, reason: str, call: int) -> None:
        """Cut training call ``call`` at its next cancellation point (a call over is left be)."""
        self._cancellation(call).cancel(reason)

    def named_weights(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return self.backend.named_weights(dtype)

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.backend.optimizer_state_dict()

    def rng_state(self) -> dict[str, Any]:
        return self.backend.rng_state()

    def load_state(
        self,
        weights: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        num_optimizer_steps: int,
    ) -> None:
        self.backend.load_state(weights, optimizer, rng, num_optimizer_steps)

    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        self.backend.load_reference(weights)

    def probe_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        return self.backend.probe_logprobs(prompt_ids, response_ids)

    def offload(self) -> list[MemoryPart]:
        return self.backend.offload()

    def onload(self) -> list[MemoryPart]:
        return self.backend.onload()

    def clear_memory(self) -> None:
        self.backend.clear_memory()

    def health(self) -> str:
        """The heartbeat: answered at all (by the rank's process, beside a call in
        progress), the rank is alive and not stopped: ""."""
        return ""

    def close(self) -> None:
        self.parallel.close()


def trainer_rank(
    config: Config,
    transport: Transport,
    place: RankPlace,
    *,
    store_address: tuple[str, int],
    role: str = "actor",
) -> TrainerRank:
    """The worker factory of the trainer's (or the critic's) ranks (``functools.partial``
    gives the store and the role)."""
    return TrainerRank(config, place, store_address, role)


class RankGroupBackend(TrainerBackend):
    """The trainer's ranks, driven as one backend from the Trainer actor (its methods are
    called from worker threads of the actor's event loop, as every backend's are)."""

    def __init__(self, config: Config, workers: list[Worker[TrainerRank]], store: Any) -> None:
        self.config = config
        self.workers = workers
        self._store = store  # the rendezvous: held while the group lives
        self._num_optimizer_steps = 0
        self._rank_steps: list[RankStep] = []
        self._failed = False
        """Whether a call failed on some rank (the others may be stuck in a collective)."""
        self._calls = 0
        """Training calls so far: each rank's cancellation names the call it cuts."""
        self.values: dict[int, list[float]] = {}
        """The critic's: the last rollout's values, from every rank."""

    @classmethod
    async def start(
        cls, config: Config, context: ActorContext, role: str = "actor", own_processes: OwnProcesses = True
    ) -> RankGroupBackend:
        """Open the rendezvous, start the ranks (their process group formed), or fail naming
        the rank that did not start. ``role``: ``critic`` builds the critic's value model
        (``config`` is then the critic's, ``schemas.config.critic_config``);
        ``own_processes="all"``: rank 0 too in a process of its own (a group that heals)."""
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in its __all__

        ranks = config.trainer.num_ranks
        timeout = datetime.timedelta(seconds=rendezvous_seconds(config.trainer.collective_timeout))
        store = TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=timeout, wait_for_workers=False)
        factory = partial(trainer_rank, store_address=("127.0.0.1", store.port), role=role)
        workers = await context.start_workers(factory, ranks, own_processes=own_processes)
        return cls(config, workers, store)

    def _on_loop(self, function: Callable[[], Coroutine[Any, Any, R]]) -> R:
        try:
            return anyio.from_thread.run(function)
        except RankFailed as failed:
            self._failed = True
            if isinstance(failed.error, TRAINING_OUTCOMES):
                # What every rank decided alike (they agree on both): the trainer's own error.
                raise failed.error from None
            raise
        except BaseException:
            self._failed = True
            raise

    def _call(self, call: Callable[[Worker[TrainerRank]], Awaitable[R]]) -> list[R]:
        """``call(worker)`` for every rank, each returning within the collective timeout of
        the first (a rank stopped outside a collective fails the call, naming it)."""

        async def run() -> list[R]:
            return await call_each(
                self.workers, call, straggler_timeout=self.config.trainer.collective_timeout
            )

        return self._on_loop(run)

    def _each(self, method: Callable[..., R], *args: Any) -> list[R]:
        """``method(*args)`` on every rank; the results in rank order."""

        return self._call(lambda w: w.call(method, *args))

    def _rank0_alone(self, method: Callable[..., R], full: tuple[Any, ...], empty: tuple[Any, ...]) -> R:
        """``method`` on every rank, ``full`` given to rank 0 and ``empty`` to the others."""

        return self._call(lambda w: w.call(method, *(full if w.rank == 0 else empty)))[0]

    # --- training ----------------------------------------------------------------------------

    def _training_call(
        self, method: Callable[..., R], batch: RolloutBatch, cancel: Cancellation | None
    ) -> list[R]:
        """``method(batch, call)`` on every rank, a cancellation passed on to each of them."""
        self._calls += 1
        call = self._calls

        async def run() -> list[R]:
            async def pass_on_cancellation() -> None:
                while cancel is not None and not cancel.cancelled:
                    await asyncio.sleep(CANCEL_POLL_SECONDS)
                if cancel is not None:
                    for worker in self.workers:
                        worker.notify(TrainerRank.cancel, cancel.reason, call)

            watcher = asyncio.ensure_future(pass_on_cancellation())
            try:
                return await call_each(
                    self.workers,
                    lambda w: w.call(method, batch, call),
                    straggler_timeout=self.config.trainer.collective_timeout,
                )
            finally:
                watcher.cancel()

        return self._on_loop(run)

    def train(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> TrainMetrics:
        results = self._training_call(TrainerRank.train, batch, cancel)
        metrics, _report, self._num_optimizer_steps = results[0]
        self._rank_steps = [step for _metrics, steps, _count in results for step in steps]
        return metrics

    def rank_steps(self) -> list[RankStep]:
        return self._rank_steps

    def train_critic(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> CriticMetrics:
        """The critic's ranks train on ``batch``; ``values`` gathers what each computed."""
        results = self._training_call(TrainerRank.train_critic, batch, cancel)
        metrics, _report, self._num_optimizer_steps, _values = results[0]
        self._rank_steps = [step for _metrics, steps, _count, _v in results for step in steps]
        self.values = {index: v for *_rest, values in results for index, v in values.items()}
        return metrics

    # --- state -------------------------------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self._each(TrainerRank.named_weights, dtype)[0]

    @property
    def num_optimizer_steps(self) -> int:
        return self._num_optimizer_steps

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self._each(TrainerRank.optimizer_state_dict)[0]

    def rng_state(self) -> dict[str, Any]:
        return self._each(TrainerRank.rng_state)[0]

    def load_state(
        self,
        weights: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        num_optimizer_steps: int,
    ) -> None:
        # Rank 0 reads it and broadcasts; each rank takes the same RNG state.
        self._rank0_alone(
            TrainerRank.load_state,
            (weights, optimizer, rng, num_optimizer_steps),
            ({}, {}, rng, num_optimizer_steps),
        )
        self._num_optimizer_steps = num_optimizer_steps

    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        self._rank0_alone(TrainerRank.load_reference, (weights,), ({},))

    def probe_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        return self._each(TrainerRank.probe_logprobs, prompt_ids, response_ids)[0]

    def offload(self) -> list[MemoryPart]:
        parts = [part for rank in self._each(TrainerRank.offload) for part in rank]
        self.offloaded = True
        return parts

    def onload(self) -> list[MemoryPart]:
        parts = [part for rank in self._each(TrainerRank.onload) for part in rank]
        self.offloaded = False
        return parts

    def clear_memory(self) -> None:
        self._each(TrainerRank.clear_memory)

    @property
    def pids(self) -> list[int]:
        """Each rank's process, in rank order."""
        return [worker.pid for worker in self.workers]

    async def heartbeat(self, rank: int) -> None:
        """Rank ``rank``'s heartbeat (on the actor's event loop): returns once its process
        answered; raises as its call would (``RankDied``)."""
        await self.workers[rank].call(TrainerRank.health)

    async def kill(self, rank: int) -> None:
        """End rank ``rank``'s process now (hung): the calls waiting on it fail."""
        self._failed = True
        await close_workers(self.workers[rank : rank + 1], 0.0)

    async def close(self) -> None:
        await close_workers(self.workers, FAILED_CLOSE_SECONDS if self._failed else None)
