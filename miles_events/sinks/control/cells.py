"""What the control server says of each cell, folded from the run's events.

A cell is an engine (``rollout-{i}``) or a trainer rank (``actor-{i}``) of a component the
run heals (``run.ft_components``). Its phase and conditions follow the facts the actors
publish (``CellFailed``, ``CellRestarted``, ``CellSuspended``, ``CellResumed``,
``CellHealth``); ``spec.suspend`` is what was last asked for.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from miles_events.sinks.control.models import (
    CELL_INDEX_LABEL,
    CELL_TYPE_LABEL,
    Cell,
    CellPhase,
    CellSpec,
    CellStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    ObjectMeta,
)
from schemas.config import Config

CELL_TYPES = {"rollout": "rollout", "train": "actor"}
"""The cell type of each component of ``run.ft_components`` (miles' names)."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class CellRecord:
    cell_type: str
    index: int
    phase: CellPhase = "Pending"
    suspend: bool = False
    conditions: dict[ConditionType, Condition] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.cell_type}-{self.index}"

    def condition(self, kind: ConditionType, status: ConditionStatus, reason: str, message: str = "") -> None:
        """Set a condition; its transition time moves only when its status changes."""
        old = self.conditions.get(kind)
        moved = old is None or old.status != status
        self.conditions[kind] = Condition(
            type=kind,
            status=status,
            reason=reason,
            message=message or None,
            lastTransitionTime=_now() if moved or old is None else old.lastTransitionTime,
        )

    def render(self) -> Cell:
        return Cell(
            metadata=ObjectMeta(
                name=self.name, labels={CELL_TYPE_LABEL: self.cell_type, CELL_INDEX_LABEL: str(self.index)}
            ),
            spec=CellSpec(suspend=self.suspend),
            status=CellStatus(
                phase=self.phase,
                conditions=[self.conditions[k] for k in ("Allocated", "Healthy") if k in self.conditions],
            ),
        )


class CellBook:
    """Every cell of the run, by name, in miles' order (trainer ranks, then engines)."""

    def __init__(self, config: Config) -> None:
        sizes = {"train": config.trainer.num_ranks, "rollout": config.generator.num_engines}
        self.cells: dict[str, CellRecord] = {}
        for component in ("train", "rollout"):
            if component in config.run.ft_components:
                for index in range(sizes[component]):
                    record = CellRecord(CELL_TYPES[component], index)
                    record.condition("Allocated", "False", "Starting")
                    record.condition("Healthy", "Unknown", "Starting")
                    self.cells[record.name] = record

    def get(self, name: str) -> CellRecord | None:
        return self.cells.get(name)

    def started(self) -> None:
        """Every actor started (``RunStarted``): each cell runs and answered its start."""
        for record in self.cells.values():
            if record.phase == "Pending":
                record.phase = "Running"
                record.condition("Allocated", "True", "Started")
                record.condition("Healthy", "True", "Started")

    def failed(self, name: str, reason: str, hung: bool) -> None:
        if (record := self.cells.get(name)) is not None:
            record.phase = "Pending"
            record.condition("Allocated", "False", "Restarting", reason)
            # Its actor restarts it: neither healthy nor for a controller to heal meanwhile.
            record.condition("Healthy", "Unknown", "Hung" if hung else "Died", reason)

    def running(self, name: str, reason: str) -> None:
        if (record := self.cells.get(name)) is not None:
            record.phase = "Running"
            record.suspend = False
            record.condition("Allocated", "True", reason)
            record.condition("Healthy", "True", reason)

    def suspended(self, name: str) -> None:
        if (record := self.cells.get(name)) is not None:
            record.phase = "Suspended"
            record.suspend = True
            record.condition("Allocated", "False", "Suspended")
            record.condition("Healthy", "Unknown", "Suspended")

    def resuming(self, name: str) -> None:
        """A resume was asked for: the cell starts again (Pending, its health unknown) until
        ``CellResumed``."""
        if (record := self.cells.get(name)) is not None:
            record.phase = "Pending"
            record.suspend = False
            record.condition("Allocated", "False", "Resuming")
            record.condition("Healthy", "Unknown", "Resuming")

    def health(self, name: str, healthy: bool, reason: str) -> None:
        record = self.cells.get(name)
        if record is not None and record.phase == "Running":
            if healthy:
                record.condition("Healthy", "True", "HealthCheckPassed")
            else:
                # As miles' checker: a missed check below the limit keeps the status and
                # says why; past the limit the cell is failed (and restarted).
                status = record.conditions["Healthy"].status if "Healthy" in record.conditions else "Unknown"
                record.condition("Healthy", status, "HealthCheckFailed", reason)

    def running_of_type(self, cell_type: str) -> list[CellRecord]:
        return [r for r in self.cells.values() if r.cell_type == cell_type and not r.suspend]
