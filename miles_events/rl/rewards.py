"""Reward functions, loaded by dotted path from ``rollout.reward_fn`` (``rl.registry``).

A reward function is ``fn(prompt: str, response: str, label: str) -> float``; one that also
declares a parameter ``row`` (``fn(prompt, response, label, *, row)``) is given the data
file's whole row too, as a dict of every column (a difficulty level, test cases, ...).
``prompt`` is the text the engine was given (the chat template applied, where it is).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[..., float]


def takes_row(fn: Callable[..., object]) -> bool:
    """Whether the reward function declares ``row`` (by keyword)."""
    try:
        parameter = inspect.signature(fn).parameters.get("row")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def reward_of(fn: RewardFn, prompt: str, response: str, label: str, row: Mapping[str, Any]) -> Any:
    """``fn``'s reward for a response, given the row where it takes one."""
    if takes_row(fn):
        return fn(prompt, response, label, row=dict(row))
    return fn(prompt, response, label)


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


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(response: str) -> str | None:
    """The answer a reply gives: the last number inside its last ``\\boxed{...}``, else its
    last number (thousands' commas dropped); None when it has none."""
    boxed = _BOXED.findall(response)
    text = boxed[-1] if boxed else response
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


def math_answer(prompt: str, response: str, label: str) -> float:
    """1.0 when the reply's final answer (``final_answer``) equals the label as a number
    (``12`` and ``12.0`` alike)."""
    answer = final_answer(response)
    if answer is None:
        return 0.0
    try:
        return float(float(answer) == float(label.strip().replace(",", "")))
    except ValueError:
        return 0.0
