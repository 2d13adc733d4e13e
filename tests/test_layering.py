"""The dependency direction of the house, checked on every module's imports.

    schemas  <-  util  <-  rl  <-  device, checkpoint  <-  transport  <-  bus  <-  runtime
                                                            bus, rl   <-  sinks
    schemas, util, rl, device, transport  <-  policy_sync (the plugin API and its shipped plugin)
    (the framework above)  <-  actors  <-  miles_events.app
    schemas, util, rl  <-  actors.protocols (the Coordinator's state machines)  <-  actors

An import is an ``import`` / ``from ... import`` statement anywhere in a module (inside
functions too), a call of ``importlib.import_module`` or ``__import__`` with a literal
name, or a ``"package.module:Attribute"`` string (the form backend registries use for lazy
imports).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "miles_events", "actors")
_LAZY_REFERENCE = re.compile(r"^((?:schemas|miles_events|actors)(?:\.\w+)+):\w+$")

# Layer of a module -> the layers it may import. A layer is a package prefix.
UTIL = "miles_events.util"
RL = "miles_events.rl"
DEVICE = "miles_events.device"
CHECKPOINT = "miles_events.checkpoint"
TRANSPORT = "miles_events.transport"
BUS = "miles_events.bus"
RUNTIME = "miles_events.runtime"
SINKS = "miles_events.sinks"
POLICY_SYNC = "miles_events.policy_sync"
FRAMEWORK = (UTIL, RL, DEVICE, CHECKPOINT, TRANSPORT, BUS, RUNTIME, SINKS, POLICY_SYNC)
ALLOWED: dict[str, tuple[str, ...]] = {
    "schemas": ("schemas",),
    UTIL: ("schemas", UTIL),
    RL: ("schemas", UTIL, RL),
    DEVICE: ("schemas", UTIL, RL, DEVICE),
    CHECKPOINT: ("schemas", UTIL, RL, CHECKPOINT),
    TRANSPORT: ("schemas", UTIL, RL, DEVICE, CHECKPOINT, TRANSPORT),
    BUS: ("schemas", UTIL, BUS, TRANSPORT),
    RUNTIME: ("schemas", UTIL, BUS, TRANSPORT, RUNTIME),
    SINKS: ("schemas", UTIL, BUS, RL, SINKS),
    # External policy synchronizers: their API works through events and the data plane.
    POLICY_SYNC: ("schemas", UTIL, RL, DEVICE, TRANSPORT, POLICY_SYNC),
    # The actor API of the framework, not the bus itself, its host, codec or log.
    "actors": (
        "schemas",
        "miles_events.bus.actor",
        "miles_events.bus.handlers",
        "miles_events.bus.clock",
        "miles_events.bus.errors",
        "miles_events.bus.cancel",
        UTIL,
        RL,
        DEVICE,
        CHECKPOINT,
        TRANSPORT,
        POLICY_SYNC,
        "actors.protocols",
    ),
    # The Coordinator's state machines: not actors, pure (no bus, no device, no transport).
    "actors.protocols": ("schemas", UTIL, RL, "actors.protocols"),
    "miles_events.app": ("schemas", *FRAMEWORK, "actors", "miles_events.app"),
    # The entry points and the package itself; any other top-level module has no layer.
    "miles_events.run": ("miles_events.app",),
    "miles_events.replay": ("miles_events.app",),
}
TOP_LEVEL = {"miles_events"}
"""Packages with no code of their own (their ``__init__`` only documents)."""
# An actor never imports another actor; it may import its own backends' package.
OWN_BACKENDS = {
    "actors.generator": ("actors.engine",),
    "actors.trainer": ("actors.trainer_backend",),
    "actors.critic": ("actors.trainer_backend",),  # PPO's critic: a trainer group of its own
    "actors.engine": ("actors.engine",),
    "actors.trainer_backend": ("actors.trainer_backend",),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def _is_docstring(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    return isinstance(parent, ast.Expr)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of one of our packages in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; use the absolute module path")
            base = node.module or ""
            # ``from pkg import module`` imports the module where one exists.
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if _exists(candidate) else base))
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.append((node.lineno, str(node.args[0].value)))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and not _is_docstring(node, parents)
        ):
            match = _LAZY_REFERENCE.match(node.value)
            if match:
                found.append((node.lineno, match.group(1)))
    return [(line, module) for line, module in found if module.split(".")[0] in PACKAGES]


def _exists(module: str) -> bool:
    relative = Path(*module.split("."))
    return (REPO / relative.with_suffix(".py")).is_file() or (REPO / relative / "__init__.py").is_file()


def layer_of(module: str) -> str:
    """The most specific layer prefix of ``module``."""
    if module in TOP_LEVEL:
        return "schemas"  # imports nothing of ours
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} belongs to no layer")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(path: Path) -> list[str]:
    importer = module_name(path)
    layer = layer_of(importer)
    allowed = ALLOWED[layer] + (importer,)
    if layer == "actors":
        allowed += next((v for k, v in OWN_BACKENDS.items() if _within(importer, (k,))), ())
    return [
        f"{path.relative_to(REPO)}:{line}: {importer} ({layer}) imports {module}"
        for line, module in imported_modules(path)
        if not _within(module, allowed)
    ]


def test_a_top_level_module_that_is_not_an_entry_point_belongs_to_no_layer():
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("miles_events.helpers")


def test_every_module_imports_only_along_the_dependency_direction():
    problems = [p for path in source_modules() for p in violations(path)]
    assert not problems, "imports against the dependency direction:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        ("schemas/x.py", "from miles_events.bus.event_bus import EventBus\n", 1),
        ("miles_events/rl/x.py", "def f():\n    from miles_events.bus import event_bus\n", 1),
        ("miles_events/bus/x.py", "import importlib\nimportlib.import_module('actors.saver')\n", 1),
        ("miles_events/sinks/x.py", "__import__('miles_events.app.session')\n", 1),
        ("miles_events/runtime/x.py", "ENGINES = {'torch': 'actors.engine.torch_engine:TorchEngine'}\n", 1),
        ("actors/verifier_x.py", "from actors.saver import Saver\n", 1),
        ("actors/generator.py", "from actors.engine.base import Engine\n", 0),
        ("actors/x.py", "from miles_events.runtime.local import LocalRuntime\n", 1),
        ("actors/x.py", "from miles_events.sinks.metrics import RunMetrics\n", 1),
        ("miles_events/app/x.py", "from actors.saver import Saver\n", 0),
        ("miles_events/rl/x.py", '"""Mentions miles_events.app.session:Session in a docstring."""\n', 0),
        ("actors/x.py", "from miles_events.bus.event_bus import EventBus\n", 1),
        ("actors/x.py", "from miles_events.bus.actor import Actor\n", 0),
        ("actors/x.py", "from actors.protocols.opening import UpdateCheck\n", 0),
        ("actors/protocols/x.py", "from miles_events.bus.actor import Actor\n", 1),
        ("actors/protocols/x.py", "from actors.saver import Saver\n", 1),
        ("miles_events/rl/x.py", "from miles_events.device.buckets import Buckets\n", 1),
        ("miles_events/rl/x.py", "from miles_events.checkpoint.format import write_checkpoint\n", 1),
        ("miles_events/util/x.py", "from miles_events.rl.versions import next_version\n", 1),
        ("miles_events/device/x.py", "from miles_events.transport.base import Transport\n", 1),
        ("miles_events/checkpoint/x.py", "from miles_events.device.staging import StagingPool\n", 1),
        ("miles_events/transport/x.py", "from miles_events.device.staging import StagingPool\n", 0),
    ],
)
def test_the_check_catches_imports_against_the_direction(tmp_path, monkeypatch, importer, source, expected):
    fake_repo = tmp_path
    target = fake_repo / importer
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    for module in ("actors/saver.py", "actors/engine/base.py", "miles_events/bus/event_bus.py"):
        (fake_repo / module).parent.mkdir(parents=True, exist_ok=True)
        (fake_repo / module).touch()
    monkeypatch.setitem(globals(), "REPO", fake_repo)
    assert len(violations(target)) == expected


HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "numpy")


def test_the_driver_reads_the_roster_and_starts_a_session_without_the_model_libraries():
    """The actors' modules, the session and the runtimes import torch and transformers only
    where they compute: the ray runtime starts its cluster before the driver builds the base
    model, so that Ray and the actor processes come up beside it."""
    import subprocess
    import sys

    code = (
        "import sys; import miles_events.app.run, miles_events.app.roster, miles_events.app.session, "
        "miles_events.runtime.ray; "
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert loaded.stdout.strip() == "", f"imported at start-up: {loaded.stdout.strip()}"
