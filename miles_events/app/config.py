"""Loading the run configuration: TOML, ``--set`` overrides, strict decoding, checks.

``load_config(path, overrides)`` reads the TOML file, applies ``--set a.b=value``
overrides (the value is read as a TOML value, else taken as a string), decodes strictly
into ``schemas.config.Config``, resolves relative paths and checks the rules that span
fields (``validate``). Every problem is a ``ConfigError`` whose message is one line::

    examples/default.toml:7: run.num_rolout: unknown key (did you mean num_rollout?)
    examples/default.toml: --set run.seed=x: run.seed: expected int, got str

Relative paths in the file are relative to the file's directory; relative paths given
with ``--set`` are relative to the current directory, as on any command line.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import tomllib
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from actors.engine import check_engine, check_probe
from actors.trainer_backend import check_backend
from miles_events.policy_sync.loader import load_policy_sync
from miles_events.rl.prompts import not_a_file
from miles_events.util.registry import load_function
from schemas.config import (
    Config,
    MegatronConfig,
    engines_heal,
    engines_isolated,
    resolved_sharding,
    staleness_bound,
    trainer_heals,
)

PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("run", "dir"),
    ("run", "save_trigger_sentinel"),
    ("run", "load"),
    ("run", "ref_load"),
    ("run", "critic_load"),
    ("run", "rollout_only_publication_evidence"),
    ("data", "prompt_data"),
    ("data", "eval_data"),
    ("model", "path"),
    ("model", "cache_dir"),
    ("vllm", "python"),
    ("tracking", "tensorboard_dir"),
    ("tracking", "wandb_dir"),
    ("policy_sync", "directory"),
)
"""(section, key) of every setting that is a filesystem path."""

MOVED_KEYS: dict[tuple[str, ...], str] = {
    ("rollout", "num_engines"): "generator.num_engines",
}
"""Keys that moved to another section: the error for the old place names the new one."""

MOVED_MODULES: dict[str, str] = {"miles_events.rewards.": "miles_events.rl.rewards."}
"""Dotted-path prefixes of our own functions that moved (a recorded config may name them)."""


def migrate_recorded(data: dict[str, Any]) -> None:
    """A config a run recorded before keys or modules moved, in today's places: re-driving
    an old log must not fail on where a setting used to live."""
    for (section, key), target in MOVED_KEYS.items():
        old = data.get(section, {})
        if isinstance(old, dict) and key in old:
            new_section, new_key = target.split(".")
            data.setdefault(new_section, {}).setdefault(new_key, old.pop(key))
    rollout = data.get("rollout", {})
    reward_fn = rollout.get("reward_fn") if isinstance(rollout, dict) else None
    if isinstance(reward_fn, str):
        for old_prefix, new_prefix in MOVED_MODULES.items():
            if reward_fn.startswith(old_prefix):
                rollout["reward_fn"] = new_prefix + reward_fn.removeprefix(old_prefix)


class ConfigError(ValueError):
    """A configuration problem, described in one line."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        """The dotted key path at fault, when there is one."""


# --- overrides ------------------------------------------------------------------------


def _toml_limit(error: ValueError | RecursionError) -> str:
    """What stopped ``tomllib`` short of a syntax error (a limit of Python's), in one line."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    # e.g. an integer of more digits than Python converts (less its advice on raising the limit)
    return " ".join(str(error).split(";")[0].split())


def parse_override(argument: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> (``["a", "b"]``, the value read as TOML, else the raw string)."""
    try:
        argument.encode("utf-8")
    except UnicodeEncodeError:  # bytes the command line could not decode
        shown = argument.encode("utf-8", "backslashreplace").decode("utf-8")
        raise ConfigError(f"--set {shown}: not UTF-8 text") from None
    key, sep, raw = argument.partition("=")
    if not sep:
        raise ConfigError(f"--set {argument}: expected KEY=VALUE, e.g. run.num_rollout=3")
    parts = [part.strip() for part in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(f"--set {argument}: {key.strip()!r} is not a dotted key like run.seed")
    try:
        parsed = tomllib.loads("v = " + raw)
    except tomllib.TOMLDecodeError:
        parsed = {}
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"--set {argument}: value not readable as TOML ({_toml_limit(error)})") from None
    # Anything but exactly one value (e.g. text with a newline and another key) is a string.
    value = parsed["v"] if parsed.keys() == {"v"} else raw
    return parts, value


def apply_override(data: dict[str, Any], argument: str) -> list[str]:
    """Apply one ``--set`` to the raw TOML data in place; returns the key path it set."""
    parts, value = parse_override(argument)
    table = data
    for depth, part in enumerate(parts[:-1]):
        child = table.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise ConfigError(f"--set {argument}: {prefix} is a {type(child).__name__}, not a table")
        table = child
    table[parts[-1]] = value
    return parts


# --- error messages -------------------------------------------------------------------

# DOTALL: a key from the file may hold a line break ("a\nb" = 1 is a TOML key).
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$", re.DOTALL)
_EXPECTED = re.compile(r"^Expected `(?P<expected>[^`]*)`(?:, got `(?P<got>[^`]*)`)?(?P<rest>.*)$", re.DOTALL)


def _path_parts(path: str) -> list[str]:
    """``.run.stop[0]`` -> ``["run", "stop", "[0]"]`` (indices kept for the message)."""
    return [p for p in re.split(r"\.|(?=\[)", path) if p]


def _dotted(parts: Sequence[str]) -> str:
    return ".".join(parts).replace(".[", "[")


def _struct_at(parts: Sequence[str]) -> type[msgspec.Struct] | None:
    """The Struct type of the table at ``parts`` in ``Config``, if there is one."""
    struct: type[msgspec.Struct] = Config
    for part in parts:
        info = msgspec.inspect.type_info(struct)
        field = next((f for f in info.fields if f.name == part), None)  # type: ignore[attr-defined]
        if field is None or not isinstance(field.type, msgspec.inspect.StructType):
            return None
        struct = field.type.cls
    return struct


def _field_type(parts: Sequence[str]) -> msgspec.inspect.Type | None:
    parent = _struct_at(parts[:-1])
    if parent is None or not parts:
        return None
    info = msgspec.inspect.type_info(parent)
    field = next((f for f in info.fields if f.name == parts[-1]), None)  # type: ignore[attr-defined]
    return None if field is None else field.type


def _literal_choices(parts: Sequence[str]) -> list[Any]:
    field_type = _field_type(parts)
    options = field_type.types if isinstance(field_type, msgspec.inspect.UnionType) else (field_type,)
    for option in options:
        if isinstance(option, msgspec.inspect.LiteralType):
            return list(option.values)
    return []


def _describe(error: msgspec.ValidationError) -> tuple[list[str], str]:
    """msgspec's message -> (key path, what is wrong in plain words)."""
    match = _AT.match(str(error))
    assert match is not None  # the pattern matches any text
    what, path = match.group("what"), match.group("path") or ""
    parts = _path_parts(path)
    unknown = _UNKNOWN.match(what)
    if unknown:
        field = unknown.group("field")
        struct = _struct_at(parts)
        hint = ""
        moved = MOVED_KEYS.get((*parts, field))
        if moved is not None:
            hint = f" (moved to {moved})"
        elif struct is not None:
            close = difflib.get_close_matches(field, struct.__struct_fields__, n=1)
            hint = (
                f" (did you mean {close[0]}?)"
                if close
                else f" (known: {', '.join(struct.__struct_fields__)})"
            )
        return [*parts, field], f"unknown key{hint}"
    expected = _EXPECTED.match(what)
    if expected:
        # TOML has no null: an optional key is simply left out, so hide "| null".
        wanted = expected.group("expected").replace(" | null", "").replace("object", "table")
        got = (expected.group("got") or "").replace("object", "table")
        rest = expected.group("rest").strip()
        if got:
            return parts, f"expected {wanted}, got {got}"
        return parts, f"must be {rest}" if rest else f"expected {wanted}"
    if what.startswith("Invalid enum value"):
        choices = _literal_choices(parts)
        value = what.removeprefix("Invalid enum value").strip()
        if choices:
            return parts, f"invalid value {value}, expected one of {', '.join(map(repr, choices))}"
        return parts, f"invalid value {value}"
    return parts, what[0].lower() + what[1:] if what else "invalid value"


_HEADER = re.compile(r"^\s*\[\[?\s*(?P<name>[^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(r"""^\s*(?P<key>[A-Za-z0-9_\-."' ]+?)\s*=""")


def _value_at(data: Any, key_path: Sequence[str]) -> Any:
    """The value at ``key_path`` of parsed TOML ``data`` (list indices as ``[n]``), or None."""
    for part in key_path:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and part.startswith("[") and part.endswith("]") and part[1:-1].isdigit():
            index = int(part[1:-1])
            data = data[index] if index < len(data) else None
        else:
            return None
    return data


def _split_key(key: str) -> list[str]:
    return [part.strip().strip("\"'") for part in key.split(".")]


def find_key_line(text: str, key_path: Sequence[str]) -> int | None:
    """Best-effort 1-based line of ``key_path`` in TOML text (its key, else its table header)."""
    target = [p for p in key_path if not p.startswith("[")]
    table: list[str] = []
    header_line: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            table = _split_key(header.group("name"))
            if table == target and header_line is None:
                header_line = number
            continue
        key = _KEY.match(line)
        if key and table + _split_key(key.group("key")) == target:
            return number
    return header_line


def _override_for(key_path: Sequence[str], overrides: dict[tuple[str, ...], str]) -> str | None:
    """The ``--set`` argument that put ``key_path`` (or a table above it) in the data."""
    plain = tuple(p for p in key_path if not p.startswith("["))
    for length in range(len(plain), 0, -1):
        argument = overrides.get(plain[:length])
        if argument is not None:
            return argument
    # An override below the failing key made it a table (``--set run.dir.x=1``).
    return next((arg for key, arg in overrides.items() if plain and key[: len(plain)] == plain), None)


# --- loading --------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str], overrides: Sequence[str] = (), *, check: bool = True, recorded: bool = False
) -> Config:
    """Read, override, decode, resolve and (unless ``check=False``) validate a config file;
    ``recorded``: one a run wrote beside its log, migrated from older layouts."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a leading byte order mark is no statement
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read config file: {error}") from None
    return load_config_text(
        text, name=str(path), base_dir=path.parent, overrides=overrides, check=check, recorded=recorded
    )


def load_config_text(
    text: str,
    *,
    name: str = "<config>",
    base_dir: str | os.PathLike[str] = ".",
    overrides: Sequence[str] = (),
    check: bool = True,
    recorded: bool = False,
) -> Config:
    """``load_config`` for TOML text (an embedded default); ``name`` appears in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{name}: TOML syntax error: {error}") from None
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"{name}: not readable as TOML ({_toml_limit(error)})") from None
    if recorded:
        migrate_recorded(data)
    overridden: dict[tuple[str, ...], str] = {}
    for argument in overrides:
        try:
            overridden[tuple(apply_override(data, argument))] = argument
        except ConfigError as error:
            raise ConfigError(f"{name}: {error}", key=error.key) from None
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as error:
        key_path, what = _describe(error)
        value = _value_at(data, key_path)
        if isinstance(value, float) and not math.isfinite(value):  # not "must be > 0" for a nan
            what = f"must be a finite number, got {_toml_value(value)}"
        raise _located(name, text, key_path, what, overridden) from None
    config = resolve_paths(config, Path(base_dir), {k for k in overridden if len(k) == 2})
    if check:
        try:
            validate(config)
        except ConfigError as error:
            key_path = error.key.split(".") if error.key else []
            raise _located(name, text, key_path, str(error), overridden, prefixed=True) from None
    return config


def _located(
    name: str,
    text: str,
    key_path: Sequence[str],
    what: str,
    overridden: dict[tuple[str, ...], str],
    *,
    prefixed: bool = False,
) -> ConfigError:
    """The one-line error: where (file and line, or the ``--set``), which key, what."""
    dotted = _dotted(key_path)
    message = what if prefixed or not dotted else f"{dotted}: {what}"
    argument = _override_for(key_path, overridden)
    if argument is not None:
        return ConfigError(f"{name}: --set {argument}: {message}", key=dotted or None)
    line = find_key_line(text, key_path) if key_path else None
    where = f"{name}:{line}" if line is not None else name
    return ConfigError(f"{where}: {message}", key=dotted or None)


def _resolve(value: str, base: Path) -> str:
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded)
    return os.path.normpath(os.path.join(base, expanded))


def resolve_paths(config: Config, base_dir: Path, from_cwd: Collection[tuple[str, ...]] = ()) -> Config:
    """A copy with every path setting absolute: relative to ``base_dir``, or to the current
    directory for keys in ``from_cwd`` (those given on the command line). Empty and unset
    paths stay as they are."""
    file_base, cwd = base_dir.absolute(), Path.cwd()
    sections: dict[str, dict[str, str]] = {}
    for section, key in (*PATH_KEYS, ("model", "gguf")):
        value = getattr(getattr(config, section), key)
        if key == "gguf" and value and not (value.endswith(".gguf") or os.sep in value):
            continue  # an installed package's name, not a path
        if value:
            base = cwd if (section, key) in from_cwd else file_base
            sections.setdefault(section, {})[key] = _resolve(value, base)
    changes = {
        section: msgspec.structs.replace(getattr(config, section), **values)
        for section, values in sections.items()
    }
    return msgspec.structs.replace(config, **changes)


def validate(config: Config) -> None:
    """Check the rules that span fields; raises ``ConfigError`` (with ``.key``) on the first."""
    _validate_finite(config)
    _validate_seed(config)
    _validate_builtin_model(config)
    _validate_own_process(config)
    _validate_transport(config)
    _validate_ranks(config)
    _validate_megatron(config)
    _validate_critic(config)
    run, data, trainer = config.run, config.data, config.trainer
    if config.model.gguf is not None and config.model.path is not None:
        raise ConfigError(
            "model.gguf: cannot be set with model.path (one model: a Hugging Face directory or a GGUF file)",
            key="model.gguf",
        )
    if not run.dir.strip():
        raise ConfigError("run.dir: must name a directory (it is empty)", key="run.dir")
    if run.resume and run.overwrite:
        raise ConfigError(
            "run.overwrite: cannot be set with run.resume (a resumed run continues from the checkpoints "
            "that overwrite would move aside)",
            key="run.overwrite",
        )
    if run.num_rollout != 0:
        needed = (
            "run.num_rollout is unset" if run.num_rollout is None else f"run.num_rollout = {run.num_rollout}"
        )
        if not data.prompt_data:
            raise ConfigError(f"data.prompt_data: required because {needed}", key="data.prompt_data")
        problem = not_a_file(data.prompt_data)
        if problem == "no such file":
            raise ConfigError(
                f"data.prompt_data: no such file {data.prompt_data} (needed because {needed})",
                key="data.prompt_data",
            )
        if problem is not None:
            raise ConfigError(f"data.prompt_data: {data.prompt_data} {problem}", key="data.prompt_data")
    _validate_loading(config)
    _validate_policy_sync(config)
    if data.eval_data:
        problem = not_a_file(data.eval_data)
        if problem == "no such file":
            raise ConfigError(f"data.eval_data: no such file {data.eval_data}", key="data.eval_data")
        if problem is not None:
            raise ConfigError(f"data.eval_data: {data.eval_data} {problem}", key="data.eval_data")
    _check_fault_tolerance(config)
    _check_asynchronous(config)
    rollout_samples = data.rollout_batch_size * data.n_samples_per_prompt
    global_batch = trainer.global_batch_size or rollout_samples
    if rollout_samples % global_batch:
        raise ConfigError(
            f"trainer.global_batch_size: {global_batch} must divide the samples per rollout "
            f"(data.rollout_batch_size * data.n_samples_per_prompt = {rollout_samples})",
            key="trainer.global_batch_size",
        )
    if trainer.micro_batch_size > global_batch:
        raise ConfigError(
            f"trainer.micro_batch_size: {trainer.micro_batch_size} must be <= the global batch "
            f"of {global_batch} samples",
            key="trainer.micro_batch_size",
        )
    if trainer.rollout_is_cap is not None and config.rollout.temperature != 1.0:
        raise ConfigError(
            f"trainer.rollout_is_cap: the engine's logprobs are of logits / rollout.temperature "
            f"({config.rollout.temperature:g}) and the trainer's of the untempered policy; sample at "
            "temperature 1 to correct for them",
            key="trainer.rollout_is_cap",
        )
    if trainer.use_rollout_logprobs and config.rollout.temperature != 1.0:
        raise ConfigError(
            f"trainer.use_rollout_logprobs: the engine's logprobs are of logits / rollout.temperature "
            f"({config.rollout.temperature:g}) and the trainer's of the untempered policy; sample at "
            "temperature 1 or let the trainer recompute them",
            key="trainer.use_rollout_logprobs",
        )
    try:
        load_function(config.rollout.reward_fn)
    except ValueError as error:
        raise ConfigError(f"rollout.reward_fn: {error}", key="rollout.reward_fn") from None
    for key, check, value in (
        ("generator.engine", check_engine, config.generator.engine),
        ("trainer.backend", check_backend, config.trainer.backend),
    ):
        try:
            check(value)
        except ValueError as error:
            raise ConfigError(f"{key}: {error}", key=key) from None
    try:
        check_probe(config.generator.engine, config.verifier.probe == "on")
    except ValueError as error:
        raise ConfigError(f"verifier.probe: {error}", key="verifier.probe") from None


def _floats(value: object, key: str) -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every float in a config, its sections and lists."""
    if isinstance(value, msgspec.Struct):
        for field in value.__struct_fields__:
            yield from _floats(getattr(value, field), f"{key}.{field}" if key else field)
    elif isinstance(value, float):
        yield key, value
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _floats(item, f"{key}[{index}]")


def _validate_finite(config: Config) -> None:
    """Every float setting is a number: TOML's ``nan``, ``inf`` and ``-inf`` (and a literal
    too large for a float, which reads as ``inf``) are refused, whatever the field's bounds."""
    for key, value in _floats(config, ""):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {_toml_value(value)}", key=key)


SEED_MAX = 2**63 - 1
"""``run.seed`` is 0 to this: torch takes [-2**63, 2**64) and reads a negative seed modulo
2**64 (so it is another name for a large one); a non-negative int64 every consumer takes."""


def _validate_seed(config: Config) -> None:
    """Here, not in the schema: a recorded config is re-driven as it was (``check=False``)."""
    seed = config.run.seed
    if not 0 <= seed <= SEED_MAX:
        shown = str(seed) if len(str(seed)) <= 40 else f"{str(seed)[:20]}... ({len(str(seed))} digits)"
        raise ConfigError(f"run.seed: must be 0 to 2**63 - 1, got {shown}", key="run.seed")


def _validate_builtin_model(config: Config) -> None:
    """``[model.builtin]``, when it is the model (``model.path`` unset), has a shape the
    architectures build and run: heads that split ``hidden_size`` into an even head
    dimension (rotary embeddings turn pairs of it), key/value heads that split the heads."""
    if config.model.path is not None:
        return
    builtin = config.model.builtin
    hidden, heads, kv_heads = builtin.hidden_size, builtin.num_attention_heads, builtin.num_key_value_heads
    key = "model.builtin.num_attention_heads"
    if hidden % heads:
        raise ConfigError(f"{key}: {heads} must divide model.builtin.hidden_size ({hidden})", key=key)
    if (hidden // heads) % 2:
        raise ConfigError(
            f"{key}: {heads} heads of model.builtin.hidden_size {hidden} are {hidden // heads} wide; "
            "the head dimension must be even (rotary embeddings)",
            key=key,
        )
    if heads % kv_heads:
        key = "model.builtin.num_key_value_heads"
        raise ConfigError(
            f"{key}: {kv_heads} must divide model.builtin.num_attention_heads ({heads})", key=key
        )


def _validate_own_process(config: Config) -> None:
    """``ray.own_process`` names light actors of the run (the roster, the heaviest import of
    a run, is read only then)."""
    if not config.ray.own_process:
        return
    from miles_events.app.roster import ACTORS

    light = [cls.name for cls in ACTORS if cls.resources(config).role == "service"]
    for name in config.ray.own_process:
        if name not in light:
            raise ConfigError(
                f"ray.own_process: {name!r} is not a light actor; those that can have a process of their own: "
                f"{', '.join(light)} (the generator and the trainer always have one, the coordinator never)",
                key="ray.own_process",
            )


def _validate_ranks(config: Config) -> None:
    """``trainer.sharding = "none"`` is the single-process trainer: one rank."""
    trainer = config.trainer
    if trainer.sharding == "none" and trainer.num_ranks > 1:
        raise ConfigError(
            f'trainer.sharding: "none" trains on one rank, not trainer.num_ranks = {trainer.num_ranks}; '
            'shard with "fsdp2" (or "auto"), or replicate with "ddp"',
            key="trainer.sharding",
        )


MEGATRON_INSTALL = "pip install --no-deps megatron-core==0.16.1"
"""How to install what the ``megatron`` trainer backend needs (megatron-core's own needs are
torch, numpy and packaging, which every run has)."""
MEGATRON_SERIES = "0.16."
"""The megatron-core releases whose APIs the backend calls."""


def _validate_megatron(config: Config) -> None:
    """The ``megatron`` trainer backend: megatron-core installed, its ranks data-parallel
    replicas, a model it converts; the ``[megatron]`` section only with it."""
    import importlib.metadata
    import importlib.util

    trainer, megatron = config.trainer, config.megatron
    if trainer.backend != "megatron":
        changed = [
            f"megatron.{field}"
            for field in megatron.__struct_fields__
            if getattr(megatron, field) != getattr(MegatronConfig(), field)
        ]
        if changed:
            raise ConfigError(
                f'{changed[0]}: set for the megatron trainer backend, and trainer.backend is "{trainer.backend}"',
                key=changed[0],
            )
        return
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ConfigError(
            f'trainer.backend: "megatron" needs megatron-core, which is not installed: {MEGATRON_INSTALL}',
            key="trainer.backend",
        )
    version = importlib.metadata.version("megatron-core")
    if not version.startswith(MEGATRON_SERIES):
        raise ConfigError(
            f'trainer.backend: "megatron" is built on megatron-core {MEGATRON_SERIES}x, and {version} is '
            f"installed: {MEGATRON_INSTALL}",
            key="trainer.backend",
        )
    if trainer.sharding not in ("auto", "ddp"):
        raise ConfigError(
            f"trainer.sharding: \"{trainer.sharding}\" is the torch backend's; the megatron backend's ranks "
            'are data-parallel replicas: leave it "auto" (or "ddp")',
            key="trainer.sharding",
        )
    for key, size, what in (
        ("megatron.tensor_parallel_size", megatron.tensor_parallel_size, "tensor"),
        ("megatron.pipeline_parallel_size", megatron.pipeline_parallel_size, "pipeline"),
    ):
        if size > 1:
            raise ConfigError(
                f"{key}: {size}: {what} parallelism is not built yet; the megatron backend's "
                f"trainer.num_ranks ranks are data-parallel replicas (set it to 1)",
                key=key,
            )
    if (
        megatron.transformer_impl == "transformer_engine"
        and importlib.util.find_spec("transformer_engine") is None
    ):
        raise ConfigError(
            'megatron.transformer_impl: "transformer_engine" needs Transformer Engine, which is not installed; '
            'use "local" (or "auto")',
            key="megatron.transformer_impl",
        )
    check_megatron_model(config)


def check_megatron_model(config: Config) -> None:
    """With the megatron trainer backend, a model directory (``model.path``; a GGUF model once
    converted) whose config Megatron's GPT model can express. The built-in model (a Qwen2 or a
    Llama) always can."""
    path = config.model.path
    if config.trainer.backend != "megatron" or path is None:
        return
    hf_config = Path(path) / "config.json"
    if not hf_config.is_file():
        return  # the model check names a directory without its config
    from actors.trainer_backend.megatron_convert import MegatronLayout

    try:
        MegatronLayout.of(json.loads(hf_config.read_text()))
    except (ValueError, KeyError) as error:
        raise ConfigError(f"model.path: the megatron trainer backend: {error}", key="model.path") from None


def _validate_critic(config: Config) -> None:
    """The critic's settings need ``trainer.use_critic`` (PPO), and its ranks a sharding."""
    trainer = config.trainer
    if not trainer.use_critic:
        if trainer.num_critic_only_steps:
            raise ConfigError(
                f"trainer.num_critic_only_steps: {trainer.num_critic_only_steps} rollouts train a critic, "
                "which needs trainer.use_critic = true",
                key="trainer.num_critic_only_steps",
            )
        if config.run.critic_load is not None:
            raise ConfigError(
                "run.critic_load: a critic needs trainer.use_critic = true", key="run.critic_load"
            )
        return
    critic_ranks = trainer.critic_num_ranks or trainer.num_ranks
    if trainer.sharding == "none" and critic_ranks > 1:
        raise ConfigError(
            f'trainer.sharding: "none" trains on one rank, not trainer.critic_num_ranks = {critic_ranks}; '
            'shard with "fsdp2" (or "auto"), or replicate with "ddp"',
            key="trainer.sharding",
        )


def _validate_transport(config: Config) -> None:
    """``publisher.transport = "inprocess"`` keeps data in one process: the local runtime's."""
    if config.publisher.transport == "inprocess" and config.run.runtime != "local":
        raise ConfigError(
            f'publisher.transport: "inprocess" keeps data in one process, which needs run.runtime = "local" '
            f'(not "{config.run.runtime}"); on ray use "shm", "disk" or "cuda_ipc" (or "auto")',
            key="publisher.transport",
        )


def _validate_policy_sync(config: Config) -> None:
    """``run.external_policy_sync_path`` imports, builds a plugin with every hook, and one
    that declares critic support where the run has a critic (the seed's check at load)."""
    key = "run.external_policy_sync_path"
    if config.run.external_policy_sync_path is None:
        if config.run.external_policy_sync_run_until_stop:
            raise ConfigError(
                "run.external_policy_sync_run_until_stop: only an external policy synchronizer can stop such "
                "a run; set run.external_policy_sync_path",
                key="run.external_policy_sync_run_until_stop",
            )
        return
    try:
        load_policy_sync(config)
    except ValueError as error:
        raise ConfigError(f"{key}: {error}", key=key) from None


def _validate_loading(config: Config) -> None:
    """``run.load`` / ``run.ref_load`` and the rollout-only mode (the checkpoints themselves
    are verified by the run plan)."""
    run = config.run
    for key, value in (
        ("run.load", run.load),
        ("run.ref_load", run.ref_load),
        ("run.critic_load", run.critic_load),
    ):
        if value is not None and not os.path.isdir(value):
            raise ConfigError(f"{key}: no such directory {value}", key=key)
    evidence = run.rollout_only_publication_evidence
    if not run.rollout_only_from_checkpoint:
        if evidence is not None:
            raise ConfigError(
                "run.rollout_only_publication_evidence: set only with run.rollout_only_from_checkpoint = true",
                key="run.rollout_only_publication_evidence",
            )
        return
    mode = "run.rollout_only_from_checkpoint"
    for key, used in (
        ("trainer.use_critic", config.trainer.use_critic),
        ("run.external_policy_sync_path", run.external_policy_sync_path is not None),
    ):
        if used:
            # The seed's refusal, word for word.
            raise ConfigError(
                f"{key}: checkpoint-backed rollout-only mode cannot use external sync or a critic", key=key
            )
    if run.load is None and run.ref_load is None:
        raise ConfigError(
            f"run.load: {mode} needs the checkpoint root to serve (run.load or run.ref_load)", key="run.load"
        )
    if evidence is None:
        raise ConfigError(
            f"run.rollout_only_publication_evidence: required by {mode} (where its proof is written)",
            key="run.rollout_only_publication_evidence",
        )
    if os.path.lexists(evidence):
        raise ConfigError(
            f"run.rollout_only_publication_evidence: {evidence} exists already; evidence is never overwritten "
            "(move it, or choose another path)",
            key="run.rollout_only_publication_evidence",
        )
    if not os.path.isdir(os.path.dirname(evidence)):
        raise ConfigError(
            f"run.rollout_only_publication_evidence: no such directory {os.path.dirname(evidence)}",
            key="run.rollout_only_publication_evidence",
        )
    if run.resume:
        raise ConfigError(
            f"run.resume: {mode} serves run.load and saves nothing to resume from", key="run.resume"
        )
    if config.verifier.check_weight_update_equal:
        raise ConfigError(
            f"verifier.check_weight_update_equal: {mode} runs its own snapshot, reset and compare around a "
            "republication; unset one of them",
            key="verifier.check_weight_update_equal",
        )


# --- output ---------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(value: str) -> str:
    out = ['"']
    for char in value:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _emit_table(struct: msgspec.Struct, name: list[str], lines: list[str]) -> None:
    values = [(f, getattr(struct, f)) for f in struct.__struct_fields__]
    scalars = [(f, v) for f, v in values if not isinstance(v, msgspec.Struct)]
    if name:
        lines.append(f"\n[{'.'.join(_toml_key(n) for n in name)}]")
    for field, value in scalars:
        if value is None:
            lines.append(f"# {_toml_key(field)} = (unset)")
        else:
            lines.append(f"{_toml_key(field)} = {_toml_value(value)}")
    for field, value in values:
        if isinstance(value, msgspec.Struct):
            _emit_table(value, [*name, field], lines)


def dump_config(config: Config) -> str:
    """The config as TOML text that ``load_config`` reads back to an equal ``Config``."""
    lines = [f"# miles-events resolved config, digest {config_digest(config)}"]
    _emit_table(config, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def config_digest(config: Config) -> str:
    """sha256 (hex) of the config's canonical JSON (keys sorted)."""
    return hashlib.sha256(msgspec.json.encode(config, order="sorted")).hexdigest()


def _check_fault_tolerance(config: Config) -> None:
    """What ``run.ft_components``, the control server and the mini FT controller need."""
    run = config.run
    if len(set(run.ft_components)) != len(run.ft_components):
        raise ConfigError("run.ft_components: each component once", key="run.ft_components")
    if "rollout" in run.ft_components and run.offload_rollout:
        raise ConfigError(
            "run.ft_components: healing engines whose memory is offloaded (run.offload_rollout) is not "
            "supported: a restarted engine would hold memory the trainer was given",
            key="run.ft_components",
        )
    if engines_isolated(config) and config.publisher.transport == "inprocess":
        raise ConfigError(
            'publisher.transport: "inprocess" cannot reach engines that heal (each runs in a process of '
            'its own); use "auto" or "shm"',
            key="publisher.transport",
        )
    if engines_isolated(config) and config.ray.colocate:
        raise ConfigError(
            "run.ft_components: healing embedded engines with ray.colocate is not supported (each engine "
            "then has a bundle of its own, apart from the trainer's ranks)",
            key="run.ft_components",
        )
    if trainer_heals(config):
        _check_trainer_heals(config)
    if run.mini_ft_controller and not run.control_server_port:
        raise ConfigError(
            "run.mini_ft_controller: needs the control server (set run.control_server_port)",
            key="run.mini_ft_controller",
        )
    if run.mini_ft_controller and not run.ft_components:
        raise ConfigError(
            'run.mini_ft_controller: heals cells, and there are none: set run.ft_components = ["rollout"]',
            key="run.mini_ft_controller",
        )


def _check_asynchronous(config: Config) -> None:
    """What asynchronous training (``run.max_staleness``, ``run.fully_async``) works with."""
    run = config.run
    if config.rollout.partial and not staleness_bound(config):
        raise ConfigError(
            "rollout.partial: needs asynchronous training (set run.max_staleness >= 1): the synchronous "
            "loop never publishes while a rollout is generated",
            key="rollout.partial",
        )
    if config.rollout.partial and config.generator.engine not in ("torch", "sglang"):
        raise ConfigError(
            f"rollout.partial: the {config.generator.engine} engine cannot take a load while it generates "
            'here (the embedded engine, generator.engine = "torch", and SGLang servers can)',
            key="rollout.partial",
        )
    if (
        config.rollout.partial
        and config.generator.engine == "sglang"
        and config.sglang.pause_mode
        not in (
            "retract",
            "in_place",
        )
    ):
        raise ConfigError(
            f"rollout.partial: sglang.pause_mode = {config.sglang.pause_mode!r} would abort the requests in "
            'flight at each publication: use "retract" or "in_place"',
            key="sglang.pause_mode",
        )
    if config.rollout.partial and engines_heal(config):
        raise ConfigError(
            'rollout.partial: with engines that heal ("rollout" in run.ft_components) is not supported (a '
            "restart would meet a load landing beside the rollout)",
            key="rollout.partial",
        )
    if not staleness_bound(config):
        return
    why = "rollouts are generated ahead of training"
    refusals = (
        (
            run.rollout_only_from_checkpoint,
            "run.rollout_only_from_checkpoint",
            "a rollout-only run trains nothing: nothing to be ahead of",
        ),
        (
            config.trainer.use_critic,
            "trainer.use_critic",
            f"asynchronous training with a critic is not supported ({why}; the critic values each rollout in step)",
        ),
        (
            run.offload_train,
            "run.offload_train",
            f"asynchronous training needs the trainer's memory while the engines generate ({why})",
        ),
        (
            run.offload_rollout,
            "run.offload_rollout",
            f"asynchronous training needs the engines' memory while the trainer trains ({why})",
        ),
        (
            config.ray.colocate,
            "ray.colocate",
            f"asynchronous training needs the engines and the trainer apart, as the seed's asynchronous driver does ({why})",
        ),
        (
            run.external_policy_sync_path is not None,
            "run.external_policy_sync_path",
            f"asynchronous training with an external policy synchronizer is not supported (its hooks run between steps, {why})",
        ),
        (
            trainer_heals(config),
            "run.ft_components",
            f'"train" with asynchronous training is not supported (a restored trainer would meet rollouts asked for before it; {why})',
        ),
    )
    for refused, key, reason in refusals:
        if refused:
            raise ConfigError(f"{key}: {reason}", key=key)


def _check_trainer_heals(config: Config) -> None:
    """What healing the trainer's group (``"train"`` in ``run.ft_components``) needs."""
    run, trainer = config.run, config.trainer
    refusals = (
        (
            resolved_sharding(trainer) == "none",
            "trainer.sharding",
            'a trainer that heals runs its ranks in processes of their own: set trainer.sharding = "fsdp2" '
            '(or "ddp"), or trainer.num_ranks >= 2',
        ),
        (
            trainer.use_critic,
            "trainer.use_critic",
            "healing the trainer with a critic is not supported (the critic's group would not rewind with it)",
        ),
        (
            run.offload_train,
            "run.offload_train",
            "healing the trainer with run.offload_train is not supported (a restarted group holds its memory)",
        ),
        (
            run.external_policy_sync_path is not None,
            "run.external_policy_sync_path",
            "healing the trainer with an external policy synchronizer is not supported (its peers do not rewind)",
        ),
        (
            config.ray.colocate,
            "ray.colocate",
            "healing the trainer with ray.colocate is not supported (each rank then has a bundle of its own)",
        ),
        (
            run.rollout_only_from_checkpoint,
            "run.ft_components",
            '"train" heals training, and a rollout-only run trains nothing',
        ),
    )
    for refused, key, reason in refusals:
        if refused:
            raise ConfigError(f"{key}: {reason}", key=key)
