"""Generate the config, events and metrics references and the control server's OpenAPI
document in ``docs/`` from the code.

    python -m miles_events.app.reference_docs          # rewrite docs/config.md, events.md, metrics.md,
                                                       # control-api.json
    python -m miles_events.app.reference_docs --check  # exit 1 if they are out of date

Field descriptions are the attribute docstrings in ``schemas/`` (read with ``ast``), types
and defaults come from the Structs themselves, so the references cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import typing
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import msgspec

from miles_events.app.roster import ACTORS, SINKS
from miles_events.sinks.metrics import metrics_reference
from schemas import config as config_module
from schemas import events as events_module
from schemas.config import Config
from schemas.events import (
    EVENT_TYPES,
    ActorFailed,
    CellFailed,
    CellHealing,
    CellHealth,
    CellSuspended,
    CellSuspendRequested,
    CheckpointRequested,
    Event,
    FaultInjected,
    FaultInjectionRequested,
    RunFinished,
    StopRequested,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after a field's annotation."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct):
            continue
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        definition = tree.body[0]
        if not isinstance(definition, ast.ClassDef):  # always one: the source of a class
            continue
        body = definition.body
        for node, following in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def type_name(annotation: object) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    for prefix in ("typing.", "schemas.config.", "schemas.events.", "schemas.data.", "schemas.checkpoint."):
        text = text.replace(prefix, "")
    text = text.replace("NoneType", "None")
    return text


def default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    else:
        value = field.default_factory()
    if isinstance(value, msgspec.Struct):
        return "(section)"
    return "unset" if value is None else repr(value).replace("'", '"')


def _rows(cls: type, skip: AbstractSet[str] = frozenset()) -> list[str]:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, include_extras=False)
    rows = []
    for field in msgspec.structs.fields(cls):
        if field.name in skip:
            continue
        doc = docs.get(field.name, "")
        rows.append(
            f"| `{field.name}` | `{type_name(hints[field.name])}` | `{default_text(field)}` | {doc} |"
        )
    return rows


def config_reference() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from `schemas/config.py` by `python -m miles_events.app.reference_docs`; a test",
        "checks it is current. Every section is strict: an unknown key or a wrong type stops",
        "the run with one line naming the key path. Relative paths are resolved against the",
        "directory of the config file; a path given with `--set` against the current directory.",
        "Override any key with `--set section.key=value`.",
        "A float must be finite: TOML's `nan`, `inf` and `-inf` are refused.",
        "",
    ]
    for field in msgspec.structs.fields(Config):
        section = typing.get_type_hints(Config)[field.name]
        lines += _section(f"[{field.name}]", section)
    return "\n".join(lines) + "\n"


def _section(title: str, section: type) -> list[str]:
    lines = [f"## `{title}`", ""]
    if section.__doc__:
        lines += [inspect.cleandoc(section.__doc__), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|", *_rows(section), ""]
    for field in msgspec.structs.fields(section):
        nested = typing.get_type_hints(section)[field.name]
        if isinstance(nested, type) and issubclass(nested, msgspec.Struct):
            lines += _section(f"{title[1:-1]}.{field.name}".join("[]"), nested)
    return lines


def events_reference() -> str:
    header = {f.name for f in msgspec.structs.fields(Event)}
    lines = [
        "# Events reference",
        "",
        "Generated from `schemas/events.py` by `python -m miles_events.app.reference_docs`; a test",
        "checks it is current. Every event is a frozen msgspec Struct in one tagged union; on the",
        'wire and in the event log it is msgpack with its class name under `"type"`.',
        "",
        "Every event also carries the header: "
        + ", ".join(f"`{name}`" for name in ("run_id", "seq", "time", "source"))
        + " (`seq` is stamped by the bus and strictly increases).",
        "",
    ]
    routes = event_routes()
    for cls in EVENT_TYPES:
        lines += [f"## `{cls.__name__}`", ""]
        if cls.__doc__:
            lines += [inspect.cleandoc(cls.__doc__), ""]
        emitted, handled = routes[cls]
        lines += [
            f"- emitted by: {', '.join(emitted) or '-'}",
            f"- handled by: {', '.join(handled) or '-'}",
            "",
        ]
        rows = _rows(cls, skip=header)
        if rows:
            lines += ["| field | type | default | meaning |", "|---|---|---|---|", *rows, ""]
        for nested in _nested_records(cls):
            lines += [f"`{nested.__name__}` (in `{cls.__name__}`):", ""]
            if nested.__doc__:
                lines += [inspect.cleandoc(nested.__doc__), ""]
            lines += ["| field | type | default | meaning |", "|---|---|---|---|", *_rows(nested), ""]
    return "\n".join(lines) + "\n"


def _nested_records(cls: type) -> list[type]:
    """Struct-typed fields of an event that are records of their own (not a DataRef), and
    the records of its list fields."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in msgspec.structs.fields(cls):
        hint = hints[field.name]
        if typing.get_origin(hint) is list:
            (hint,) = typing.get_args(hint)
        if (
            isinstance(hint, type)
            and issubclass(hint, msgspec.Struct)
            and hint.__module__ == "schemas.events"
        ):
            found.append(hint)
    return found


def event_routes() -> dict[type[Event], tuple[list[str], list[str]]]:
    """Event type -> (who emits it, who handles it), from the actors' ``@handles(emits=)``
    declarations and the sinks' handler tables. The framework's own events are named too:
    the host reports ``ActorFailed``, the session ``StopRequested`` (a signal) and
    ``RunFinished`` (a failed start, a dead event log)."""
    triggers: dict[type[Event], dict[str, list[str]]] = {cls: {} for cls in EVENT_TYPES}
    handled: dict[type[Event], list[str]] = {cls: [] for cls in EVENT_TYPES}
    for actor in ACTORS:
        for route in actor.routes():
            for event_type in route.emits or ():
                triggers[event_type].setdefault(actor.name, []).extend(
                    f"`{t.__name__}`" for t in route.handles
                )
            for event_type in route.handles:
                handled[event_type].append(actor.name)
        for event_type in actor.emits:
            triggers[event_type].setdefault(actor.name, []).append("`ready`, once every actor has started")
    emitted = {
        cls: [f"{name} (on {', '.join(dict.fromkeys(on))})" for name, on in by_actor.items()]
        for cls, by_actor in triggers.items()
    }
    emitted[ActorFailed].append("every actor's host (a handler raised, a process died)")
    emitted[StopRequested].append("the session (SIGINT, SIGTERM)")
    emitted[RunFinished].append(
        "the session (an actor or sink failed to start, the event log cannot be written, the coordinator failed)"
    )
    commands: list[tuple[type[Event], str]] = [
        (StopRequested, "`POST /api/v1/stop`"),
        (CheckpointRequested, "`POST /api/v1/save`"),
        (CellSuspendRequested, "`PATCH /api/v1/cells/{name}`"),
        (FaultInjectionRequested, "`POST /api/v1/cells/{name}/inject-fault`"),
    ]
    for command, path in commands:
        emitted[command].append(f"the control server (on {path})")
    emitted[CellHealing].append("the mini FT controller (each step of a heal)")
    beside: list[tuple[type[Event], str]] = [
        (CellHealth, "its health checks"),
        (CellFailed, "its health checks: an engine found dead or hung"),
        (CellSuspended, "a suspension, taken at once"),
        (FaultInjected, "a fault injection, delivered at once"),
    ]
    for fact, why in beside:
        emitted[fact].append(f"generator (beside its handlers: {why})")
    for sink in SINKS:
        kinds = sink.handlers()
        for cls in EVENT_TYPES:
            if any(issubclass(cls, k) for k in kinds):
                handled[cls].append(f"sink {sink.name}")
    for table in (emitted, handled):
        for cls, names in table.items():
            table[cls] = list(dict.fromkeys(names))
    return {cls: (emitted[cls], handled[cls]) for cls in EVENT_TYPES}


def control_api_document() -> dict[str, Any]:
    """The control server's OpenAPI document, as FastAPI makes it from its routes."""
    from miles_events.sinks.control.cells import CellBook
    from miles_events.sinks.control.server import build_app

    async def publish(event: Event) -> None:
        raise RuntimeError("the document is made without a bus")

    app = build_app(CellBook(Config()), publish, "", 1)
    document: dict[str, Any] = app.app.openapi()  # type: ignore[attr-defined]
    return document


def generated() -> dict[Path, str]:
    return {
        DOCS / "config.md": config_reference(),
        DOCS / "events.md": events_reference(),
        DOCS / "metrics.md": metrics_reference(),
        DOCS / "control-api.json": json.dumps(control_api_document(), indent=2, sort_keys=True) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_events.app.reference_docs")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = [path for path, text in generated().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path} (run python -m miles_events.app.reference_docs)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


# Keep the modules referenced so that their source is importable for ``ast``.
_ = (config_module, events_module)

if __name__ == "__main__":
    sys.exit(main())
