"""The ``Sink`` protocol: a bus subscriber that observes a run.

A sink handles events with the same ``@handles`` tables as actors, but synchronously and
without publishing: it folds what it sees into a display, a metrics registry, a tracking
run or the event log. Its lifecycle is the session's (as aiohttp's ``on_startup`` /
``on_cleanup``): ``prepare`` among the start-up checks, before anything of the run is
written; ``start`` before any actor starts, events in bus order, ``flush`` after each batch
the bus delivered, ``close`` once the bus is closed and drained (``release`` instead, when
the run never started).

Two sinks bring commands from outside the run onto the bus, as the session does for a
signal: the control server (each request an event) and the mini FT controller (each step
of a heal); no sink publishes what it observes.

A sink must never hold up the run: a handler that raises is logged once and the sink
keeps draining (a stalled mailbox would hold up every publisher through backpressure).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from miles_events.bus.event_bus import EventBus
from miles_events.bus.handlers import HandlerTable
from schemas.config import Config
from schemas.events import Event

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SinkContext:
    """What a sink learns of the run at ``start``."""

    run_id: str
    run_dir: Path
    config: Config
    bus: EventBus
    fail: Callable[[str], Coroutine[Any, Any, None]]
    """End the run as failed with this reason (for a sink the run cannot go on without)."""


class Sink(HandlerTable):
    """Base class of every sink; subclasses mark their handlers with ``@handles``."""

    name: ClassVar[str] = ""
    mailbox_size: ClassVar[int | None] = None
    """Mailbox capacity; None: the bus's default."""

    def prepare(self, config: Config) -> None:
        """Check, and hold, what ``start`` will need (a port, credentials, a writable
        directory) before anything of the run is written; ``config`` is resolved (absolute
        paths). Raises a one-line input error when it cannot (the run exits with 2, having
        written nothing). Writes nothing."""

    def release(self) -> None:
        """Give back what ``prepare`` holds, when the run does not start (a later check
        failed, or a dry run)."""

    async def start(self, context: SinkContext) -> None:
        """Open what the sink writes to (a server, a file, a tracking run)."""

    def observe(self, event: Event) -> None:
        """Hand ``event`` to its handler, if the sink has one for its type."""
        handler = self.handler_for(event)
        if handler is not None:
            handler(event)

    def flush(self) -> None:
        """The batch the bus delivered has been observed."""

    async def close(self) -> None:
        """Every event has been observed; release what ``start`` opened."""


class SinkHost:
    """Feeds one sink from its own mailbox, in batches, until the bus closes."""

    def __init__(self, sink: Sink, bus: EventBus, max_batch: int) -> None:
        self.sink = sink
        self.max_batch = max_batch
        size = sink.mailbox_size or max(bus.mailbox_size, 4 * max_batch)
        self.mailbox = bus.subscribe(sink.name, tuple(sink.handlers()), max_size=size)
        self._failed_once = False
        self.task = asyncio.create_task(self._drain(), name=f"sink-{sink.name}")

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            if not self._failed_once:
                self._failed_once = True
                on = f" on {type(args[0]).__name__}" if args else ""
                logger.warning("sink %s failed%s; the run goes on", self.sink.name, on, exc_info=True)

    async def _drain(self) -> None:
        observe, guarded = self.sink.observe, self._guarded
        while batch := await self.mailbox.get_batch(self.max_batch):
            for event in batch:
                guarded(observe, event)
            guarded(self.sink.flush)

    async def join(self) -> None:
        """After the bus is closed: the last events observed."""
        await self.task
