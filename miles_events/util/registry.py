"""Things named by a dotted path and imported only when asked for: a config's functions
(``rollout.reward_fn``) and the backend registries (engines, trainer backends, transports),
whose entries are ``"module:Class"`` so that one backend's dependencies never load for
another."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def load_function(dotted_path: str) -> Callable[..., Any]:
    """Import ``package.module.name`` (or ``package.module:name``) and return the attribute."""
    module_name, sep, attr = dotted_path.replace(":", ".").rpartition(".")
    if not sep or not module_name or module_name.startswith("."):  # "." would import relative to nothing
        raise ValueError(f"{dotted_path!r} is not a dotted path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} for {dotted_path!r}: {error}") from None
    try:
        value: object = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(value):
        raise ValueError(f"{dotted_path!r} is not callable")
    return value


def registered(registry: Mapping[str, str], name: str, kind: str) -> Any:
    """The object registered as ``name``, imported now; ``ValueError`` (one line naming the
    known names) for an unknown one."""
    check_registered(registry, name, kind)
    return load_function(registry[name])


def check_registered(registry: Mapping[str, str], name: str, kind: str) -> None:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")


def registered_module(registry: Mapping[str, str], name: str) -> str:
    """The module ``registry`` names for ``name`` (``"module:Class"``), not imported."""
    return registry[name].partition(":")[0]
