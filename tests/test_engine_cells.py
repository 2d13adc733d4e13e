"""The Generator's engines as cells: restart limits and backoff, and who samples for a
suspended engine."""

from __future__ import annotations

import signal

import pytest

from actors.engine.cells import CellState, EngineCell, stand_in
from actors.protocols.healing import FAULT_SIGNALS, RestartsSpent, check_restart, restart_backoff
from schemas.config import ControlConfig


def test_the_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    control = ControlConfig(restart_backoff_seconds=1.0, restart_backoff_max_seconds=5.0)
    assert [restart_backoff(n, control) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_restarts_past_the_limit_are_one_line_naming_the_cell_and_the_setting() -> None:
    control = ControlConfig(max_restarts=2)
    assert check_restart("rollout-1 (engine-1)", 0, control, "died") == 1
    assert check_restart("rollout-1 (engine-1)", 1, control, "died") == 2
    with pytest.raises(
        RestartsSpent,
        match=r"rollout-1 \(engine-1\) failed again after 2 restarts \(control.max_restarts = 2\): died",
    ):
        check_restart("rollout-1 (engine-1)", 2, control, "died")


def test_a_suspended_engine_is_stood_in_for_by_the_next_running_one() -> None:
    cells = [EngineCell(i, f"engine-{i}") for i in range(3)]
    cells[1].state = CellState.SUSPENDED
    assert stand_in(cells, 1) == 2
    cells[2].state = CellState.SUSPENDED
    assert stand_in(cells, 1) == 0 and stand_in(cells, 2) == 0
    cells[0].state = CellState.SUSPENDED
    assert stand_in(cells, 0) is None


def test_each_fault_mode_is_its_signal() -> None:
    assert FAULT_SIGNALS == {
        "sigkill": signal.SIGKILL,
        "exit": signal.SIGTERM,
        "segfault": signal.SIGSEGV,
        "deadlock": signal.SIGSTOP,
    }
