"""The run's log: the driver's lines held until the run has its directory, then in
``<run.dir>/run.log`` beside each actor process's; on the terminal only when asked for; a
log that cannot be written never reaches the terminal."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from miles_events.app.logs import DriverLog
from miles_events.app.run import configure_logging
from miles_events.runtime.run_log import RunLogFile, log_into

logger = logging.getLogger("tests.run_log")


@pytest.fixture
def driver_log():
    made: list[DriverLog] = []

    def make(level: int = logging.WARNING, terminal: bool = False) -> DriverLog:
        log = DriverLog(level, terminal)
        log.install()
        made.append(log)
        return log

    yield make
    for log in made:
        log.remove()


def test_what_the_driver_logs_before_the_run_has_its_directory_is_written_once_it_has(
    driver_log, tmp_path, capfd
):
    log = driver_log()
    logger.warning("a checkpoint is set aside")
    logger.info("below the level")
    assert not (tmp_path / "run.log").exists(), "nothing is written before the run takes its directory"
    log.open(tmp_path, "run-1")
    logger.error("the generator is gone")
    lines = (tmp_path / "run.log").read_text().splitlines()
    assert lines[0].endswith("run run-1: what the driver and each actor process log at WARNING and above")
    assert [line.split("] ", 1)[1] for line in lines[1:]] == [
        "tests.run_log: a checkpoint is set aside",
        "tests.run_log: the generator is gone",
    ]
    assert " WARNING [driver pid " in lines[1]
    assert log.path == tmp_path / "run.log"
    assert capfd.readouterr() == ("", ""), "nothing on the terminal"


def test_the_terminal_shows_the_log_only_when_a_level_is_asked_for(driver_log, capfd):
    driver_log(logging.INFO, terminal=True)
    logger.info("asked for")
    assert capfd.readouterr().err.endswith("INFO tests.run_log: asked for\n")


def test_a_run_that_logged_nothing_names_no_log(driver_log, tmp_path):
    log = driver_log()
    log.open(tmp_path, "run-1")
    assert log.path is None


def test_python_warnings_go_to_the_run_log(driver_log, tmp_path, capfd):
    driver_log().open(tmp_path, "run-1")
    warnings.warn("a library's complaint", UserWarning, stacklevel=1)
    assert "a library's complaint" in (tmp_path / "run.log").read_text()
    assert capfd.readouterr().err == ""


def test_a_run_log_on_a_full_disk_loses_the_record_and_prints_nothing(capfd):
    handler = RunLogFile(Path("/dev/full"), "driver", logging.WARNING)  # every write: ENOSPC
    try:
        handler.handle(logging.makeLogRecord({"msg": "lost", "levelno": logging.ERROR, "levelname": "ERROR"}))
    finally:
        handler.close()
    assert handler.written == 0
    assert capfd.readouterr() == ("", "")


def test_a_run_log_that_cannot_be_created_prints_nothing(tmp_path, capfd):
    handler = RunLogFile(tmp_path / "gone" / "run.log", "driver", logging.WARNING)
    handler.handle(logging.makeLogRecord({"msg": "lost", "levelno": logging.ERROR, "levelname": "ERROR"}))
    handler.close()
    assert handler.written == 0
    assert capfd.readouterr() == ("", "")


def test_an_actor_process_logs_into_the_run_log_naming_itself(tmp_path):
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        handler = log_into(tmp_path, logging.INFO, "generator")
        logger.info("generating")
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(before[1])
        logging.captureWarnings(False)
    assert root.handlers == before[0]
    (line,) = (tmp_path / "run.log").read_text().splitlines()
    assert " INFO [generator pid " in line and line.endswith("] tests.run_log: generating")


def test_an_unknown_log_level_is_refused(monkeypatch):
    monkeypatch.delenv("MILES_LOG_LEVEL", raising=False)
    with pytest.raises(
        ValueError, match=r"--log-level: unknown level 'loud'; known: DEBUG, INFO, WARNING, ERROR, CRITICAL"
    ):
        configure_logging("loud")
