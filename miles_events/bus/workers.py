"""Rank workers: what an actor's worker group runs beside the actor, one object per rank.

An actor whose ``resources`` ask for N ranks starts them with
``await context.start_workers(factory, N)``. ``factory(config, transport, place)`` is a
top-level function (the ray runtime sends it to other processes by reference) that builds
rank ``place.rank``'s object in the process that hosts that rank. The actor then calls the
object's methods with ``await worker.call(Rank.method, *args)``, which runs the method off
the actor's event loop, and ``worker.notify(Rank.method, *args)`` for a call that must not
wait (a cancellation, while another call of the same worker runs). The method is passed as
the class's function, not its name, so a type checker checks the arguments and the result
against its signature; the rank runs the method of that name on its object (an override,
or an attribute set on the object, runs), which is what crosses to a rank in another
process.

Where ranks run is the runtime's business: the local runtime, and every actor hosted in the
driver, run all of them in the actor's process, each call on a thread; the ray runtime hosts
rank 0 in the actor's own process and every other rank in a Ray actor process of its own,
placed in the bundle of the actor's placement group reserved for that rank (its own CPUs and
GPUs). An actor whose ranks must be processes (a torch.distributed group: one process per
rank) asks ``start_workers(factory, N, own_processes=True)``: rank 0 stays in its process
and, where ranks would be threads, ranks 1.. are spawned processes of their own
(``miles_events.bus.rank_process``). Ranks start concurrently; a rank that fails to start
fails ``start_workers``, and the ranks that did start are closed.

A rank whose process ends (killed, crashed) fails its pending and later calls at once with
``RankDied``, naming the rank, its pid and how it ended. ``call_all`` and ``call_each`` call
every rank at once and raise the first failure as soon as it comes, without waiting for the
other ranks (which may be stuck in a collective, waiting for the one that failed); the
actor then closes the group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Protocol, TypeVar

from miles_events.transport.base import Transport
from schemas.config import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank is built: its index, how many ranks of the group share the cores it
    may run on (their threads split them), the run directory and the run's id."""

    rank: int
    ranks_sharing_cores: int
    run_dir: Path
    run_id: str = ""


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")
R = TypeVar("R")

WorkerFactory = Callable[[Config, Transport, RankPlace], T]
"""Builds one rank's object; must be importable by name (a module-level function)."""


def method_name(method: Callable[..., object]) -> str:
    """The name a rank's method is called by: ``method`` is a function of the rank's class
    (``EngineWorker.load``), not one bound to an object, which would not be the rank's."""
    name = getattr(method, "__name__", None)
    if getattr(method, "__self__", None) is not None or not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"a rank's method is called as its class's function (Rank.method), not {method!r}")
    return name


class RankDied(RuntimeError):
    """A rank's process ended: ``trainer rank 1 (pid 12345) died: killed by SIGKILL``."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        """The rank that died (None where unknown)."""


DEATH_GRACE_SECONDS = 2.0
"""How long ``call_each`` waits, once a rank's call failed, for another rank's death to be
seen: that death, not the failure it caused in a collective, is what it reports."""


class RankFailed(RuntimeError):
    """A rank's call raised, in ``call_all``/``call_each``: ``rank 1 (pid 123): ValueError:
    ...``, and the ranks whose calls had not returned then (a collective that timed out
    waiting for one names it so); the rank's own exception is the ``__cause__``."""

    def __init__(
        self, rank: int, pid: int, error: BaseException, unreturned: Sequence[tuple[int, int]] = ()
    ) -> None:
        waiting = ", ".join(f"rank {r} (pid {p})" for r, p in unreturned)
        suffix = f"; still in the call: {waiting}" if waiting else ""
        super().__init__(f"rank {rank} (pid {pid}): {brief_error(error)}{suffix}")
        self.rank = rank
        self.error = error


_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+\.(?:c|cc|cpp|cu|h|hpp):\d+\]\s*")
"""The C++ source location some libraries open their messages with (gloo's, NCCL's)."""


def brief_error(error: BaseException) -> str:
    """``Type: message`` (its first line), without where it was raised (in a rank's process,
    perhaps, or in a library's C++ source)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {_SOURCE_LOCATION.sub('', text[0])}" if text else type(error).__name__


class Worker(Protocol[T_co]):
    """One rank of a worker group, seen from its actor; ``T_co`` is the class of the rank's object."""

    rank: int
    pid: int
    """The process hosting the rank."""

    async def call(self, method: Callable[Concatenate[T_co, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method(*args, **kwargs)`` of the rank's object, off the event loop; its exception
        is raised here."""
        ...

    async def call_beside(
        self, method: Callable[Concatenate[T_co, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """As ``call``, on a thread of its own even while another call of the rank runs (a
        weight load that lands between the decode steps of a generation in progress)."""
        ...

    def notify(
        self, method: Callable[Concatenate[T_co, P], object], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        """``method(*args, **kwargs)`` of the rank's object, without waiting for it (cheap
        methods only)."""
        ...

    async def close(self, timeout: float | None = None) -> None:
        """The object's ``close()`` if it has one, waited for ``timeout`` seconds at most
        (None: the worker's own bound); then the rank's process, if its own, goes."""
        ...


OwnProcesses = bool | Literal["all"]
"""Where an actor's ranks run: False, where the runtime puts them; True, every rank but 0
in a process of its own; ``"all"``, every rank, 0 included (a rank that may be killed and
started again alone, as a healed engine)."""


class StartWorkers(Protocol):
    """How a runtime starts an actor's ranks: ``ranks`` objects built by ``factory``, laid
    out as ``own_processes`` says; ``only``: just these ranks of the group (one started
    again after it died), in that order."""

    def __call__(
        self,
        factory: WorkerFactory[T],
        ranks: int,
        *,
        own_processes: OwnProcesses = False,
        only: Sequence[int] | None = None,
    ) -> Awaitable[list[Worker[T]]]: ...


class InProcessWorker(Generic[T]):
    """A rank in the actor's own process: its object is built, and every ``call`` runs, on
    one thread of its own, as in a process of its own. (On a pool's threads, calls of one
    rank land on different threads, each with a glibc arena of its own that keeps what it
    once held, and a local run's engine held more memory so.) ``notify`` runs on the caller's
    thread, beside a call; so does ``close``, which must not wait behind a call that is
    stuck (its handler cancelled at shutdown)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self._target: T | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"rank-{rank}")

    @property
    def target(self) -> T:
        """The rank's object, once built."""
        if self._target is None:
            raise RuntimeError(f"rank {self.rank} is not built")
        return self._target

    async def build(
        self, factory: WorkerFactory[T], config: Config, transport: Transport, place: RankPlace
    ) -> None:
        try:
            self._target = await self._run(factory, config, transport, place)
        except BaseException:
            self._thread.shutdown(wait=False)
            raise

    def _run(self, function: Callable[..., R], *args: Any, **kwargs: Any) -> asyncio.Future[R]:
        return asyncio.get_running_loop().run_in_executor(
            self._thread, functools.partial(function, *args, **kwargs)
        )

    async def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        bound: Callable[P, R] = getattr(self.target, method_name(method))
        return await self._run(bound, *args, **kwargs)

    async def call_beside(
        self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        bound: Callable[P, R] = getattr(self.target, method_name(method))
        return await asyncio.to_thread(bound, *args, **kwargs)

    def notify(self, method: Callable[Concatenate[T, P], object], *args: P.args, **kwargs: P.kwargs) -> None:
        getattr(self.target, method_name(method))(*args, **kwargs)

    async def close(self, timeout: float | None = None) -> None:
        try:
            close = getattr(self._target, "close", None)
            if close is not None:
                try:
                    await asyncio.wait_for(asyncio.to_thread(close), timeout)
                except TimeoutError:
                    logger.warning("rank %d did not close within %gs", self.rank, timeout)
        finally:
            self._thread.shutdown(wait=False, cancel_futures=True)


async def build_in_process(
    factory: WorkerFactory[T], config: Config, transport: Transport, places: Sequence[RankPlace]
) -> list[InProcessWorker[T]]:
    """The ranks ``places`` built here, concurrently, each on its own thread."""

    async def build(place: RankPlace) -> InProcessWorker[T]:
        worker: InProcessWorker[T] = InProcessWorker(place.rank)
        await worker.build(factory, config, transport, place)
        return worker

    return await gather_workers([build(place) for place in places])


async def start_in_process(
    factory: WorkerFactory[T],
    ranks: int,
    config: Config,
    transport: Transport,
    run_dir: Path,
    run_id: str = "",
    *,
    own_processes: OwnProcesses = False,
    only: Sequence[int] | None = None,
    actor: str = "",
    log_into: Callable[[Path, int, str], object] | None = None,
    start_timeout: float = 120.0,
) -> list[Worker[T]]:
    """Every rank in this process, each on a thread of its own (the local runtime, and
    actors hosted in the driver); with ``own_processes``, rank 0 here (``"all"``: in a
    process too) and every other in a spawned process of its own, which logs through
    ``log_into`` (the run's log) as ``<actor> rank <r>`` and must start within
    ``start_timeout`` seconds. ``only``: just those ranks."""
    places = [RankPlace(rank, ranks, run_dir, run_id) for rank in (range(ranks) if only is None else only)]
    if not own_processes:
        return list(await build_in_process(factory, config, transport, places))
    from miles_events.bus.rank_process import start_rank_process

    async def start(place: RankPlace) -> Worker[T]:
        if place.rank == 0 and own_processes != "all":
            (worker,) = await build_in_process(factory, config, transport, [place])
            return worker
        return await start_rank_process(
            factory,
            place,
            config=config,
            transport=transport.name,
            actor=actor,
            log_into=log_into,
            start_timeout=start_timeout,
        )

    return await gather_workers([start(place) for place in places])


async def gather_workers(starts: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await every start; if one failed, close those that started and raise the first error
    (in rank order)."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if not failed:
        return list(results)
    await close_workers([r for r in results if not isinstance(r, BaseException)])
    raise failed[0]


async def call_each(
    workers: Sequence[Worker[T]],
    call: Callable[[Worker[T]], Awaitable[R]],
    *,
    straggler_timeout: float | None = None,
) -> list[R]:
    """``call(worker)`` for every worker at once; their results in rank order. The first
    to fail raises at once, without waiting for the others (they are cancelled here, not in
    their ranks): ``RankDied`` as it is, another exception as ``RankFailed`` naming the
    rank. Once one rank has returned, each other has ``straggler_timeout`` seconds (None:
    no bound) to return, or it fails as ``RankFailed`` with a ``TimeoutError`` (a rank that
    hangs outside any collective would otherwise be waited for forever).
    ``call_each(workers, lambda w: w.call(Rank.load, weights if w.rank == 0 else {}))``."""
    tasks = [asyncio.ensure_future(call(worker)) for worker in workers]

    def raised() -> list[tuple[Worker[T], BaseException]]:
        """(worker, its exception) of every call that has raised, in rank order."""
        return [
            (worker, error)
            for worker, task in zip(workers, tasks, strict=True)
            if task.done() and not task.cancelled() and (error := task.exception()) is not None
        ]

    def unreturned() -> list[tuple[int, int]]:
        return [(w.rank, w.pid) for w, t in zip(workers, tasks, strict=True) if not t.done()]

    try:
        pending: set[asyncio.Future[R]] = set(tasks)
        first: int | None = None  # the first rank that returned
        while pending:
            bound = None if first is None else straggler_timeout
            done, pending = await asyncio.wait(pending, timeout=bound, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                straggler = next(w for w, t in zip(workers, tasks, strict=True) if not t.done())
                late = TimeoutError(f"did not return within {bound:g}s of rank {first}")
                raise RankFailed(straggler.rank, straggler.pid, late, unreturned())
            if first is None:
                first = next(w.rank for w, t in zip(workers, tasks, strict=True) if t in done)
            failed = raised()
            if not failed:
                continue
            if pending and not isinstance(failed[0][1], RankDied):
                # A rank's collective fails when a peer dies: the death, which may be a
                # moment behind, is the cause to report.
                await asyncio.wait(pending, timeout=DEATH_GRACE_SECONDS)
            died = [error for _, error in raised() if isinstance(error, RankDied)]
            if died:
                raise died[0]
            worker, error = failed[0]
            raise RankFailed(worker.rank, worker.pid, error, unreturned()) from error
    finally:
        for task in tasks:
            task.cancel()
    return [task.result() for task in tasks]


async def call_all(
    workers: Sequence[Worker[T]],
    method: Callable[Concatenate[T, P], R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> list[R]:
    """``method(*args, **kwargs)`` on every rank at once, as ``call_each`` (without a bound
    on stragglers: ``call_each`` gives one)."""
    return await call_each(workers, lambda worker: worker.call(method, *args, **kwargs))


async def close_workers(workers: Sequence[Worker[object]], timeout: float | None = None) -> None:
    """Close every worker, concurrently, each within ``timeout`` (None: its own bound); a
    failure to close is logged, not raised."""
    results = await asyncio.gather(*(w.close(timeout) for w in workers), return_exceptions=True)
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, BaseException):
            logger.warning("closing rank %d failed: %s", worker.rank, result)
