"""Actors for the ray runtime's own tests (imported by Ray worker processes)."""

from __future__ import annotations

import os

from miles_events.bus.actor import Actor, WorkerGroup, handles
from schemas.events import RolloutGenerated, RolloutRequested, StopRequested


class Echo(Actor):
    """Answers each RolloutRequested with a StopRequested naming its process and the id."""

    name = "echo"

    @classmethod
    def resources(cls, config):  # type: ignore[no-untyped-def]
        return WorkerGroup(cpus_per_rank=0.5)

    @handles(RolloutRequested, emits=(StopRequested,))
    async def on_rollout(self, event: RolloutRequested) -> None:
        if event.rollout_id == 13:
            raise ValueError("unlucky rollout")
        if event.rollout_id == 666:
            os._exit(1)
        await self.publish(StopRequested(reason=f"{os.getpid()}:{event.rollout_id}"))

    @handles(RolloutGenerated, emits=())
    async def on_generated(self, event: RolloutGenerated) -> None:  # pragma: no cover - routing only
        pass
