"""Actors for the ray runtime's own tests (imported by Ray worker processes)."""

from __future__ import annotations

import os
from pathlib import Path

from miles_events.bus.actor import Actor, WorkerGroup, handles
from schemas.events import EvalRequested, RolloutGenerated, RolloutRequested, StopRequested


class Echo(Actor):
    """A light actor (role service): answers each RolloutRequested with a StopRequested
    naming its process and the id; writes ``echo.stopped`` into the run directory when it
    stops."""

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

    async def stop(self) -> None:
        (Path(self.context.run_dir) / f"{self.name}.stopped").write_text(str(os.getpid()))


class Model(Actor):
    """Stands for a model actor (role rollout: a process of its own, always): answers each
    EvalRequested with a StopRequested naming its process, the id and the
    ``MALLOC_ARENA_MAX`` a process it started would get; writes ``model.stopped`` when it
    stops."""

    name = "model"
    stop = Echo.stop

    @classmethod
    def resources(cls, config):  # type: ignore[no-untyped-def]
        return WorkerGroup(role="rollout", cpus_per_rank=0.5)

    @handles(EvalRequested, emits=(StopRequested,))
    async def on_eval(self, event: EvalRequested) -> None:
        arenas = os.environ.get("MALLOC_ARENA_MAX", "")
        await self.publish(StopRequested(reason=f"{os.getpid()}:{event.rollout_id}:{arenas}"))
