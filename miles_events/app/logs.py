"""The driver's Python log, for ``python -m miles_events.run``.

On the terminal only when ``--log-level`` (or ``MILES_LOG_LEVEL``) asks for it; always in
the run's log (``<run.dir>/run.log``, ``miles_events.runtime.run_log``) once the run has
taken its directory. What is logged before that (the start-up checks write nothing) is
held until then, and dropped by a run that never gets that far: its one ``error:`` line
says what is wrong.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from pathlib import Path

from miles_events.runtime.base import LOG_FORMAT
from miles_events.runtime.run_log import RunLogFile, run_log_path
from miles_events.sinks.base import Sink, SinkContext

HELD_RECORDS = 10_000
"""Records held before the run log opens, at most (the oldest go first)."""


class HeldRecords(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: deque[logging.LogRecord] = deque(maxlen=HELD_RECORDS)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class DriverLog:
    """The root logger's handlers for one run of the CLI: ``install`` them, ``open`` the
    run's log once its directory is taken, ``remove`` them at the end."""

    def __init__(self, level: int, terminal: bool) -> None:
        self.level = level
        self.held: HeldRecords | None = HeldRecords(level)
        self.terminal: logging.Handler | None = None
        if terminal:
            self.terminal = logging.StreamHandler(sys.stderr)
            self.terminal.setLevel(level)
            self.terminal.setFormatter(logging.Formatter(LOG_FORMAT))
        self.file: RunLogFile | None = None
        self._previous_level = logging.WARNING

    def install(self) -> None:
        root = logging.getLogger()
        self._previous_level = root.level
        root.setLevel(self.level)
        for handler in (self.held, self.terminal):
            if handler is not None:
                root.addHandler(handler)
        logging.captureWarnings(True)

    def open(self, run_dir: Path, run_id: str) -> None:
        """From now on the driver logs into ``<run_dir>/run.log``, beginning with what was held."""
        if self.file is not None:
            return
        root = logging.getLogger()
        self.file = RunLogFile(run_log_path(run_dir), "driver", self.level)
        header = logging.LogRecord(
            "miles_events", logging.INFO, __file__, 0,
            "run %s: what the driver and each actor process log at %s and above", (run_id, logging.getLevelName(self.level)),
            None,
        )  # fmt: skip
        self.file.handle(header)  # whatever the level: where each run's lines begin
        self.file.written = 0
        if self.held is not None:
            root.removeHandler(self.held)
            for record in self.held.records:
                if record.levelno >= self.level:
                    self.file.handle(record)
            self.held = None
        root.addHandler(self.file)

    @property
    def path(self) -> Path | None:
        """The run's log, once the run has logged anything into it."""
        if self.file is None or not self.file.written:
            return None
        return Path(self.file.baseFilename)

    def remove(self) -> None:
        root = logging.getLogger()
        for handler in (self.held, self.terminal, self.file):
            if handler is not None:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(self._previous_level)
        logging.captureWarnings(False)


class OpenRunLog(Sink):
    """Opens the run's log as the run starts: sinks start once the run has its directory."""

    name = "run-log"

    def __init__(self, log: DriverLog) -> None:
        self.driver_log = log

    async def start(self, context: SinkContext) -> None:
        self.driver_log.open(context.run_dir, context.run_id)
