"""Periodic py-spy dumps (``MILES_DEBUG_PYSPY_DUMP_INTERVAL``): the driver and every actor
process, ``--native`` first, each bounded, one error line without py-spy."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from miles_events.app.pyspy import PeriodicPySpyDump, PySpyError, find_py_spy, interval_from_env
from miles_events.bus.clock import ManualClock


def test_the_interval_comes_from_the_environment():
    assert interval_from_env({}) is None
    assert interval_from_env({"MILES_DEBUG_PYSPY_DUMP_INTERVAL": ""}) is None
    assert interval_from_env({"MILES_DEBUG_PYSPY_DUMP_INTERVAL": "2.5"}) == 2.5
    for bad in ("soon", "0", "-1", "inf"):
        with pytest.raises(PySpyError, match="MILES_DEBUG_PYSPY_DUMP_INTERVAL"):
            interval_from_env({"MILES_DEBUG_PYSPY_DUMP_INTERVAL": bad})


def fake_py_spy(tmp_path: Path) -> str:
    """A py-spy that refuses --native (no native symbols) and dumps otherwise."""
    script = tmp_path / "py-spy"
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--native*) echo "Error: native unwinding unsupported" >&2; exit 1;; esac\n'
        'echo "Thread 1 (idle): MainThread of $3"\n'
    )
    script.chmod(0o755)
    return str(script)


async def test_a_dump_falls_back_to_no_native_and_writes_one_file_per_process(tmp_path):
    dumper = PeriodicPySpyDump(
        1.0, lambda: [("driver", 11), ("trainer", 22)], tmp_path / "out", py_spy=fake_py_spy(tmp_path)
    )
    written = await dumper.dump_once()
    assert [p.name.split("-", 1)[1] for p in written] == ["driver-11.txt", "trainer-22.txt"]
    assert written[1].read_text() == "Thread 1 (idle): MainThread of 22\n"


async def test_dumps_repeat_every_interval_on_the_clock(tmp_path):
    clock = ManualClock()
    dumper = PeriodicPySpyDump(30.0, lambda: [("driver", 11)], tmp_path, clock, py_spy=fake_py_spy(tmp_path))
    task = asyncio.create_task(dumper.run())
    await clock.advance(29)
    assert dumper.dumps == []
    await clock.advance(1)
    for _ in range(50):
        if dumper.dumps:
            break
        await asyncio.sleep(0.02)
    assert len(dumper.dumps) == 1
    task.cancel()


async def test_without_py_spy_there_is_one_error_line_and_no_dump(tmp_path, caplog):
    dumper = PeriodicPySpyDump(1.0, lambda: [("driver", 11)], tmp_path, py_spy=None)
    dumper.py_spy = None
    with caplog.at_level(logging.ERROR):
        await asyncio.wait_for(dumper.run(), 1)
    assert "py-spy is not installed" in caplog.text and dumper.dumps == []


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
async def test_a_real_dump_shows_the_stack_of_a_live_process(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()"]
    )
    try:
        await asyncio.sleep(1.0)
        dumper = PeriodicPySpyDump(1.0, lambda: [("child", child.pid)], tmp_path)
        [dump] = await dumper.dump_once()
        assert "waiting_here" in dump.read_text()
    finally:
        child.kill()
