"""Worker-group ranks hosted in the actor's process (the local runtime, and actors on the
driver): every rank built here at once, calls off the event loop, a failed start closes
the ranks that started."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from miles_events.bus.workers import RankPlace, close_workers, start_in_process
from miles_events.transport.inprocess import InProcessTransport
from schemas.config import Config

closed: list[int] = []


class Rank:
    def __init__(self, place: RankPlace) -> None:
        self.place = place
        self.built_on = threading.get_ident()
        self.notes: list[str] = []

    def thread(self) -> int:
        return threading.get_ident()

    def block(self, released: threading.Event) -> None:
        released.wait(30)

    def where(self) -> tuple[int, int, str]:
        return self.place.rank, self.place.ranks_sharing_cores, threading.current_thread().name

    def add(self, a: int, b: int = 0, *, times: int = 1) -> int:
        return (a + b) * times

    def note(self, text: str) -> None:
        self.notes.append(text)

    def close(self) -> None:
        closed.append(self.place.rank)


def build(config: Config, transport: InProcessTransport, place: RankPlace) -> Rank:
    if place.rank == 2:
        raise OSError("rank 2 cannot start")
    return Rank(place)


async def test_every_rank_runs_in_this_process_and_its_calls_off_the_event_loop(tmp_path: Path) -> None:
    workers = await start_in_process(build, 2, Config(), InProcessTransport("w"), tmp_path)
    answers = [await w.call(Rank.where) for w in workers]
    assert [(rank, sharing) for rank, sharing, _ in answers] == [(0, 2), (1, 2)], (
        "both ranks share the process"
    )
    assert all(thread != threading.current_thread().name for _, _, thread in answers)


async def test_a_rank_that_cannot_start_fails_the_start_and_the_others_are_closed(tmp_path: Path) -> None:
    closed.clear()
    with pytest.raises(OSError, match="rank 2 cannot start"):
        await start_in_process(build, 3, Config(), InProcessTransport("w"), tmp_path)
    assert sorted(closed) == [0, 1]


async def test_a_rank_is_built_and_called_on_one_thread_of_its_own(tmp_path: Path) -> None:
    """As a rank in a process of its own: all of one rank's work on one thread, so what it
    allocates stays in one glibc arena rather than one per thread of a pool."""
    workers = await start_in_process(build, 2, Config(), InProcessTransport("w"), tmp_path)
    try:
        threads = [{await w.call(Rank.thread) for _ in range(20)} for w in workers]
        assert [len(t) for t in threads] == [1, 1]
        assert threads[0] != threads[1] and threading.get_ident() not in threads[0] | threads[1]
        assert [next(iter(t)) for t in threads] == [w.target.built_on for w in workers]  # type: ignore[attr-defined]
    finally:
        for worker in workers:
            await worker.close()


async def test_closing_a_rank_does_not_wait_behind_a_stuck_call(tmp_path: Path) -> None:
    """A handler cancelled at shutdown leaves its call running on the rank's thread: the
    rank's close still runs at once."""
    closed.clear()
    (worker,) = await start_in_process(build, 1, Config(), InProcessTransport("w"), tmp_path)
    released = threading.Event()
    stuck = asyncio.ensure_future(worker.call(Rank.block, released))
    await asyncio.sleep(0.1)
    try:
        await asyncio.wait_for(worker.close(), 5)
        assert closed == [0]
    finally:
        released.set()
        await stuck


async def test_a_rank_is_called_with_its_classs_method_and_keyword_arguments(tmp_path: Path) -> None:
    workers = await start_in_process(build, 2, Config(), InProcessTransport("w"), tmp_path)
    try:
        assert [await w.call(Rank.add, 2, b=3, times=w.rank + 1) for w in workers] == [5, 10]
        workers[1].notify(Rank.note, "stop")
        assert [w.target.notes for w in workers] == [[], ["stop"]]  # type: ignore[attr-defined]
    finally:
        await close_workers(workers)


async def test_a_method_bound_to_another_object_is_refused(tmp_path: Path) -> None:
    (worker,) = await start_in_process(build, 1, Config(), InProcessTransport("w"), tmp_path)
    try:
        elsewhere = Rank(RankPlace(5, 1, tmp_path))
        with pytest.raises(TypeError, match=r"its class's function \(Rank.method\)"):
            await worker.call(elsewhere.where)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"its class's function"):
            worker.notify(lambda rank: None)
    finally:
        await close_workers([worker])
