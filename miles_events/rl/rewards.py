"""Reward functions, loaded by dotted path from ``rollout.reward_fn`` (``rl.registry``).

A reward function is ``fn(prompt: str, response: str, label: str) -> float``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[[str, str, str], float]


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
