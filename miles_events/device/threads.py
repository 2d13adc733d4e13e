"""torch's intra-op threads, set per phase: the actor that is working gets the cores.

In the synchronous loop the Generator and the Trainer take turns: while one generates or
trains, the other waits for it. One fixed thread count per actor leaves a core idle in
every phase (one thread each) or has two pools contend on the same cores (all threads
each). Instead each phase (a rollout, an eval, a training step) runs with its configured
count (0: every core this process may run on) and gives it back when it ends.

The count is fixed for a machine (its cores), never taken from the load: results depend on
the thread count in the last bits, and a resumed run must reproduce an uninterrupted one
bitwise. On a machine that other busy processes share, OpenMP's barriers wait for preempted
threads (two threads with OpenMP's default spin can be slower than one there), so
``python -m miles_events.run`` lets waiting threads spin only briefly (``GOMP_SPINCOUNT``,
unless set), and ``num_threads = 1`` is the setting for such a machine.

The count is set in the thread that computes (torch keeps OpenMP's setting per calling
thread once that thread has computed) and restored when the phase ends. Phases that
overlap in one process (none do in the synchronous loop) may see each other's setting.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


def available_cpus() -> int:
    """The cores this process may run on (its affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def phase_thread_count(configured: int, sharers: int = 1) -> int:
    """Threads for a phase: ``configured``, or (when it is 0) the available cores shared
    evenly by ``sharers`` phases that run together (engines of one process), at least one."""
    return configured if configured > 0 else max(1, available_cpus() // max(1, sharers))


@contextmanager
def phase_threads(configured: int, sharers: int = 1) -> Iterator[int]:
    """Run the block, in this thread, with ``phase_thread_count(configured, sharers)`` torch threads."""
    import torch

    threads = phase_thread_count(configured, sharers)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(previous)
