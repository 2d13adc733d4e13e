"""The event log as a sink: every event appended to ``<run dir>/events.log`` as published."""

from __future__ import annotations

import asyncio
import logging

from miles_events.bus.errors import describe_error
from miles_events.bus.event_log import EventLogWriter
from miles_events.bus.handlers import handles
from miles_events.sinks.base import Sink, SinkContext
from schemas.events import Event

logger = logging.getLogger(__name__)


class EventLogSink(Sink):
    """Appends each delivered batch with one write. If the log cannot be written (disk
    full, say) the run fails with that reason, and the sink keeps draining so that the bus
    never backs up behind a dead writer."""

    name = "event-log"

    def __init__(self, writer: EventLogWriter) -> None:
        self.writer = writer
        self.error: BaseException | None = None
        self._batch: list[Event] = []
        self._context: SinkContext | None = None
        self._failing: asyncio.Task[None] | None = None

    async def start(self, context: SinkContext) -> None:
        self._context = context

    @handles(Event)
    def on_event(self, event: Event) -> None:
        if self.error is None:
            self._batch.append(event)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch or self.error is not None:
            return
        try:
            self.writer.append_many(batch)
        except Exception as error:
            self.error = error
            logger.error("cannot write the event log: %s", describe_error(error))
            if self._context is not None:
                reason = f"cannot write the event log {self.writer.path}: {describe_error(error)}"
                self._failing = asyncio.get_running_loop().create_task(self._context.fail(reason))

    async def close(self) -> None:
        self.flush()
        self.writer.close()
