"""Fuzzing the input checks: whatever a config file, its ``--set`` overrides and its data
files hold, what ``python -m miles_events.run`` checks before it starts anything
(``preflight.load_and_check``) ends with a config, or with one of ``INPUT_ERRORS`` (the
CLI's exit 2) printed as one line, and writes nothing. Any other exception is a bug.

Configs are generated over the schema: a valid base with fields set to values of their
type (bounds and their neighbours, extremes, ``nan`` / ``inf``), of other types, unknown
keys and tables, through the file or ``--set``; sometimes the file is random text or bytes.
Data files are JSONL lines, good and bad (missing keys, bad JSON, deep nesting, huge
integers, invalid UTF-8), or random bytes.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_events.app.config import PATH_KEYS, dump_config, load_config_text
from miles_events.app.preflight import INPUT_ERRORS, load_and_check
from miles_events.app.run import error_line
from schemas.config import Config

# --- the schema --------------------------------------------------------------------------


def schema_fields(
    struct: type[msgspec.Struct], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, msgspec type) of every setting."""
    for field in msgspec.inspect.type_info(struct).fields:  # type: ignore[attr-defined]
        if isinstance(field.type, msgspec.inspect.StructType):
            yield from schema_fields(field.type.cls, (*prefix, field.name))
        else:
            yield (*prefix, field.name), field.type


FIELDS = list(schema_fields(Config))
SECTIONS = sorted({path[:-1] for path, _ in FIELDS})

# --- values ------------------------------------------------------------------------------

EXTREME_INTS = [0, 1, -1, 2, 3, 4, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30, -(10**30)]
EXTREME_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    1e-300,
    0.5,
    1.0,
    1e300,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
]

SCALARS = st.one_of(
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(EXTREME_INTS + EXTREME_FLOATS),
)
ANY_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=5,
)
"""A value of any TOML type: for wrong types and unknown keys."""

PATHS = st.one_of(
    st.sampled_from(
        ["prompts.jsonl", "eval.jsonl", "absent.jsonl", "", ".", "sub", "sub/", "/nonexistent/x", "~"]
    ),
    st.text(max_size=12),
)
REWARD_FNS = st.sampled_from(
    [
        "miles_events.rl.rewards.exact_match",
        "miles_events.rl.rewards:exact_match",
        "miles_events.rl.rewards.no_such_fn",
        "miles_events.rl.rewards",
        "miles_events.rl.rewards.",
        "no_such_module_for_fuzz.fn",
        ".relative.fn",
        "..",
        "a..b",
        "nodots",
        "",
        "miles_events.rl.prompts.DataError",
        "json.JSONDecodeError.msg",
        "x\x00y.fn",
    ]
)
"""Imported by ``validate``: a closed set, so that the fuzz imports nothing unknown."""


def _bounded(bounds: list[int | float], around: list[Any]) -> list[Any]:
    return around + [b + d for b in bounds for d in (-1, 0, 1)]


def typed(kind: Any) -> st.SearchStrategy[Any]:
    """Values of a msgspec type, inside and around its bounds."""
    if isinstance(kind, msgspec.inspect.BoolType):
        return st.booleans()
    if isinstance(kind, msgspec.inspect.IntType):
        bounds = [b for b in (kind.ge, kind.gt, kind.le, kind.lt) if b is not None]
        return st.one_of(st.integers(-5, 300), st.sampled_from(_bounded(bounds, EXTREME_INTS)))
    if isinstance(kind, msgspec.inspect.FloatType):
        bounds = [b for b in (kind.ge, kind.gt, kind.le, kind.lt) if b is not None]
        return st.one_of(st.floats(), st.sampled_from(_bounded(bounds, EXTREME_FLOATS)))
    if isinstance(kind, msgspec.inspect.StrType):
        return st.text(max_size=12)
    if isinstance(kind, msgspec.inspect.LiteralType):
        return st.one_of(st.sampled_from(list(kind.values)), st.text(max_size=8))
    if isinstance(kind, msgspec.inspect.ListType):
        return st.lists(typed(kind.item_type), max_size=3)
    if isinstance(kind, msgspec.inspect.UnionType):
        return st.one_of(*(typed(t) for t in kind.types if not isinstance(t, msgspec.inspect.NoneType)))
    return ANY_VALUE


def value_for(path: tuple[str, ...], kind: Any) -> st.SearchStrategy[Any]:
    if path in PATH_KEYS:
        return st.one_of(PATHS, ANY_VALUE)
    if path == ("rollout", "reward_fn"):
        return REWARD_FNS
    return st.one_of(typed(kind), typed(kind), typed(kind), ANY_VALUE)


# --- TOML ----------------------------------------------------------------------------------


def toml_string(text: str) -> str:
    escaped = (
        "\\\\"
        if c == "\\"
        else '\\"'
        if c == '"'
        else f"\\u{ord(c):04x}"
        if ord(c) < 0x20 or ord(c) == 0x7F
        else c
        for c in text
    )
    return '"' + "".join(escaped) + '"'


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(data: dict[str, Any]) -> str:
    lines: list[str] = []

    def table(values: dict[str, Any], name: list[str]) -> None:
        if name:
            lines.append("[" + ".".join(toml_key(n) for n in name) + "]")
        lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in values.items() if not isinstance(v, dict))
        for key, value in values.items():
            if isinstance(value, dict):
                table(value, [*name, key])

    table(data, [])
    return "\n".join(lines) + "\n"


# --- configs -------------------------------------------------------------------------------

BASE: dict[str, Any] = {
    "run": {"dir": "run", "runtime": "local", "num_rollout": 2},
    "data": {
        "prompt_data": "prompts.jsonl",
        "eval_data": "eval.jsonl",
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
    },
    "trainer": {"global_batch_size": 4, "micro_batch_size": 4},
}
"""Valid with good data files: the mutations start from here, so checks deep down are reached."""

SET_VALUE = st.sampled_from(FIELDS).flatmap(lambda field: st.tuples(st.just(field[0]), value_for(*field)))
UNSET = st.sampled_from([path for path, _ in FIELDS]).map(lambda path: (path, None))
UNKNOWN = st.tuples(
    st.one_of(st.sampled_from(SECTIONS), st.just(())).flatmap(
        lambda section: st.text(min_size=1, max_size=8).map(lambda key: (*section, key))
    ),
    ANY_VALUE,
)
MUTATION = st.one_of(SET_VALUE, SET_VALUE, SET_VALUE, SET_VALUE, UNSET, UNKNOWN)
"""(key path, value): set a setting (None: leave it out), or an unknown key."""


def apply(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    table = data
    for part in path[:-1]:
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            child = table[part] = {}
        table = child
    if value is None:
        table.pop(path[-1], None)
    else:
        table[path[-1]] = value


ONE_IN_TEN = st.sampled_from([True] + [False] * 9)
ODD_DOCUMENTS = st.sampled_from(
    [
        b"[run]\nseed = " + b"1" * 5000,
        b"a = " + b"[" * 5000,
        b"a = " + b"{b = " * 3000,
        b"\xef\xbb\xbf[run]\n",
        b"[run]\nseed = 1\n[run]\n",
        b"run = 1\n",
        b'[run]\nseed = 1\n"seed" = 2\n',
        b"[data]\nrollout_batch_size = 1e400\n",
    ]
)
"""Files the TOML reader itself stops at (Python's limits, a BOM, duplicates) or nearly."""
ODD_OVERRIDES = st.sampled_from(
    [
        "run.seed=" + "1" * 5000,
        "run.dir=" + "[" * 5000,
        "run.dir=runs/\udcff",
        "run..seed=1",
        "=1",
        "run.seed=",
        "run=1",
        "run.seed.x=1",
        "data.prompt_data=",
        "trainer.lr=1e400",
        "run.seed=0x10",
        'run.dir="a\nb"',
    ]
)
"""``--set`` arguments as a shell may pass them (``\udcff``: a byte that is not UTF-8)."""


@st.composite
def configs(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    """(the config file's bytes, ``--set`` arguments)."""
    if draw(ONE_IN_TEN):
        return draw(
            st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode), ODD_DOCUMENTS)
        ), []
    data = json.loads(json.dumps(BASE))
    overrides: list[str] = []
    for path, value in draw(st.lists(MUTATION, max_size=3)):
        if value is not None and draw(st.sampled_from([True, False, False, False])):
            overrides.append(".".join(path) + "=" + toml_value(value))
        else:
            apply(data, path, value)
    if draw(ONE_IN_TEN):
        overrides.append(
            draw(
                st.one_of(
                    st.text(max_size=16),
                    st.lists(st.text(max_size=8), min_size=2, max_size=2).map("=".join),
                    ODD_OVERRIDES,
                )
            )
        )
    return toml_document(data).encode(), overrides


# --- data files ----------------------------------------------------------------------------

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=5,
)
LINES = st.one_of(
    st.fixed_dictionaries({"input": st.text(max_size=8), "label": st.text(max_size=4)}).map(json.dumps),
    st.fixed_dictionaries({"input": st.text(max_size=8), "label": st.text(max_size=4)}).map(json.dumps),
    st.dictionaries(st.sampled_from(["input", "label", "x"]), ANY_JSON, max_size=3).map(
        json.dumps
    ),  # keys may miss
    ANY_JSON.map(json.dumps),  # not an object
    st.text(max_size=20),  # mostly not JSON
).map(str.encode)
ODD_LINES = st.sampled_from(
    [
        b"\xff",
        b"\xc3\x28",
        b"\xed\xa0\x80",
        b"\xe2\x82",
        b"\x00",
        b"\r",
        b"\xef\xbb\xbf{}",
        b"  ",
        b"[" * 5000,
        b'{"input": "1", "label": ' + b"1" * 5000 + b"}",
    ]
)
DATA_FILES = st.one_of(
    st.lists(st.one_of(LINES, LINES, LINES, ODD_LINES, st.binary(max_size=12)), max_size=6).map(b"\n".join),
    st.binary(max_size=64),
)
GOOD_DATA = b'{"input": "1+1=", "label": "2"}\n' * 4


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
    }


def leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from leaves(item)
    else:
        yield value


def assert_runnable(config: Config) -> None:
    """What an accepted config must not hold (each once failed only after the run started)."""
    assert all(math.isfinite(v) for v in leaves(msgspec.to_builtins(config)) if isinstance(v, float))
    assert 0 <= config.run.seed < 2**63
    builtin = config.model.builtin
    if config.model.path is None:
        head_dim, odd = divmod(builtin.hidden_size, builtin.num_attention_heads)
        assert (
            not odd and head_dim % 2 == 0 and builtin.num_attention_heads % builtin.num_key_value_heads == 0
        )


def check_input_outcome(config_bytes: bytes, overrides: list[str], prompts: bytes, eval_data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "sub").mkdir()
        (root / "prompts.jsonl").write_bytes(prompts)
        (root / "eval.jsonl").write_bytes(eval_data)
        (root / "run.toml").write_bytes(config_bytes)
        before = snapshot(root)
        try:
            config = load_and_check(root / "run.toml", overrides)
        except INPUT_ERRORS as error:
            line = error_line(error)
            assert len(line.splitlines()) == 1 and line.startswith("error: ") and len(line) > len("error: ")
        else:
            assert isinstance(config, Config)
            assert_runnable(config)
            # --dry-run prints it; what it prints reads back as the same config.
            assert load_config_text(dump_config(config), check=False) == config
        assert snapshot(root) == before, "the input checks wrote something"


FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(
    config=configs(),
    prompts=st.one_of(st.just(GOOD_DATA), DATA_FILES),
    eval_data=st.one_of(st.just(GOOD_DATA), DATA_FILES),
)
def test_any_input_is_accepted_or_one_line_of_input_error(
    config: tuple[bytes, list[str]], prompts: bytes, eval_data: bytes
) -> None:
    check_input_outcome(*config, prompts, eval_data)


@FUZZ
@given(config=configs())
def test_any_config_with_good_data_is_accepted_or_one_line_of_input_error(
    config: tuple[bytes, list[str]],
) -> None:
    check_input_outcome(*config, GOOD_DATA, GOOD_DATA)


@FUZZ
@given(
    files=st.one_of(
        st.tuples(DATA_FILES, st.just(GOOD_DATA)),
        st.tuples(st.just(GOOD_DATA), DATA_FILES),
        st.tuples(DATA_FILES, DATA_FILES),
    ),
    num_rollout=st.sampled_from([None, 0, 2]),
)
def test_any_data_with_the_base_config_is_accepted_or_one_line_of_input_error(
    files: tuple[bytes, bytes], num_rollout: int | None
) -> None:
    data = json.loads(json.dumps(BASE))
    apply(data, ("run", "num_rollout"), num_rollout)
    check_input_outcome(toml_document(data).encode(), [], *files)


def test_the_base_config_with_good_data_is_accepted() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in ("prompts.jsonl", "eval.jsonl"):
            (root / name).write_bytes(GOOD_DATA)
        (root / "run.toml").write_text(toml_document(BASE))
        assert load_and_check(root / "run.toml").data.rollout_batch_size == 2
