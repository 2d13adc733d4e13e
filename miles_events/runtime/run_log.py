"""A run's Python log: ``<run.dir>/run.log``, one file for the driver and every actor process.

The terminal shows the console and, when the run fails, one ``error:`` line. What the
run's processes log (warnings, errors with their detail, and what ``--log-level`` asks for)
is appended to this file instead, each line naming its process: ``[driver pid 41]``,
``[generator pid 57]``, ``[rank 1 pid 60]``. The file is written as the terminal would be:
a write that fails (a full disk, a directory removed) loses that record and nothing else;
the run goes on and the terminal stays clean.
"""

from __future__ import annotations

import logging
from pathlib import Path

RUN_LOG = "run.log"
FILE_FORMAT = "%(asctime)s %(levelname)s [{tag} pid %(process)d] %(name)s: %(message)s"
"""A line of the run's log: ``{tag}`` names the process (the driver, an actor, a rank)."""


def run_log_path(run_dir: Path) -> Path:
    return Path(run_dir) / RUN_LOG


class RunLogFile(logging.FileHandler):
    """Appends to a run's log (opened at the first record); ``written`` counts the records
    it wrote."""

    def __init__(self, path: Path, tag: str, level: int) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.setLevel(level)
        self.setFormatter(logging.Formatter(FILE_FORMAT.format(tag=tag.replace("%", "%%"))))
        self.written = 0
        self._lost = False

    def emit(self, record: logging.LogRecord) -> None:
        self._lost = False
        try:
            super().emit(record)  # opening the file, at the first record, can fail too
        except OSError:
            self._lost = True
        if not self._lost:
            self.written += 1

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # what was buffered cannot be written either
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        """The record is lost; unlike logging's default, nothing is printed to stderr."""
        self._lost = True


def log_into(run_dir: Path, level: int, tag: str) -> RunLogFile:
    """This process (an actor's, a rank's) logs at ``level`` into the run's log and
    nowhere else; Python's warnings with it."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, RunLogFile)]:
        root.removeHandler(handler)
        handler.close()
    handler = RunLogFile(run_log_path(run_dir), tag, level)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler
