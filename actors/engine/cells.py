"""The Generator's engines as cells that heal (``run.ft_components = ["rollout"]``).

A cell is one engine (``rollout-{i}``, as miles names them) and the state the Generator
keeps of it: whether it runs, is being restarted or is suspended, how often it was
restarted, its processes (where a fault is injected) and its health checks. What the
Generator does with a cell that failed, and when, is here as plain functions of that
state; the calls themselves (start a rank, load the weights) are the Generator's.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from actors.protocols.healing import rollout_cell


class CellState(enum.Enum):
    RUNNING = "running"
    FAILED = "failed"
    """Died or hung, stopped, and not restarted yet."""
    SUSPENDED = "suspended"
    RESUMING = "resuming"
    """Starting again after a suspension."""


@dataclass
class EngineCell:
    """What the Generator knows of one engine beyond its worker."""

    index: int
    engine: str
    state: CellState = CellState.RUNNING
    restarts: int = 0
    pids: list[int] = field(default_factory=list)
    health_url: str | None = None
    failed_checks: int = 0
    healthy: bool = True
    failure: str = ""
    """Why it failed last."""
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by each generation on the engine: a stand-in's work waits for its own."""

    @property
    def name(self) -> str:
        return rollout_cell(self.index)

    @property
    def suspended(self) -> bool:
        """Whether it is suspended now (read again after each wait: another task may suspend it)."""
        return self.state is CellState.SUSPENDED


def stand_in(cells: list[EngineCell], index: int) -> int | None:
    """The running engine that samples for suspended engine ``index`` (the next running one
    after it, round the ring); None when none runs."""
    for step in range(1, len(cells) + 1):
        candidate = cells[(index + step) % len(cells)]
        if candidate.state is not CellState.SUSPENDED:
            return candidate.index
    return None
