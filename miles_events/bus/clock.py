"""Time, injectable: every timeout of the framework (publication phases, the bus's stall
watchdog, shutdown) reads and waits on a ``Clock``, so a test advances a ``ManualClock``
instead of sleeping on the wall clock (as trio's ``MockClock``)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for durations and deadlines)."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (for event timestamps)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...


class SystemClock:
    """The real clocks of this process."""

    # The builtins themselves: no Python frame on the bus's stamping path.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told: ``advance(seconds)`` wakes every sleeper whose
    deadline has come, in deadline order."""

    def __init__(self, start: float = 0.0, epoch: float = 1_700_000_000.0) -> None:
        self._now = start
        self._epoch = epoch
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._epoch + self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        await future

    @property
    def sleepers(self) -> int:
        """Sleeps still waiting (cancelled ones excluded)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def advance(self, seconds: float) -> None:
        """Let tasks already started reach their sleeps, move the clock on, wake the
        sleepers due, and let them run."""
        for _ in range(2):
            await asyncio.sleep(0)
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)
        # Two turns of the loop: the woken sleepers run, and what they schedule starts.
        for _ in range(2):
            await asyncio.sleep(0)


async def wait_for(awaitable: Awaitable[T], timeout: float | None, clock: Clock) -> T:
    """``awaitable``'s result, or ``TimeoutError`` once ``timeout`` passed on ``clock``
    (the awaitable is cancelled then). ``None`` waits as long as it takes."""
    task = asyncio.ensure_future(awaitable)
    if timeout is None:
        return await task
    timer = asyncio.ensure_future(clock.sleep(timeout))
    try:
        await asyncio.wait((task, timer), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        timer.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise TimeoutError(f"timed out after {timeout:g}s")
