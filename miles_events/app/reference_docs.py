"""Generate the config and events references in ``docs/`` from the schemas.

    python -m miles_events.app.reference_docs          # rewrite docs/config.md, docs/events.md
    python -m miles_events.app.reference_docs --check  # exit 1 if they are out of date

Field descriptions are the attribute docstrings in ``schemas/`` (read with ``ast``), types
and defaults come from the Structs themselves, so the references cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import typing
from pathlib import Path

import msgspec

from schemas import config as config_module
from schemas import events as events_module
from schemas.config import Config
from schemas.events import EVENT_TYPES, Event

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
        body = tree.body[0].body  # type: ignore[attr-defined]
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
        value = field.default_factory()  # type: ignore[misc]
    if isinstance(value, msgspec.Struct):
        return "(section)"
    return "unset" if value is None else repr(value).replace("'", '"')


def _rows(cls: type, skip: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, include_extras=False)
    rows = []
    for field in msgspec.structs.fields(cls):
        if field.name in skip:
            continue
        doc = docs.get(field.name, "")
        rows.append(f"| `{field.name}` | `{type_name(hints[field.name])}` | `{default_text(field)}` | {doc} |")
    return rows


def config_reference() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from `schemas/config.py` by `python -m miles_events.app.reference_docs`; a test",
        "checks it is current. Every section is strict: an unknown key or a wrong type stops",
        "the run with one line naming the key path. Relative paths are resolved against the",
        "directory of the config file. Override any key with `--set section.key=value`.",
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
    for cls in EVENT_TYPES:
        lines += [f"## `{cls.__name__}`", ""]
        if cls.__doc__:
            lines += [inspect.cleandoc(cls.__doc__), ""]
        rows = _rows(cls, skip=header)
        if rows:
            lines += ["| field | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines) + "\n"


def generated() -> dict[Path, str]:
    return {DOCS / "config.md": config_reference(), DOCS / "events.md": events_reference()}


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
