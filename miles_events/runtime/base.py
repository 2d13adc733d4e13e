"""What every runtime provides: the run's context, and the small interface the session uses."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio.to_thread

from miles_events.bus.actor import Actor
from miles_events.bus.clock import SYSTEM_CLOCK, Clock
from miles_events.bus.errors import describe_error
from miles_events.bus.event_bus import EventBus
from miles_events.bus.host import ActorHost, HostContext, Publish
from miles_events.bus.workers import StartWorkers, start_in_process
from miles_events.runtime.run_log import log_into
from miles_events.transport.base import Transport
from schemas.config import Config
from schemas.events import Event
from schemas.plan import RunPlan

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The format of the driver's log lines on the terminal (``--log-level``); the run's log
file names each line's process as well (``miles_events.runtime.run_log``)."""


@dataclass(frozen=True)
class Preparation:
    """What must be on disk before any actor starts, made once per run by its runtime: the
    built-in base model. The local runtime makes it in this process; the ray runtime in a
    model actor's process (where torch is imported anyway), so that its driver never
    imports torch. ``make`` is picklable (it crosses to that process)."""

    what: str
    make: Callable[[], object]

    async def run_here(self) -> None:
        try:
            await anyio.to_thread.run_sync(self.make)
        except Exception as error:
            raise ActorStartError(f"{self.what}: {describe_error(error)}") from error


@dataclass(frozen=True)
class RunContext:
    """What every runtime needs to host a run's actors."""

    run_id: str
    config: Config
    run_dir: Path
    transport: str
    plan: RunPlan
    clock: Clock = field(default=SYSTEM_CLOCK, compare=False)
    prepare: Preparation | None = None


class ActorStartError(RuntimeError):
    """An actor's ``start()`` raised; the message names the actor and its error."""


class Runtime(Protocol):
    """Hosts the run's actors: ``local`` (this process) or ``ray`` (a process for each
    model actor, the others in this process)."""

    name: str

    async def start(self, bus: EventBus, actor_classes: list[type[Actor]]) -> None:
        """Construct and start every actor, subscribed to the types it handles, then tell
        each that all are ready."""
        ...

    def idle(self) -> bool:
        """No event queued for or being handled by any actor, nothing left to collect."""
        ...

    def processes(self) -> list[tuple[str, int]]:
        """(actor, pid) of every actor process besides the driver's."""
        ...

    async def stop(self) -> None:
        """After the bus is closed: drain, stop the actors, release what was started."""
        ...


def host_context(
    run: RunContext,
    transport: Transport,
    name: str,
    publish: Publish,
    start_workers: StartWorkers | None = None,
) -> HostContext:
    """The context of actor ``name`` of ``run``, publishing through ``publish``; its worker
    ranks started by ``start_workers`` (None: in this process, or those asked for in
    processes of their own spawned, logging into the run's log)."""
    if start_workers is None:
        start_workers = functools.partial(
            start_in_process,
            config=run.config,
            transport=transport,
            run_dir=run.run_dir,
            run_id=run.run_id,
            actor=name,
            log_into=log_into,
        )
    return HostContext(
        run_id=run.run_id,
        name=name,
        config=run.config,
        run_dir=run.run_dir,
        transport=transport,
        plan=run.plan,
        clock=run.clock,
        _publish=publish,
        _start_workers=start_workers,
    )


class InProcessHosts:
    """Actors hosted in this process, on this event loop: every actor of the local
    runtime; of the ray runtime, the Coordinator and the light actors that
    ``ray.own_process`` does not name."""

    def __init__(self, run: RunContext, transport: Transport) -> None:
        self.run = run
        self.transport = transport
        self.hosts: list[ActorHost] = []

    async def start(self, bus: EventBus, cls: type[Actor]) -> ActorHost:
        async def publish(event: Event, name: str = cls.name) -> object:
            # Hosted beside the bus: straight onto it.
            return await bus.publish(event, source=name)

        actor = cls(self.run.config, host_context(self.run, self.transport, cls.name, publish))
        try:
            await actor.start()
        except Exception as error:
            raise ActorStartError(f"{cls.name}: {describe_error(error)}") from error
        mailbox = bus.subscribe(cls.name, tuple(actor.handlers()))
        interrupts = (
            bus.subscribe(f"{cls.name}/interrupt", cls.interrupt_types) if cls.interruptible() else None
        )
        host = ActorHost(actor, mailbox, actor.context.publish, self.run.clock, interrupts)
        self.hosts.append(host)
        return host

    async def ready(self) -> None:
        """Tell every actor that all have started, then start feeding them: no actor sees an
        event before its ``ready`` (the Coordinator's ``ready`` publishes the first)."""
        for host in self.hosts:
            await host.actor.ready()
        for host in self.hosts:
            host.start()

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
