"""Reward functions for end-to-end failure tests."""


def broken(prompt: str, response: str, label: str) -> float:
    raise ValueError("reward service unavailable")


def nan_when_wrong(prompt: str, response: str, label: str) -> float:
    """Exact match, but NaN instead of 0 (a reward service that returns garbage)."""
    return 1.0 if response.strip() == label else float("nan")


def first_character(prompt: str, response: str, label: str) -> float:
    """Credit for the first character of the answer only: a signal a tiny model picks up
    within a few rollouts (about half the sums of two digits start with 1)."""
    answer = response.strip()
    return 1.0 if answer[:1] == label[:1] else 0.0
