"""Test support: feed events to an actor the way a host does, recording what it publishes."""

from __future__ import annotations

from miles_events.app.redrive import RecordingContext
from miles_events.bus.actor import Actor
from schemas.events import Event

__all__ = ["RecordingContext", "feed"]


async def feed(actor: Actor, *events: Event) -> list[Event]:
    """Deliver ``events`` in order; return what the actor published meanwhile."""
    context = actor.context
    assert isinstance(context, RecordingContext)
    start = len(context.published)
    for event in events:
        await actor.handle(event)
    return context.published[start:]
