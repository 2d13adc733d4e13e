"""Worker-group ranks hosted in the actor's process (the local runtime, and actors on the
driver): every rank built here at once, calls off the event loop, a failed start closes
the ranks that started; with ``own_processes``, ranks 1.. in spawned processes that never
hang their actor and never outlive it."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from miles_events.bus.rank_process import STOP_GRACE
from miles_events.bus.workers import (
    RankDied,
    RankFailed,
    RankPlace,
    Worker,
    brief_error,
    call_all,
    call_each,
    close_workers,
    start_in_process,
)
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


# Ranks in processes of their own (``own_processes``): spawned where they would be threads.


class Spawned:
    """A rank for ``own_processes``: its process's spawn imports this module to build it."""

    def __init__(self, place: RankPlace) -> None:
        self.place = place
        self.released = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def add(self, a: int, b: int = 0, *, times: int = 1) -> int:
        return (a + b) * times

    def fail(self) -> None:
        raise KeyError(f"rank {self.place.rank} was asked to fail")

    def fail_on(self, rank: int, data: bytes = b"") -> int:
        if self.place.rank == rank:
            raise ValueError(f"rank {rank} failed")
        return self.place.rank

    def exit_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os._exit(3)

    def wait(self, seconds: float) -> bool:
        """Until ``release``, or ``seconds``: whether it was released."""
        return self.released.wait(seconds)

    def release(self) -> None:
        self.released.set()

    def start_a_process(self) -> int | None:
        child = multiprocessing.get_context("spawn").Process(target=os.getpid)
        child.start()
        child.join(30)
        return child.exitcode

    def log(self, text: str) -> None:
        logging.getLogger("tests.rank").warning("%s", text)

    def close(self) -> None:
        (self.place.run_dir / f"rank-{self.place.rank}.closed").write_text(str(os.getpid()))
        if (self.place.run_dir / "hang-on-close").exists():
            time.sleep(60)


def build_spawned(config: Config, transport: InProcessTransport, place: RankPlace) -> Spawned:
    if (place.run_dir / f"rank-{place.rank}.fails").exists():
        raise OSError(f"rank {place.rank} cannot start")
    if (place.run_dir / f"rank-{place.rank}.slow").exists():
        time.sleep(60)
    return Spawned(place)


async def start_spawned(run_dir: Path, ranks: int = 2, **options: Any) -> list[Worker[Spawned]]:
    return await start_in_process(
        build_spawned,
        ranks,
        Config(),
        InProcessTransport("w"),
        run_dir,
        own_processes=True,
        actor="test",
        **options,
    )


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return False


async def test_with_own_processes_rank_0_stays_here_and_every_other_rank_has_a_process_of_its_own(
    tmp_path: Path,
) -> None:
    workers = await start_spawned(tmp_path, 3)
    try:
        pids = [await w.call(Spawned.pid) for w in workers]
        assert pids[0] == workers[0].pid == os.getpid()
        assert pids[1:] == [w.pid for w in workers[1:]]
        assert len({os.getpid(), *pids}) == 3, "ranks 1 and 2 each run in a process of their own"
    finally:
        await close_workers(workers)
    assert [(tmp_path / f"rank-{r}.closed").read_text() for r in range(3)] == [str(p) for p in pids]
    assert not any(running(pid) for pid in pids[1:])


async def test_a_spawned_ranks_results_and_exceptions_cross_as_they_were(tmp_path: Path) -> None:
    workers = await start_spawned(tmp_path)
    try:
        assert await workers[1].call(Spawned.add, 2, b=3, times=2) == 10
        with pytest.raises(KeyError, match="rank 1 was asked to fail") as raised:
            await workers[1].call(Spawned.fail)
        assert "test_workers.py" in str(raised.value.__cause__), "the rank's traceback is its cause"
    finally:
        await close_workers(workers)


async def test_a_spawned_rank_may_start_processes_of_its_own(tmp_path: Path) -> None:
    """Its process is ended with its actor's, as a daemon's, yet it is no daemon to itself:
    a rank's libraries start processes (data loaders, compilers)."""
    workers = await start_spawned(tmp_path)
    try:
        assert await workers[1].call(Spawned.start_a_process) == 0
    finally:
        await close_workers(workers)


async def test_a_notification_runs_while_a_call_of_the_same_spawned_rank_is_blocked(tmp_path: Path) -> None:
    workers = await start_spawned(tmp_path)
    try:
        waiting = asyncio.ensure_future(workers[1].call(Spawned.wait, 30))
        await asyncio.sleep(0.2)
        workers[1].notify(Spawned.release)
        assert await asyncio.wait_for(waiting, 5) is True
    finally:
        await close_workers(workers)


async def test_a_rank_killed_mid_call_fails_that_call_and_every_later_one_at_once(tmp_path: Path) -> None:
    workers = await start_spawned(tmp_path)
    rank = workers[1]
    try:
        waiting = asyncio.ensure_future(rank.call(Spawned.wait, 60))
        await asyncio.sleep(0.2)
        os.kill(rank.pid, signal.SIGKILL)
        message = rf"^test rank 1 \(pid {rank.pid}\) died: killed by SIGKILL$"
        with pytest.raises(RankDied, match=message):
            await asyncio.wait_for(waiting, 2)
        with pytest.raises(RankDied, match=message):
            await asyncio.wait_for(rank.call(Spawned.pid), 1)
        rank.notify(Spawned.release)  # nothing to tell: no error
    finally:
        await close_workers(workers)


async def test_calling_every_rank_raises_the_first_failure_without_waiting_for_the_others(
    tmp_path: Path,
) -> None:
    """Rank 0 is stuck (as in a collective, waiting for the rank that failed): the failure
    of rank 1 is raised at once, naming it."""
    workers = await start_spawned(tmp_path)
    try:
        assert await call_each(workers, lambda w: w.call(Spawned.add, w.rank, times=10)) == [0, 10]
        assert await call_all(workers, Spawned.fail_on, 5) == [0, 1]
        stuck = asyncio.ensure_future(workers[0].call(Spawned.wait, 30))
        message = (
            rf"^rank 1 \(pid {workers[1].pid}\): ValueError: rank 1 failed; "
            rf"still in the call: rank 0 \(pid {workers[0].pid}\)$"
        )
        with pytest.raises(RankFailed, match=message) as raised:
            await asyncio.wait_for(
                call_each(
                    workers, lambda w: w.call(Spawned.wait, 30) if w.rank == 0 else w.call(Spawned.fail_on, 1)
                ),
                5,
            )
        assert isinstance(raised.value.__cause__, ValueError)
        assert not stuck.done()
    finally:
        workers[0].notify(Spawned.release)
        await close_workers(workers)


def resume_later(pid: int, seconds: float) -> threading.Event:
    """Sends ``pid`` SIGCONT after ``seconds`` (a test that would hang on a stopped rank
    fails instead): the event is set once it was sent."""
    resumed = threading.Event()

    def resume() -> None:
        time.sleep(seconds)
        resumed.set()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    threading.Thread(target=resume, daemon=True).start()
    return resumed


async def test_a_call_too_large_for_the_pipe_to_a_stopped_rank_never_blocks_the_event_loop(
    tmp_path: Path,
) -> None:
    """Rank 1's process is stopped (SIGSTOP) and reads nothing: sending it more than its
    pipe holds waits off the event loop, so rank 0's failure (as a collective's timeout)
    is raised naming rank 1 as still in the call, and closing the group ends rank 1."""
    workers = await start_spawned(tmp_path)
    stopped = workers[1].pid
    os.kill(stopped, signal.SIGSTOP)
    resumed = resume_later(stopped, 20)
    try:
        message = rf"^rank 0 .*ValueError: rank 0 failed; still in the call: rank 1 \(pid {stopped}\)$"
        with pytest.raises(RankFailed, match=message):
            await asyncio.wait_for(call_all(workers, Spawned.fail_on, 0, b"x" * (32 << 20)), 15)
        await close_workers(workers, 1)
        assert not resumed.is_set(), "the event loop waited for the stopped rank"
    finally:
        await close_workers(workers, 1)
    assert not running(stopped)


async def test_a_rank_that_does_not_return_within_the_straggler_bound_of_the_first_fails_the_call(
    tmp_path: Path,
) -> None:
    """A call without a collective (nothing times out in a rank): once rank 0 returned,
    rank 1, stopped, is given ``straggler_timeout`` seconds and is then named."""
    workers = await start_spawned(tmp_path)
    stopped = workers[1].pid
    os.kill(stopped, signal.SIGSTOP)
    resumed = resume_later(stopped, 20)
    try:
        message = (
            rf"^rank 1 \(pid {stopped}\): TimeoutError: did not return within 0.5s of rank 0; "
            rf"still in the call: rank 1 \(pid {stopped}\)$"
        )
        with pytest.raises(RankFailed, match=message):
            await call_each(workers, lambda w: w.call(Spawned.pid), straggler_timeout=0.5)
        assert not resumed.is_set()
    finally:
        await close_workers(workers, 1)
    assert not running(stopped)


async def test_a_failure_that_a_ranks_death_causes_is_reported_as_that_death(tmp_path: Path) -> None:
    """Rank 1 dies; rank 0's collective fails first (here: it fails at once): the death is
    what is reported, naming rank 1."""
    workers = await start_spawned(tmp_path)
    try:
        with pytest.raises(RankDied, match=rf"^test rank 1 \(pid {workers[1].pid}\) died: exit code 3$"):
            await call_each(
                workers, lambda w: w.call(Spawned.fail) if w.rank == 0 else w.call(Spawned.exit_after, 0.3)
            )
    finally:
        await close_workers(workers)


async def test_a_spawned_rank_that_cannot_start_fails_the_start_naming_it_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    (tmp_path / "rank-2.fails").touch()
    with pytest.raises(RuntimeError, match=r"^test rank 2 failed to start: OSError: rank 2 cannot start$"):
        await start_spawned(tmp_path, 3)
    assert (tmp_path / "rank-0.closed").exists() and (tmp_path / "rank-1.closed").exists(), (
        "the ranks that started are closed"
    )
    assert multiprocessing.active_children() == []


async def test_a_spawned_rank_that_does_not_start_in_time_fails_the_start_and_is_killed(
    tmp_path: Path,
) -> None:
    (tmp_path / "rank-1.slow").touch()
    unheard: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unheard.append(context))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^test rank 1 \(pid \d+\) did not start within 2s$"):
        await start_spawned(tmp_path, start_timeout=2)
    assert time.monotonic() - started < 15
    assert multiprocessing.active_children() == []
    await asyncio.sleep(0.2)
    gc.collect()
    assert unheard == [], "no error is left for nobody to hear"


async def test_closing_a_spawned_rank_does_not_wait_behind_a_stuck_call(tmp_path: Path) -> None:
    workers = await start_spawned(tmp_path)
    rank = workers[1]
    stuck = asyncio.ensure_future(rank.call(Spawned.wait, 60))
    await asyncio.sleep(0.2)
    await asyncio.wait_for(close_workers(workers), 5)
    assert (tmp_path / "rank-1.closed").read_text() == str(rank.pid)
    assert not running(rank.pid)
    with pytest.raises(RankDied, match=rf"^test rank 1 \(pid {rank.pid}\) was closed$"):
        await stuck


async def test_a_spawned_rank_whose_close_hangs_is_terminated_after_its_bound(tmp_path: Path) -> None:
    (tmp_path / "hang-on-close").touch()
    workers = await start_spawned(tmp_path)
    started = time.monotonic()
    await asyncio.wait_for(workers[1].close(timeout=0.5), 10)
    assert time.monotonic() - started < 5
    assert (tmp_path / "rank-1.closed").exists() and not running(workers[1].pid)
    (tmp_path / "hang-on-close").unlink()
    await workers[0].close()


async def test_a_stopped_rank_that_misses_its_close_bound_ends_at_its_sigterm(tmp_path: Path) -> None:
    """A stopped process acts on SIGTERM only once continued: it is continued with it, so it
    ends then, without sitting out the grace after the SIGTERM until it is killed."""
    workers = await start_spawned(tmp_path)
    stopped = workers[1].pid
    os.kill(stopped, signal.SIGSTOP)
    resume_later(stopped, 20)
    try:
        started = time.monotonic()
        await workers[1].close(timeout=0.5)
        assert time.monotonic() - started < 0.5 + STOP_GRACE
        assert not running(stopped)
    finally:
        await close_workers(workers, 1)


async def test_a_runs_spawned_ranks_log_into_its_log_naming_the_rank(tmp_path: Path) -> None:
    from miles_events.runtime.base import RunContext, host_context
    from miles_events.runtime.run_log import run_log_path
    from schemas.plan import RunPlan

    async def publish(event: object) -> None:
        pass

    plan = RunPlan(start_rollout_id=0, num_rollout=0, num_rollout_per_epoch=1)
    run = RunContext("log-run", Config(), tmp_path, "inprocess", plan)
    context = host_context(run, InProcessTransport("log-run"), "trainer", publish)
    workers = await context.start_workers(build_spawned, 2, own_processes=True)
    try:
        await workers[1].call(Spawned.log, "hello from rank 1")
    finally:
        await close_workers(workers)
    log = run_log_path(tmp_path).read_text()
    assert f"WARNING [trainer rank 1 pid {workers[1].pid}] tests.rank: hello from rank 1" in log, log


def test_a_brief_error_leaves_out_a_libraries_cxx_source_location() -> None:
    error = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    assert brief_error(error) == "RuntimeError: Connection closed by peer"
    assert brief_error(ValueError("[1, 2] is not a shape")) == "ValueError: [1, 2] is not a shape"
