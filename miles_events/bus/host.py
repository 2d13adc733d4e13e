"""Hosting one actor: its mailbox, the loop that feeds it events one at a time, and what
happens when a handler raises.

The same host runs an actor in the driver (local runtime) and inside a Ray actor process
(ray runtime); only the ``publish`` function it is given differs.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

from miles_events.bus.actor import Actor
from miles_events.bus.clock import SYSTEM_CLOCK, Clock, wait_for
from miles_events.bus.errors import describe_error, innermost
from miles_events.bus.event_bus import BusClosed, Mailbox
from miles_events.bus.workers import OwnProcesses, StartWorkers, Worker, WorkerFactory, start_in_process
from miles_events.transport.base import Transport
from schemas.config import Config
from schemas.events import ActorFailed, Event
from schemas.plan import RunPlan

logger = logging.getLogger(__name__)

T = TypeVar("T")

Publish = Callable[[Event], Awaitable[object]]


@dataclass
class HostContext:
    """The ``ActorContext`` a host gives its actor."""

    run_id: str
    name: str
    config: Config
    run_dir: Path
    transport: Transport
    plan: RunPlan
    _publish: Publish = field(repr=False)
    clock: Clock = SYSTEM_CLOCK
    _start_workers: StartWorkers | None = field(default=None, repr=False)
    """How the runtime hosting the actor starts its ranks; None: all in this process."""

    async def start_workers(
        self,
        factory: WorkerFactory[T],
        ranks: int,
        *,
        own_processes: OwnProcesses = False,
        only: Sequence[int] | None = None,
    ) -> list[Worker[T]]:
        if self._start_workers is None:
            return await start_in_process(
                factory,
                ranks,
                self.config,
                self.transport,
                self.run_dir,
                self.run_id,
                own_processes=own_processes,
                only=only,
                actor=self.name,
            )
        return await self._start_workers(factory, ranks, own_processes=own_processes, only=only)

    async def publish(self, event: Event) -> None:
        if not event.time or not event.source:
            event = msgspec.structs.replace(
                event, time=event.time or self.clock.time(), source=event.source or self.name
            )
        await self._publish(event)

    async def report_failure(self, error: BaseException) -> None:
        """A task the actor spawned raised: the run hears it as this actor's failure."""
        logger.debug("actor %s: a spawned task failed", self.name, exc_info=error)
        try:
            await self._publish(actor_failed(self.name, error, self.clock))
        except BusClosed:
            logger.error("actor %s failed after the run ended: %s", self.name, describe_error(error))


def actor_failed(name: str, error: BaseException, clock: Clock, event: Event | None = None) -> ActorFailed:
    """The ``ActorFailed`` of actor ``name`` for ``error`` (raised handling ``event``, or in
    a task the actor spawned): one line, and the whole traceback for the event log."""
    return ActorFailed(
        actor=name,
        error=describe_error(error),
        traceback="".join(traceback.format_exception(innermost(error))),
        event_type=type(event).__name__ if event is not None else "",
        event_seq=event.seq if event is not None else -1,
        time=clock.time(),
        source=name,
    )


class ActorHost:
    """Feeds ``mailbox`` to ``actor`` in order. A handler that raises is reported as
    ``ActorFailed`` and the actor handles nothing more (the Coordinator stops the run)."""

    def __init__(
        self,
        actor: Actor,
        mailbox: Mailbox,
        publish: Publish,
        clock: Clock = SYSTEM_CLOCK,
        interrupts: Mailbox | None = None,
    ) -> None:
        """``interrupts``: a mailbox of ``StopRequested`` handed to ``actor.interrupt`` as
        they arrive, beside (not behind) the handler in progress."""
        self.actor = actor
        self.clock = clock
        self.mailbox = mailbox
        self.interrupts = interrupts
        self._publish = publish
        self.busy = False
        self.failed: ActorFailed | None = None
        self._task: asyncio.Task[None] | None = None
        self._interrupt_task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.mailbox.name

    def start(self) -> None:
        self._task = asyncio.create_task(self._consume(), name=f"actor-{self.name}")
        if self.interrupts is not None:
            self._interrupt_task = asyncio.create_task(self._interrupt(), name=f"interrupt-{self.name}")

    async def _interrupt(self) -> None:
        assert self.interrupts is not None
        while (event := await self.interrupts.get()) is not None:
            self.deliver_interrupt(event)

    def deliver_interrupt(self, event: Event) -> None:
        if isinstance(event, self.actor.interrupt_types) and self.failed is None:
            try:
                self.actor.interrupt(event)
            except Exception:
                logger.exception("actor %s failed to take an interrupt", self.name)

    async def handle(self, event: Event) -> None:
        """Handle one event now (the ray host delivers batches through this)."""
        if self.failed is not None:
            return
        self.busy = True
        try:
            await self.actor.handle(event)
        except BusClosed:
            # The run ended while this handler ran; what it had left to say has nowhere to go.
            logger.warning(
                "actor %s finished %s after the run ended; its events are dropped",
                self.name,
                type(event).__name__,
            )
        except Exception as error:
            # One line for the console; the whole traceback goes into the event log.
            logger.debug(
                "actor %s failed on %s #%d", self.name, type(event).__name__, event.seq, exc_info=True
            )
            self.failed = actor_failed(self.name, error, self.clock, event)
            try:
                await self._publish(self.failed)
            except BusClosed:
                logger.error("actor %s failed after the run ended: %s", self.name, self.failed.error)
        finally:
            self.busy = False

    async def _consume(self) -> None:
        while (event := await self.mailbox.get()) is not None:
            await self.handle(event)

    @property
    def idle(self) -> bool:
        return not self.busy and self.mailbox.statistics().depth == 0

    async def join(self, timeout: float | None = None) -> None:
        """Wait until the mailbox is closed and drained; after ``timeout`` seconds, cancel
        the handler still running (a stuck actor must not hold the run's shutdown)."""
        if self._interrupt_task is not None:
            self._interrupt_task.cancel()  # the run is over: no stop is left to deliver
        if self._task is None:
            return
        try:
            await wait_for(asyncio.shield(self._task), timeout, self.clock)
        except TimeoutError:
            logger.warning("actor %s still busy %.0fs after the run ended; cancelled", self.name, timeout)
            self._task.cancel()
