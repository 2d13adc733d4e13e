"""A run directory: where a run's files live, and taking it for one run.

<run.dir>/events.log               every event of every run in this directory
<run.dir>/configs/<run_id>.toml    the resolved config of each run
<run.dir>/base_model/              the built-in model, when used
<run.dir>/checkpoints/             see ``miles_events.checkpoint``
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from miles_events.bus.event_log import EventLogWriter, check_appendable
from miles_events.util.file_modes import why_unwritable

logger = logging.getLogger(__name__)

EVENT_LOG = "events.log"
CONFIGS_DIR = "configs"


class RunDirError(ValueError):
    """The run directory cannot be used; one line says why."""


def event_log_path(run_dir: Path) -> Path:
    return run_dir / EVENT_LOG


def run_config_path(run_dir: Path, run_id: str) -> Path:
    return run_dir / CONFIGS_DIR / f"{run_id}.toml"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def check_usable(run_dir: Path) -> None:
    """What ``open_event_log`` would refuse, asked without writing anything: a directory that
    cannot be created or written, an ``events.log`` that is not one, or one another run holds."""
    reason = why_unwritable(run_dir)
    if reason is not None:
        raise RunDirError(f"run.dir {run_dir}: cannot write there: {reason}")
    try:
        check_appendable(event_log_path(run_dir))
    except OSError as error:
        raise RunDirError(
            f"run.dir {run_dir}: {error.filename or event_log_path(run_dir)}: {error.strerror or error}"
        ) from None
    except RuntimeError as error:  # the log's lock is held
        raise RunDirError(f"run.dir {run_dir} is in use by another run ({error})") from None
    except ValueError as error:  # not an event log
        raise RunDirError(f"run.dir {run_dir}: {error}") from None


def open_event_log(run_dir: Path) -> EventLogWriter:
    """Create the run directory and take its event log: first, so that a directory that
    cannot be used, or is in use by another run, fails before anything is written. A torn
    tail is repaired (kept beside the log); damage in the middle is left in place. Each is
    logged as a warning."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        writer = EventLogWriter(event_log_path(run_dir), repair=True)
    except OSError as error:
        raise RunDirError(f"run.dir {run_dir}: {error.strerror or error}") from None
    except RuntimeError as error:  # the log's lock is held
        raise RunDirError(f"run.dir {run_dir} is in use by another run ({error})") from None
    except ValueError as error:  # not an event log
        raise RunDirError(f"run.dir {run_dir}: {error}") from None
    for damage in writer.damaged:
        logger.warning(
            "%s: bytes %d..%d are damaged (%s); the records after them are kept",
            writer.path,
            damage.start,
            damage.end,
            damage.reason,
        )
    if writer.torn_copy is not None:
        logger.warning(
            "%s ended in a torn record (a crash?); its bytes are kept in %s", writer.path, writer.torn_copy
        )
    return writer
