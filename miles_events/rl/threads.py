"""torch's intra-op threads, set per phase: the actor that is working gets the cores.

In the synchronous loop the Generator and the Trainer take turns: while one generates or
trains, the other waits for it. One fixed thread count per actor leaves a core idle in
every phase (one thread each) or has two pools contend on the same cores (all threads
each). Instead each phase (a rollout, an eval, a training step) runs with its configured
count (0: every core this process may run on) and gives it back when it ends.

A core that another process keeps busy is no core to take: OpenMP's barriers then wait for
preempted threads, and two threads on a loaded two-core machine measured 5-10x slower than
one. So the default count is the available cores less those other runnable tasks occupy at
the phase's start (``/proc/loadavg``), at least one; and ``python -m miles_events.run`` lets
waiting OpenMP threads spin only briefly (``GOMP_SPINCOUNT``, unless set), so a pool that
outlives its phase neither burns a core nor keeps it from the next phase.

The count is set in the thread that computes (torch keeps OpenMP's setting per calling
thread once that thread has computed) and restored when the phase ends. Phases that
overlap in one process (none do in the synchronous loop) may see each other's setting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def available_cpus() -> int:
    """The cores this process may run on (its affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _runnable() -> int | None:
    try:
        with open("/proc/loadavg") as loadavg:
            return int(loadavg.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def other_runnable_tasks(samples: int = 3, interval: float = 0.001) -> int:
    """Tasks runnable on the machine besides the caller (0 where that is unknown): the least
    of a few readings a millisecond apart, so that a task that runs only for an instant
    (the bus handing over the event that starts this phase) is not counted."""
    readings = []
    for sample in range(samples):
        if sample:
            time.sleep(interval)
        running = _runnable()
        if running is None:
            return 0
        readings.append(running)
    return max(0, min(readings) - 1)


def free_cpus() -> int:
    """The available cores that no other runnable task occupies now, at least one."""
    return max(1, available_cpus() - other_runnable_tasks())


def phase_thread_count(configured: int, sharers: int = 1) -> int:
    """Threads for a phase: ``configured``, or (when it is 0) the free cores shared evenly
    by ``sharers`` phases that run together (engines of one process), at least one."""
    return configured if configured > 0 else max(1, free_cpus() // max(1, sharers))


@contextmanager
def phase_threads(configured: int, sharers: int = 1) -> Iterator[int]:
    """Run the block, in this thread, with ``phase_thread_count(configured, sharers)`` torch threads."""
    threads = phase_thread_count(configured, sharers)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(previous)
