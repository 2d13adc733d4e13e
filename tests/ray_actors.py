"""Actors for the ray runtime's own tests (imported by Ray worker processes)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from miles_events.bus.actor import Actor, WorkerGroup, handles
from miles_events.bus.workers import RankDied, RankPlace, close_workers
from schemas.events import EvalRequested, RolloutGenerated, RolloutRequested, StopRequested

logger = logging.getLogger(__name__)


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


class Phoenix(Actor):
    """A light actor that is restarted when its process dies (``restartable``): its process
    dies while handling RolloutRequested 777 the first time (a file in the run directory
    remembers), and answers it with a StopRequested naming its process the next time."""

    name = "phoenix"
    restartable = True

    @classmethod
    def resources(cls, config):  # type: ignore[no-untyped-def]
        return WorkerGroup(cpus_per_rank=0.5)

    @handles(RolloutRequested, emits=(StopRequested,))
    async def on_rollout(self, event: RolloutRequested) -> None:
        marker = Path(self.context.run_dir) / f"{self.name}.died-{event.rollout_id}"
        if event.rollout_id >= 777 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        await self.publish(StopRequested(reason=f"{os.getpid()}:{event.rollout_id}"))


class Model(Actor):
    """Stands for a model actor (role rollout: a process of its own, always): answers each
    EvalRequested with a StopRequested naming its process, the id, the
    ``MALLOC_ARENA_MAX`` a process it started would get, and its process's logging (the root
    logger's level / its number of handlers); writes ``model.stopped`` when it
    stops."""

    name = "model"
    stop = Echo.stop

    async def start(self) -> None:
        # Says whether a run's Preparation (``write_pid``'s file) was there when it started.
        run_dir = Path(self.context.run_dir)
        prepared = (run_dir / PREPARED).exists()
        (run_dir / f"{self.name}.started").write_text("prepared" if prepared else "unprepared")

    @classmethod
    def resources(cls, config):  # type: ignore[no-untyped-def]
        return WorkerGroup(role="rollout", cpus_per_rank=0.5)

    @handles(EvalRequested, emits=(StopRequested,))
    async def on_eval(self, event: EvalRequested) -> None:
        logger.info("eval %d asked of the model", event.rollout_id)
        arenas = os.environ.get("MALLOC_ARENA_MAX", "")
        await self.publish(
            StopRequested(reason=f"{os.getpid()}:{event.rollout_id}:{arenas}:{process_logging()}")
        )


class Learner(Model):
    """Stands for the trainer (role actor): the ray runtime makes a run's ``Preparation`` in
    its process."""

    name = "learner"

    @classmethod
    def resources(cls, config):  # type: ignore[no-untyped-def]
        return WorkerGroup(role="actor", cpus_per_rank=0.5)


def process_logging() -> str:
    """This process's logging: its root logger's level / how many handlers it has."""
    root = logging.getLogger()
    return f"{logging.getLevelName(root.getEffectiveLevel())}/{len(root.handlers)}"


PREPARED = "prepared-by"


def write_pid(path: Path) -> None:
    """A ``Preparation`` that says where it ran (call it with ``<run_dir>/PREPARED``)."""
    path.write_text(str(os.getpid()))


def fill_the_disk() -> None:
    raise OSError(28, "No space left on device")


class RankProbe:
    """One rank of ``Ranked``'s worker group: says where it runs, fails when asked."""

    def __init__(self, place: RankPlace) -> None:
        self.place = place
        self.notified: list[str] = []

    def where(self) -> tuple[int, int, int, str]:
        logger.info("rank %d asked where it runs", self.place.rank)
        return self.place.rank, os.getpid(), self.place.ranks_sharing_cores, process_logging()

    def fail(self) -> None:
        raise KeyError(f"rank {self.place.rank} was asked to fail")

    def die(self) -> None:
        """Killed in the middle of this call."""
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    def note(self, text: str) -> None:
        self.notified.append(text)

    def notes(self) -> list[str]:
        return self.notified

    def close(self) -> None:
        (self.place.run_dir / f"rank-{self.place.rank}.closed").write_text(str(os.getpid()))


def rank_probe(config, transport, place: RankPlace) -> RankProbe:  # type: ignore[no-untyped-def]
    if place.rank == int(os.environ.get("MILES_TEST_FAILING_RANK", "-1")):
        raise OSError(f"rank {place.rank} cannot start")
    return RankProbe(place)


class Ranked(Actor):
    """A model actor with a worker group of two ranks: on EvalRequested, answers with a
    StopRequested per rank (``rank:pid:ranks_sharing_cores:actor pid:notes:logging``); on RolloutRequested, asks rank 1
    to fail and answers with the error it got; on RolloutRequested 66, has rank 1 killed in
    the middle of a call, and answers with what that call and the next one raised."""

    name = "ranked"

    @classmethod
    def resources(cls, config):  # type: ignore[no-untyped-def]
        return WorkerGroup(role="rollout", num_ranks=2, cpus_per_rank=0.5)

    async def start(self) -> None:
        self.workers = await self.context.start_workers(rank_probe, 2)

    async def stop(self) -> None:
        await close_workers(self.workers)

    @handles(EvalRequested, emits=(StopRequested,))
    async def on_eval(self, event: EvalRequested) -> None:
        for worker in self.workers:
            worker.notify(RankProbe.note, f"eval {event.rollout_id}")
            rank, pid, sharing, logs = await worker.call(RankProbe.where)
            notes = await worker.call(RankProbe.notes)
            await self.publish(
                StopRequested(reason=f"{rank}:{pid}:{sharing}:{os.getpid()}:{'|'.join(notes)}:{logs}")
            )

    @handles(RolloutRequested, emits=(StopRequested,))
    async def on_rollout(self, event: RolloutRequested) -> None:
        if event.rollout_id == 66:
            for method in (RankProbe.die, RankProbe.notes):
                try:
                    await self.workers[1].call(method)
                except RankDied as error:
                    await self.publish(StopRequested(reason=f"RankDied: {error}"))
            return
        try:
            await self.workers[1].call(RankProbe.fail)
        except KeyError as error:
            await self.publish(StopRequested(reason=f"KeyError: {error.args[0]}"))
