"""The small API every actor is written against.

An actor is a plain class: it declares the event types it handles with ``@handles``, keeps
its own state, and talks to the rest of the system only by publishing events through its
context. It never calls another actor. The runtime (local or ray) constructs it, calls
``start``, delivers events one at a time in bus order, and calls ``stop``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from miles_events.transport.base import Transport
from schemas.config import Config
from schemas.events import Event

E = TypeVar("E", bound=Event)
Handler = Callable[[Any, Any], Awaitable[None]]


@dataclass(frozen=True)
class Resources:
    """What an actor's placement-group bundle asks for."""

    num_cpus: float = 0.1
    num_gpus: float = 0.0


class ActorContext(Protocol):
    """What the runtime gives an actor."""

    run_id: str
    name: str
    config: Config
    run_dir: Path
    transport: Transport

    async def publish(self, event: Event) -> None:
        """Put ``event`` on the bus (stamped with ``source=name``); waits under backpressure."""
        ...


def handles(*event_types: type[Event]) -> Callable[[Handler], Handler]:
    """Mark a method as the handler of ``event_types``."""

    def mark(method: Handler) -> Handler:
        method.__handles__ = event_types  # type: ignore[attr-defined]
        return method

    return mark


class Actor:
    """Base class of every actor."""

    name: ClassVar[str] = ""

    def __init__(self, config: Config, context: ActorContext) -> None:
        self.config = config
        self.context = context

    @classmethod
    def resources(cls, config: Config) -> Resources:
        return Resources()

    _handler_table: ClassVar[dict[type[Event], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type[Event], str] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                for event_type in getattr(value, "__handles__", ()):
                    table[event_type] = attr
        cls._handler_table = table

    @classmethod
    def handlers(cls) -> dict[type[Event], str]:
        """Event type -> name of the method that handles it."""
        return cls._handler_table

    async def start(self) -> None:
        """Acquire resources (load models, open files). Called once before any event."""

    async def stop(self) -> None:
        """Release resources. Called once after the mailbox is drained."""

    async def publish(self, event: Event) -> None:
        await self.context.publish(event)

    async def handle(self, event: Event) -> None:
        """Dispatch ``event`` to its handler (the runtime calls this)."""
        method = self._handler_table.get(type(event))
        if method is None:
            return
        await getattr(self, method)(event)
