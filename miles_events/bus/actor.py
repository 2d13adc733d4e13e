"""The small API every actor is written against.

An actor is a plain class: it declares the event types it handles, and what each handler
may emit, with ``@handles(..., emits=(...))``; keeps its own state; and talks to the rest
of the system only by publishing events through its context. It never calls another actor.
The runtime (local or ray) constructs it, calls ``start``, then ``ready`` once every actor
of the run has started, delivers events one at a time in bus order, and calls ``stop``.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from miles_events.bus.clock import Clock
from miles_events.bus.handlers import HandlerTable, handles
from miles_events.bus.workers import (
    OwnProcesses,
    RankDied,
    RankFailed,
    RankPlace,
    Worker,
    WorkerFactory,
    brief_error,
    call_all,
    call_each,
    close_workers,
)
from miles_events.transport.base import Transport
from schemas.config import Config
from schemas.events import Event, StopRequested
from schemas.plan import RunPlan

__all__ = [
    "Actor",
    "ActorContext",
    "OwnProcesses",
    "RankDied",
    "RankFailed",
    "RankPlace",
    "UndeclaredEmit",
    "Worker",
    "WorkerFactory",
    "WorkerGroup",
    "brief_error",
    "call_all",
    "call_each",
    "close_workers",
    "handles",
]

T = TypeVar("T")

Role = Literal["driver", "rollout", "actor", "critic", "service"]


@dataclass(frozen=True)
class WorkerGroup:
    """Where an actor runs and what it needs: ``num_ranks`` workers of ``cpus_per_rank`` CPUs
    and ``gpus_per_rank`` GPUs, placed in the placement group of its ``role`` (the seed's
    rollout / actor / critic split; ``service`` for the small actors; ``driver`` runs in the
    driver process). The actor itself is hosted on rank 0; the other ranks' bundles are
    reserved for its backend's workers."""

    role: Role = "service"
    num_ranks: int = 1
    cpus_per_rank: float = 0.1
    gpus_per_rank: float = 0.0

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"a worker group needs at least one rank, got {self.num_ranks}")


class ActorContext(Protocol):
    """What the runtime gives an actor."""

    run_id: str
    name: str
    config: Config
    run_dir: Path
    transport: Transport
    plan: RunPlan
    clock: Clock

    async def publish(self, event: Event) -> None:
        """Put ``event`` on the bus (stamped with ``source=name``); waits under backpressure."""
        ...

    async def report_failure(self, error: BaseException) -> None:
        """A task the actor spawned raised: report it as the actor's failure."""
        ...

    async def start_workers(
        self,
        factory: WorkerFactory[T],
        ranks: int,
        *,
        own_processes: OwnProcesses = False,
        only: Sequence[int] | None = None,
    ) -> list[Worker[T]]:
        """The ``ranks`` workers of the actor's worker group, started (``miles_events.bus.workers``);
        ``own_processes``: every rank but 0 (``"all"``: every rank) in a process of its own,
        on every runtime; ``only``: just those ranks (one started again)."""
        ...


class UndeclaredEmit(TypeError):
    """An actor published an event type its handler (or class) does not declare."""


# The emits of a task an actor spawned (``Actor.spawn``), inside that task only.
_spawned_emits: contextvars.ContextVar[tuple[str, frozenset[type[Event]]] | None] = contextvars.ContextVar(
    "spawned_emits", default=None
)


class Actor(HandlerTable):
    """Base class of every actor."""

    name: ClassVar[str] = ""
    emits: ClassVar[tuple[type[Event], ...]] = ()
    """What the actor publishes outside its handlers (from ``ready``)."""
    _handler_emits: ClassVar[dict[str, frozenset[type[Event]]]] = {}
    _emit_routes: ClassVar[dict[type[Event], tuple[str, frozenset[type[Event]]]]] = {}
    """Event type -> (handler, what it may emit), filled on first dispatch."""

    def __init__(self, config: Config, context: ActorContext) -> None:
        self.config = config
        self.context = context

    # The handler running now, with what it may emit (an actor handles one event at a time).
    _emitting: tuple[str, frozenset[type[Event]]] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        undeclared = [route.method for route in cls.routes() if route.emits is None]
        if undeclared:
            raise TypeError(f"{cls.__name__}: @handles of {', '.join(undeclared)} must declare emits=(...)")
        cls._handler_emits = {route.method: frozenset(route.emits or ()) for route in cls.routes()}
        cls._emit_routes = {}

    @classmethod
    def wanted(cls, config: Config) -> bool:
        """Whether a run of ``config`` has this actor (the critic only where PPO needs one)."""
        return True

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        return WorkerGroup()

    @classmethod
    def process_modules(cls, config: Config) -> list[str]:
        """The modules a process that will host this actor under ``config`` imports before
        it is given the actor (the ray runtime has them imported while Ray starts): its own,
        and what it imports only when it computes (torch with its backend), where that is
        where its start-up time goes."""
        return [cls.__module__]

    async def start(self) -> None:
        """Acquire resources (load models, open files). Called once before any event."""

    async def ready(self) -> None:
        """Every actor of the run has started. Called once, before any event."""

    async def stop(self) -> None:
        """Release resources. Called once after the mailbox is drained."""

    async def publish(self, event: Event) -> None:
        current = _spawned_emits.get() or self._emitting
        method, allowed = current if current is not None else ("", self.emits)
        if type(event) not in allowed:
            where = (
                f"{type(self).__name__}.{method}" if method else f"{type(self).__name__} (outside a handler)"
            )
            raise UndeclaredEmit(
                f"{where} published {type(event).__name__}, which it does not declare in emits="
            )
        await self.context.publish(event)

    async def handle(self, event: Event) -> None:
        """Dispatch ``event`` to its handler (the runtime calls this)."""
        route = self._emit_routes.get(type(event))
        if route is None:
            method = self.dispatch_name(type(event))
            if method is None:
                return
            route = self._emit_routes[type(event)] = (method, self._handler_emits[method])
        self._emitting = route
        try:
            await getattr(self, route[0])(event)
        finally:
            self._emitting = None

    restartable: ClassVar[bool] = False
    """Whether the actor, in a process of its own (``ray.own_process``) that dies, is
    started again (``control.max_restarts``, ``restart_backoff_*``) and given the events it
    was handling: an actor whose handling of an event can be done twice to one effect."""
    interrupt_types: ClassVar[tuple[type[Event], ...]] = (StopRequested,)
    """The events ``interrupt`` is given, out of band (an actor that heals its ranks takes
    fault injections and suspensions so too)."""

    def interrupt(self, event: Event) -> None:
        """A stop (or another of ``interrupt_types``) was asked for: called at once, even
        while a handler runs (out of band, on the actor's event loop), so that long work can
        end at its next cancellation point. Must not block. Actors whose handlers can run
        long override it; the default does nothing."""

    @classmethod
    def interruptible(cls) -> bool:
        """Whether this actor overrides ``interrupt`` (its hosts then deliver stops at once)."""
        return cls.interrupt is not Actor.interrupt

    def spawn(self, coro: Coroutine[Any, Any, None], *, emits: tuple[type[Event], ...]) -> asyncio.Task[None]:
        """Run ``coro`` beside the handlers (a timer, say), allowed to publish ``emits``.
        If it raises, the run hears it as this actor's ``ActorFailed``."""
        context = contextvars.copy_context()
        context.run(_spawned_emits.set, (getattr(coro, "__name__", "task"), frozenset(emits)))
        task = asyncio.get_running_loop().create_task(coro, context=context)
        task.add_done_callback(self._spawned_done)
        return task

    def _spawned_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        assert error is not None
        asyncio.get_running_loop().create_task(self.context.report_failure(error))
