"""Reward functions for end-to-end failure tests."""


def broken(prompt: str, response: str, label: str) -> float:
    raise ValueError("reward service unavailable")


def nan_when_wrong(prompt: str, response: str, label: str) -> float:
    """Exact match, but NaN instead of 0 (a reward service that returns garbage)."""
    return 1.0 if response.strip() == label else float("nan")


def starts_with_one(prompt: str, response: str, label: str) -> float:
    """Credit for an answer that starts with "1": one token's choice, which a tiny model
    learns within a few rollouts whatever the prompt."""
    return 1.0 if response.strip().startswith("1") else 0.0
