"""Reward functions for end-to-end failure tests."""


def broken(prompt: str, response: str, label: str) -> float:
    raise ValueError("reward service unavailable")


def nan_when_wrong(prompt: str, response: str, label: str) -> float:
    """Exact match, but NaN instead of 0 (a reward service that returns garbage)."""
    return 1.0 if response.strip() == label else float("nan")
