"""torch threads per phase: the working actor takes the cores, and gives them back."""

from __future__ import annotations

import pytest
import torch

from miles_events.device import threads
from miles_events.device.threads import phase_thread_count, phase_threads


def test_a_phase_takes_every_core_unless_configured_and_restores_the_previous_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with phase_threads(0) as count:
            assert count == 2 and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with phase_threads(1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)


def test_engines_of_one_process_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    assert [phase_thread_count(0, sharers) for sharers in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert phase_thread_count(3, sharers=2) == 3  # a configured count is taken as it is


def test_a_phase_that_raises_still_restores_the_count() -> None:
    previous = torch.get_num_threads()
    with pytest.raises(RuntimeError), phase_threads(previous + 1):
        raise RuntimeError("failed mid-phase")
    assert torch.get_num_threads() == previous
