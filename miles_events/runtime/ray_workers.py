"""Worker-group ranks on the ray runtime (``miles_events.bus.workers``): rank 0 in the
actor's own process, every other rank in a Ray actor process of its own, in the bundle of
the actor's placement group reserved for it (``placement_bundles`` gives a group of N ranks
N bundles: its actor sits on the first, rank r on the first + r), with the group's CPUs and
GPUs per rank. A rank process is a threaded Ray actor, so a ``notify`` (a cancellation)
runs while a ``call`` of the same rank is in progress.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

import msgspec

from miles_events.bus.actor import WorkerGroup
from miles_events.bus.clock import SYSTEM_CLOCK, wait_for
from miles_events.bus.workers import (
    OwnProcesses,
    RankDied,
    RankPlace,
    Worker,
    WorkerFactory,
    brief_error,
    build_in_process,
    gather_workers,
    method_name,
)
from miles_events.runtime.heap import freeze_start_up
from miles_events.runtime.ray_cluster import ARENAS_MARK
from miles_events.runtime.run_log import log_into
from miles_events.transport.base import Transport, open_transport
from schemas.config import Config

if TYPE_CHECKING:
    from ray.actor import ActorHandle

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

CLOSE_SECONDS = 60.0
"""How long a rank's close may take before its Ray actor is killed."""

RANK_CONCURRENCY = 4
"""Calls one rank process runs at once (a long call, and the notifications beside it)."""


class RankHost:
    """Lives in a rank's Ray actor process: builds the rank's object, runs calls on it."""

    def __init__(
        self,
        factory: WorkerFactory[Any],
        config_json: bytes,
        run_id: str,
        run_dir: str,
        transport: str,
        place: RankPlace,
        log_level: int = logging.WARNING,
        actor: str = "",
    ) -> None:
        log_into(
            Path(run_dir), log_level, f"{actor} rank {place.rank}".lstrip()
        )  # its actor's level, the driver's
        if os.environ.pop(ARENAS_MARK, None):
            os.environ.pop("MALLOC_ARENA_MAX", None)
        config = msgspec.json.decode(config_json, type=Config)
        # A failure to build is kept and raised by ``started``: Ray reports an actor whose
        # constructor raised as dead, without the exception itself.
        self.failure: BaseException | None = None
        self.target: Any = None
        try:
            self.target = factory(config, open_transport(transport, run_id, Path(run_dir), config), place)
        except Exception as error:
            self.failure = error
        freeze_start_up()  # the process is this rank's alone, for the rest of its life

    def started(self) -> int:
        """The rank's pid, once built; its build's exception otherwise."""
        if self.failure is not None:
            raise self.failure
        return os.getpid()

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The method called ``method`` of the rank's object (the actor's side sends the name)."""
        return getattr(self.target, method)(*args, **kwargs)


class RayWorker(Generic[T]):
    """The actor's side of a rank in its own process: a call sends the method's name. A
    call to a rank whose Ray actor died raises ``RankDied``."""

    def __init__(self, rank: int, handle: Any, pid: int, actor: str = "") -> None:
        self.rank = rank
        self.handle = handle
        self.pid = pid
        self.name = f"{actor} rank {rank}".lstrip()

    async def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = await self._call(method_name(method), args, kwargs)
        return result

    async def call_beside(
        self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        # The rank's Ray actor runs RANK_CONCURRENCY calls at once: every call is beside.
        return await self.call(method, *args, **kwargs)

    async def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return await self.handle.call.remote(name, args, kwargs)
        except RayTaskError as error:
            raise (error.cause or error) from None  # the rank's own exception, as in process
        except RayActorError as error:
            raise RankDied(f"{self.name} (pid {self.pid}) died: {actor_death(error)}", self.rank) from error

    def notify(self, method: Callable[Concatenate[T, P], object], *args: P.args, **kwargs: P.kwargs) -> None:
        self.handle.call.remote(method_name(method), args, kwargs)

    async def close(self, timeout: float | None = None) -> None:
        import ray

        try:
            await wait_for(
                self._call("close", (), {}), CLOSE_SECONDS if timeout is None else timeout, SYSTEM_CLOCK
            )
        except RankDied:
            pass  # nothing left to close
        finally:
            ray.kill(self.handle)


def actor_death(error: BaseException) -> str:
    """How a rank's Ray actor ended, in a few words, out of Ray's many lines."""
    text = str(error)
    detail = re.search(r"Worker exit detail: (.*?)(?:\.\s|\.$|$)", text, re.MULTILINE)
    if detail:
        return f"its Ray actor died ({detail.group(1).strip()})"
    return "its Ray actor died"


async def start_ray_workers(
    factory: WorkerFactory[T],
    ranks: int,
    *,
    config: Config,
    transport: Transport,
    run_id: str,
    run_dir: Path,
    group: WorkerGroup,
    first_bundle: int,
    timeout: float,
    actor: str = "",
    own_processes: OwnProcesses = False,
    only: Sequence[int] | None = None,
) -> list[Worker[T]]:
    """Rank 0 here, ranks 1.. in their own processes, all started concurrently (with or
    without ``own_processes``: on ray, every rank but 0 has a process of its own). With
    ``own_processes="all"`` rank 0 has one too, and rank r sits on the bundle after the
    actor's first + r (the group declares a bundle for the actor and one per rank).
    ``only``: just those ranks."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    placement = get_current_placement_group()
    every = own_processes == "all"
    if (ranks > 1 or every) and placement is None:
        raise RuntimeError("a worker group of several ranks needs its actor placed in a placement group")
    remote_cls = ray.remote(RankHost)
    config_json = msgspec.json.encode(config)

    async def remote(rank: int) -> RayWorker[T]:
        # Ray's typing: ``options(...).remote`` is declared to return the class or a handle
        # (it returns a handle), and ``placement_group`` not to take None (which Ray takes
        # as "none configured").
        handle: ActorHandle[RankHost] = remote_cls.options(  # type: ignore[assignment]
            num_cpus=group.cpus_per_rank,
            num_gpus=group.gpus_per_rank,
            max_concurrency=RANK_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement,  # type: ignore[arg-type]
                placement_group_bundle_index=first_bundle + rank + (1 if every else 0),
            ),
        ).remote(
            factory,
            config_json,
            run_id,
            str(run_dir),
            transport.name,
            RankPlace(rank, ranks, run_dir, run_id),
            logging.getLogger().getEffectiveLevel(),
            actor,
        )
        name = f"{actor} rank {rank}".lstrip()
        try:
            pid: int = await wait_for(handle.started.remote(), timeout, SYSTEM_CLOCK)
        except TimeoutError:
            ray.kill(handle)
            raise RuntimeError(f"{name} did not start within {timeout:g}s") from None
        except RayTaskError as error:
            ray.kill(handle)
            cause = error.cause or error
            raise RuntimeError(f"{name} failed to start: {brief_error(cause)}") from cause
        except RayActorError as error:
            ray.kill(handle)
            raise RuntimeError(f"{name} died while starting: {actor_death(error)}") from error
        return RayWorker(rank, handle, pid, actor)

    async def local() -> Worker[T]:
        (worker,) = await build_in_process(factory, config, transport, [RankPlace(0, ranks, run_dir, run_id)])
        return worker

    wanted = range(ranks) if only is None else only
    return await gather_workers([remote(rank) if rank or every else local() for rank in wanted])
