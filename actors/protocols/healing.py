"""Healing's rules, the same for every cell (``run.ft_components``): the cells' names (as
miles names them), how many restarts a cell gets and how long each waits, and the signal
each injected fault sends. Pure: what the Generator and the Trainer do with them is theirs.
"""

from __future__ import annotations

import os
import signal

from schemas.config import ControlConfig, restart_backoff
from schemas.events import FaultMode

FAULT_SIGNALS: dict[FaultMode, signal.Signals] = {
    "sigkill": signal.SIGKILL,
    "exit": signal.SIGTERM,
    "segfault": signal.SIGSEGV,
    "deadlock": signal.SIGSTOP,
}
"""The signal each ``inject-fault`` mode sends: ``exit`` asks the process to end (SIGTERM),
``deadlock`` freezes it where it is (SIGSTOP: it holds what it holds and answers nothing)."""


def rollout_cell(index: int) -> str:
    """Engine ``index``'s cell: ``rollout-{index}`` (miles' name)."""
    return f"rollout-{index}"


def actor_cell(rank: int) -> str:
    """Trainer rank ``rank``'s cell: ``actor-{rank}`` (miles' name)."""
    return f"actor-{rank}"


def is_actor_cell(cell: str) -> bool:
    """Whether ``cell`` is a trainer rank's."""
    return cell.startswith("actor-")


__all__ = [
    "FAULT_SIGNALS",
    "RestartsSpent",
    "actor_cell",
    "check_restart",
    "deliver_fault",
    "is_actor_cell",
    "restart_backoff",
    "rollout_cell",
]


class RestartsSpent(RuntimeError):
    """A cell failed once more than ``control.max_restarts`` allows: the run fails."""


def check_restart(what: str, restarts: int, control: ControlConfig, failure: str) -> int:
    """The number of the restart a failure of ``what`` (a cell, named for the run's log)
    asks for, after ``restarts`` of it; ``RestartsSpent`` past the limit."""
    attempt = restarts + 1
    if attempt > control.max_restarts:
        raise RestartsSpent(
            f"{what} failed again after {restarts} restarts "
            f"(control.max_restarts = {control.max_restarts}): {failure}"
        )
    return attempt


def deliver_fault(cell: str, pids: list[int], sub_index: int, mode: FaultMode) -> tuple[int, str]:
    """Send fault ``mode``'s signal to process ``sub_index`` of ``cell`` (its processes
    ``pids``); returns the pid signalled (0 for none) and why it was not ("" when it was).
    A process shared with the calling actor is never signalled."""
    if sub_index >= len(pids):
        return 0, f"{cell}: sub_index {sub_index} out of range ({len(pids)} processes)"
    pid = pids[sub_index]
    if pid == os.getpid():
        return pid, f"{cell}: it runs in its actor's own process"
    try:
        os.kill(pid, FAULT_SIGNALS[mode])
    except ProcessLookupError:
        return pid, f"{cell}: process {pid} is gone"
    return pid, ""
