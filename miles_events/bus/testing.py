"""An actor outside a run: a context that records what the actor publishes instead of
putting it on a bus, and ``feed``, which delivers events to it as its host would.

Tests of one actor use it, and so does re-driving an actor from a recorded event log
(``miles_events.app.redrive``). It needs nothing of a run: no bus, no runtime, no mailbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from miles_events.bus.actor import Actor, ActorContext
from miles_events.bus.clock import SYSTEM_CLOCK, Clock
from miles_events.bus.host import actor_failed
from miles_events.bus.workers import OwnProcesses, T, Worker, WorkerFactory, start_in_process
from miles_events.transport.base import Transport
from miles_events.transport.inprocess import InProcessTransport
from schemas.config import Config
from schemas.events import Event
from schemas.plan import RunPlan

__all__ = ["RecordingContext", "feed"]


@dataclass
class RecordingContext:
    """An ``ActorContext`` that records publications instead of putting them on a bus. Its
    worker ranks run as the local runtime runs them: in this process, or (``own_processes``)
    every rank but 0 in a spawned process of its own."""

    config: Config
    name: str = "actor"
    run_id: str = "redrive"
    run_dir: Path = Path(".")
    transport: Transport = field(default_factory=lambda: InProcessTransport("redrive"))
    plan: RunPlan = field(
        default_factory=lambda: RunPlan(start_rollout_id=0, num_rollout=0, num_rollout_per_epoch=1)
    )
    clock: Clock = SYSTEM_CLOCK
    published: list[Event] = field(default_factory=list)

    async def publish(self, event: Event) -> None:
        self.published.append(event)

    async def report_failure(self, error: BaseException) -> None:
        self.published.append(actor_failed(self.name, error, self.clock))

    async def start_workers(
        self,
        factory: WorkerFactory[T],
        ranks: int,
        *,
        own_processes: OwnProcesses = False,
        only: Sequence[int] | None = None,
    ) -> list[Worker[T]]:
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


async def feed(actor: Actor, *events: Event) -> list[Event]:
    """Deliver ``events`` to ``actor`` in order, one at a time as its host does; return what
    it published meanwhile. The actor must have been built with a ``RecordingContext``."""
    context = actor.context
    assert isinstance(context, RecordingContext), "build the actor with a RecordingContext"
    start = len(context.published)
    for event in events:
        await actor.handle(event)
    return context.published[start:]


if TYPE_CHECKING:
    # A type checker holds RecordingContext to the protocol the runtime's contexts follow.
    def _is_an_actor_context(context: RecordingContext) -> ActorContext:
        return context
