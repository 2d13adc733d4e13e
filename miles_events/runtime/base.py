"""What every runtime provides: the run's context, and the small interface the session uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from miles_events.bus.actor import Actor
from miles_events.bus.event_bus import EventBus
from schemas.config import Config


@dataclass(frozen=True)
class RunContext:
    """What every runtime needs to host a run's actors."""

    run_id: str
    config: Config
    run_dir: Path
    transport: str


class ActorStartError(RuntimeError):
    """An actor's ``start()`` raised; the message names the actor and its error."""


class Runtime(Protocol):
    """Hosts the run's actors: ``local`` (this process) or ``ray`` (a process each)."""

    name: str

    async def start(self, bus: EventBus, actor_classes: list[type[Actor]]) -> None:
        """Construct and start every actor, subscribed to the types it handles."""
        ...

    def idle(self) -> bool:
        """No event queued for or being handled by any actor, nothing left to collect."""
        ...

    async def stop(self) -> None:
        """After the bus is closed: drain, stop the actors, release what was started."""
        ...
