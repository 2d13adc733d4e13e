"""Re-drive an actor from a recorded event log and compare its decisions with the record.

The actor gets, in log order, every recorded event of a type it handles; what it publishes
is compared with what it published in the recorded run (events from its ``source`` whose
types it does not itself handle). Header fields (``run_id``, ``seq``, ``time``, ``source``),
measured durations (fields ending in ``_seconds``) and an event's ``advisory_fields`` (how
to schedule, not what happens) are not decisions and are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from actors.coordinator import Coordinator
from actors.publisher import Publisher
from actors.verifier import Verifier
from miles_events.bus.actor import Actor
from miles_events.bus.testing import RecordingContext
from schemas.config import Config
from schemas.events import Event, RunStarted, plan_of

HEADER = ("run_id", "seq", "time", "source")


def decision(event: Event) -> tuple[str, dict[str, Any]]:
    """What an event decides: its type and its fields, without header, timings and advice."""
    fields = msgspec.structs.asdict(event)
    ignored = (*HEADER, *event.advisory_fields)
    body = {k: v for k, v in fields.items() if k not in ignored and not k.endswith("_seconds")}
    return type(event).__name__, msgspec.to_builtins(body)


@dataclass(frozen=True)
class RedriveResult:
    actor: str
    inputs: int
    expected: list[tuple[str, dict[str, Any]]]
    produced: list[tuple[str, dict[str, Any]]]

    @property
    def matches(self) -> bool:
        return self.expected == self.produced

    def first_difference(self) -> str:
        for index, (want, got) in enumerate(zip(self.expected, self.produced, strict=False)):
            if want != got:
                return f"decision {index}: recorded {want[0]} {want[1]}, re-driven {got[0]} {got[1]}"
        if len(self.expected) != len(self.produced):
            return f"recorded {len(self.expected)} decisions, re-driven {len(self.produced)}"
        return ""


async def redrive(actor: Actor, recorded: Sequence[Event], name: str | None = None) -> RedriveResult:
    """Feed ``actor`` its inputs from ``recorded``; compare its outputs with the record."""
    name = name or actor.name
    handled = tuple(actor.handlers())
    context = actor.context
    assert isinstance(context, RecordingContext), "build the actor with a RecordingContext"
    inputs = [e for e in recorded if isinstance(e, handled)]
    for event in inputs:
        await actor.handle(event)
    expected = [decision(e) for e in recorded if e.source == name and not isinstance(e, handled)]
    produced = [decision(e) for e in context.published if not isinstance(e, handled)]
    return RedriveResult(actor=name, inputs=len(inputs), expected=expected, produced=produced)


# Actors that can be re-driven from a log, by name.
REDRIVABLE: dict[str, type[Actor]] = {cls.name: cls for cls in (Coordinator, Verifier, Publisher)}


def split_runs(recorded: Iterable[Event]) -> dict[str, list[Event]]:
    """A log appended to by several runs (a resumed run continues the same log), by run id."""
    runs: dict[str, list[Event]] = {}
    for event in recorded:
        runs.setdefault(event.run_id, []).append(event)
    return runs


def config_differences(recorded: Config, used: Config) -> list[tuple[str, Any, Any]]:
    """The keys (dotted, in the config's order) whose values differ, each with the recorded
    value and the one used (None: unset)."""
    before, after = _flatten(recorded), _flatten(used)
    return [(key, before[key], after[key]) for key in before if before[key] != after[key]]


def _flatten(table: msgspec.Struct, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name in table.__struct_fields__:
        value = getattr(table, name)
        if isinstance(value, msgspec.Struct):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[prefix + name] = msgspec.to_builtins(value)
    return flat


def build_actor(name: str, config: Config, recorded: Sequence[Event], run_dir: Path | None = None) -> Actor:
    """The actor ``name`` as it was at the start of the recorded run; ``run_dir`` is where
    the run's files (the checksum manifests the Verifier reads) lie, by default the current
    directory."""
    if name not in REDRIVABLE:
        raise ValueError(f"cannot re-drive {name!r}; choose from {sorted(REDRIVABLE)}")
    started = next((e for e in recorded if isinstance(e, RunStarted)), None)
    if started is None:
        raise ValueError("the log has no RunStarted: cannot rebuild the run's plan")
    context = RecordingContext(
        config, name=name, run_dir=Path(run_dir) if run_dir is not None else Path("."), plan=plan_of(started)
    )
    return REDRIVABLE[name](config, context)
