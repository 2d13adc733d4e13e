"""Test support: a context that records what an actor publishes, and a driver that feeds
events to an actor the way a host does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from schemas.config import Config
from schemas.events import Event

from miles_events.actor import Actor
from miles_events.transport import InProcessTransport, Transport


@dataclass
class RecordingContext:
    config: Config
    run_dir: Path = Path(".")
    run_id: str = "test-run"
    name: str = "actor"
    transport: Transport = field(default_factory=lambda: InProcessTransport("test-run"))
    published: list[Event] = field(default_factory=list)

    async def publish(self, event: Event) -> None:
        self.published.append(event)

    def take(self) -> list[Event]:
        out, self.published = self.published, []
        return out


async def feed(actor: Actor, *events: Event) -> list[Event]:
    """Deliver ``events`` in order; return what the actor published meanwhile."""
    context = actor.context
    assert isinstance(context, RecordingContext)
    start = len(context.published)
    for event in events:
        await actor.handle(event)
    return context.published[start:]
