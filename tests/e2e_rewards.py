"""Reward functions for end-to-end failure tests."""


def broken(prompt: str, response: str, label: str) -> float:
    raise ValueError("reward service unavailable")
