"""Reward functions for tests of failures: at start-up and in a run."""


def broken(prompt: str, response: str, label: str) -> float:
    raise ValueError("reward service unavailable")


def nan_when_wrong(prompt: str, response: str, label: str) -> float:
    """Exact match, but NaN instead of 0 (a reward service that returns garbage)."""
    return 1.0 if response.strip() == label else float("nan")


def starts_with_one(prompt: str, response: str, label: str) -> float:
    """Credit for an answer that starts with "1": one token's choice, which a tiny model
    learns within a few rollouts whatever the prompt."""
    return 1.0 if response.strip().startswith("1") else 0.0


_calls = 0


def broken_after_the_first_call(prompt: str, response: str, label: str) -> float:
    """A reward service that answers once (the check before the run starts) and then fails."""
    global _calls
    _calls += 1
    if _calls > 1:
        raise ValueError("reward service unavailable")
    return 0.0


def two_arguments(prompt: str, response: str) -> float:
    """The wrong signature: the label is left out."""
    return 0.0


def text(prompt: str, response: str, label: str) -> str:
    """A number as text: ``float`` read it, so it passed unnoticed."""
    return "1.0"


def nan(prompt: str, response: str, label: str) -> float:
    return float("nan")


def true_when_right(prompt: str, response: str, label: str) -> bool:
    """A bool is a number (0 or 1)."""
    return response.strip() == label.strip()


def row_weight(prompt: str, response: str, label: str, *, row: dict[str, object]) -> float:
    """The row's ``weight`` column, whatever the response: a run's rewards show the row
    reached the reward function."""
    weight = row["weight"]
    assert isinstance(weight, float)
    return weight
