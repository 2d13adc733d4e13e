"""The ``local`` runtime: every actor in this process, on this event loop.

Used for quick debugging, replay tests and single-process runs; the actors are the very
classes the ray runtime hosts in their own processes.
"""

from __future__ import annotations

import logging

from miles_events.bus.actor import Actor
from miles_events.bus.event_bus import EventBus
from miles_events.bus.host import ActorHost, HostContext, describe_error
from miles_events.runtime.base import ActorStartError, RunContext
from miles_events.transport.base import Transport

logger = logging.getLogger(__name__)


def host_context(run: RunContext, transport: Transport, bus: EventBus, name: str) -> HostContext:
    """The context of an actor hosted in this process: it publishes straight onto ``bus``."""

    async def publish(event):  # type: ignore[no-untyped-def]
        return await bus.publish(event, source=name)

    return HostContext(
        run_id=run.run_id, name=name, config=run.config, run_dir=run.run_dir, transport=transport, _publish=publish
    )


async def start_local_host(bus: EventBus, actor: Actor, name: str) -> ActorHost:
    """Subscribe ``actor`` to the types it handles and start feeding it."""
    mailbox = bus.subscribe(name, tuple(actor.handlers()))
    host = ActorHost(actor, mailbox, actor.context.publish)
    host.start()
    return host


class LocalRuntime:
    name = "local"

    def __init__(self, run: RunContext, transport: Transport) -> None:
        self.run = run
        self.transport = transport
        self.hosts: list[ActorHost] = []

    async def start(self, bus: EventBus, actor_classes: list[type[Actor]]) -> None:
        for cls in actor_classes:
            actor = cls(self.run.config, host_context(self.run, self.transport, bus, cls.name))
            try:
                await actor.start()
            except Exception as error:
                raise ActorStartError(f"{cls.name}: {describe_error(error)}") from error
            self.hosts.append(await start_local_host(bus, actor, cls.name))
            logger.info("started %s (local)", cls.name)

    def idle(self) -> bool:
        return all(host.idle for host in self.hosts)

    async def stop(self, timeout: float = 60.0) -> None:
        """After the bus is closed: let every mailbox drain, then stop the actors."""
        for host in self.hosts:
            await host.join(timeout)
        for host in self.hosts:
            try:
                await host.actor.stop()
            except Exception:
                logger.exception("stopping %s failed", host.name)
