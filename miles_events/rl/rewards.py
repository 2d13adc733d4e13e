"""Reward functions (loaded by dotted path from ``rollout.reward_fn``) and the loader.

A reward function is ``fn(prompt: str, response: str, label: str) -> float``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

RewardFn = Callable[[str, str, str], float]


def load_function(dotted_path: str) -> Callable[..., Any]:
    """Import ``package.module.name`` (or ``package.module:name``) and return the attribute."""
    module_name, sep, attr = dotted_path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"{dotted_path!r} is not a dotted path like 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} for {dotted_path!r}: {error}") from None
    try:
        value = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(value):
        raise ValueError(f"{dotted_path!r} is not callable")
    return value


def exact_match(prompt: str, response: str, label: str) -> float:
    """1.0 when the response, stripped, is exactly the label."""
    return float(response.strip() == label.strip())


_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")


def leading_number(prompt: str, response: str, label: str) -> float:
    """1.0 when the first number in the response equals the label (``7=`` answers ``7``)."""
    match = _LEADING_NUMBER.match(response)
    return float(match is not None and match.group(1) == label.strip())


def first_char(prompt: str, response: str, label: str) -> float:
    """1.0 when the response begins with the label's first character (one-token answers)."""
    label = label.strip()
    return float(bool(label) and response.startswith(label))
