"""The ``local`` runtime: every actor in this process, on this event loop.

Used for quick debugging, replay tests and single-process runs; the actors are the very
classes the ray runtime hosts in their own processes.
"""

from __future__ import annotations

import logging

from miles_events.bus.actor import Actor
from miles_events.bus.event_bus import EventBus
from miles_events.runtime.base import InProcessHosts, RunContext
from miles_events.transport.base import Transport

logger = logging.getLogger(__name__)


class LocalRuntime:
    name = "local"

    def __init__(self, run: RunContext, transport: Transport) -> None:
        self.run = run
        self.hosts = InProcessHosts(run, transport)

    async def start(self, bus: EventBus, actor_classes: list[type[Actor]]) -> None:
        if self.run.prepare is not None:
            await self.run.prepare.run_here()
        for cls in actor_classes:
            await self.hosts.start(bus, cls)
            logger.info("started %s (local)", cls.name)
        await self.hosts.ready()

    def idle(self) -> bool:
        return self.hosts.idle()

    def processes(self) -> list[tuple[str, int]]:
        return []  # every actor runs in the driver

    async def stop(self, timeout: float = 60.0) -> None:
        await self.hosts.stop(timeout)
