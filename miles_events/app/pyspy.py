"""Periodic py-spy stack dumps of the driver and every actor process, for runs that hang.

Off unless ``MILES_DEBUG_PYSPY_DUMP_INTERVAL`` is a number of seconds. Every interval each
process is dumped with ``py-spy dump --native --pid P`` (again without ``--native`` where
that fails, e.g. without native symbols), each call bounded by 60 s, into
``<run dir>/pyspy/<unix time>-<name>-<pid>.txt``, with one log line per dump. Without py-spy
installed there is one error line and no dumps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from miles_events.bus.clock import SYSTEM_CLOCK, Clock

logger = logging.getLogger(__name__)

INTERVAL_ENV = "MILES_DEBUG_PYSPY_DUMP_INTERVAL"
DUMP_TIMEOUT = 60.0


class PySpyError(ValueError):
    """``MILES_DEBUG_PYSPY_DUMP_INTERVAL`` is not a positive number of seconds."""


def interval_from_env(environ: dict[str, str] | None = None) -> float | None:
    """The dump interval in seconds, or None when dumps are off (unset or empty)."""
    value = (environ if environ is not None else os.environ).get(INTERVAL_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise PySpyError(f"{INTERVAL_ENV}={value!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise PySpyError(f"{INTERVAL_ENV}={value!r} must be a positive number of seconds")
    return seconds


def find_py_spy() -> str | None:
    """``py-spy`` on the PATH, or beside this Python (a virtual environment's bin)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


async def _run(command: list[str], timeout: float) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        return -1, f"py-spy did not answer within {timeout:g}s"
    except BaseException:
        # The run ended mid-dump: leave no py-spy behind.
        process.kill()
        raise
    return process.returncode or 0, output.decode(errors="replace")


class PeriodicPySpyDump:
    """Dumps ``processes()`` (name, pid) every ``interval`` seconds until cancelled."""

    def __init__(
        self,
        interval: float,
        processes: Callable[[], list[tuple[str, int]]],
        out_dir: Path,
        clock: Clock = SYSTEM_CLOCK,
        py_spy: str | None = None,
        timeout: float = DUMP_TIMEOUT,
    ) -> None:
        self.interval = interval
        self.processes = processes
        self.out_dir = out_dir
        self.clock = clock
        self.py_spy = py_spy if py_spy is not None else find_py_spy()
        self.timeout = timeout
        self.dumps: list[Path] = []

    async def dump_once(self) -> list[Path]:
        """One dump of every process; returns the files written."""
        if self.py_spy is None:
            return []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name, pid in self.processes():
            code, text = await _run([self.py_spy, "dump", "--native", "--pid", str(pid)], self.timeout)
            if code != 0:
                code, text = await _run([self.py_spy, "dump", "--pid", str(pid)], self.timeout)
            path = self.out_dir / f"{int(time.time())}-{name}-{pid}.txt"
            path.write_text(text)
            written.append(path)
            if code == 0:
                logger.warning("py-spy dump of %s (pid %d): %s", name, pid, path)
            else:
                logger.error(
                    "py-spy could not dump %s (pid %d): %s", name, pid, text.strip().splitlines()[-1:] or ""
                )
        self.dumps += written
        return written

    async def run(self) -> None:
        if self.py_spy is None:
            logger.error(
                "%s is set but py-spy is not installed (pip install py-spy): no stack dumps", INTERVAL_ENV
            )
            return
        while True:
            await self.clock.sleep(self.interval)
            try:
                await self.dump_once()
            except Exception:
                # Diagnostics must never cost the run.
                logger.exception("py-spy dumps failed")
