"""python -m miles_events.run cfg.toml [--set a.b=value ...] [--dry-run]

Exit codes: 0 the run completed (or was stopped on request), 1 the run failed, 2 the input
(config, data, model, a run.dir holding another run's checkpoints, a busy metrics port) is
wrong. A user's mistake gets one line naming what is wrong, no traceback; the input
(miles_events.app.preflight) and everything else a start can fail on
(miles_events.app.start_checks) are checked before anything is written, and --dry-run makes
exactly those checks. What the run's processes log goes to <run.dir>/run.log, and to the
terminal as well with --log-level.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import re
import signal
import sys
import threading
from typing import NoReturn

from miles_events.app.config import dump_config
from miles_events.app.logs import DriverLog, OpenRunLog
from miles_events.app.preflight import INPUT_ERRORS, load_and_check
from miles_events.runtime.malloc import cap_this_process
from miles_events.sinks.base import Sink, SinkContext
from miles_events.sinks.control.controller import MiniFtController
from miles_events.sinks.control.server import control_server
from miles_events.sinks.metrics import MetricsExporter, metrics_exporter
from schemas.config import Config


class ShowMetricsUrl(Sink):
    """Prints where the metrics are served, once the exporter serves (it starts first)."""

    name = "metrics-url"

    def __init__(self, exporter: MetricsExporter) -> None:
        self.exporter = exporter

    async def start(self, context: SinkContext) -> None:
        print(f"metrics: {self.exporter.url}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miles_events.run", description=__doc__.split("\n\n")[1])
    parser.add_argument("config", help="the run's TOML file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. run.num_rollout=3",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the input, print the resolved config and exit"
    )
    parser.add_argument(
        "--log-level",
        default=None,
        help="Python logging level of the run's processes, the driver's and each actor's: what they log at it and "
        "above goes to <run.dir>/run.log, and with this option (or $MILES_LOG_LEVEL) to the terminal as well "
        "(default: $MILES_LOG_LEVEL, else WARNING, in the file only)",
    )
    return parser.parse_args(argv)


_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
"""What ``str.splitlines`` breaks a line at."""


def error_line(error: BaseException) -> str:
    """``error: <message>`` as one line, whatever the input it quotes holds (a key or a path
    with a line break in it comes out escaped)."""
    message = _LINE_BREAKS.sub(lambda match: match.group().encode("unicode_escape").decode(), str(error))
    return f"error: {message}"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging(level: str | None) -> DriverLog:
    """The driver's log at ``level`` (else ``$MILES_LOG_LEVEL``, else WARNING): on the
    terminal only when one of those asks for it, into the run's log always. A level that
    is none of ``LOG_LEVELS`` is a ``ValueError``."""
    level = level or os.environ.get("MILES_LOG_LEVEL")
    name = (level or "WARNING").upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"--log-level: unknown level {level!r}; known: {', '.join(LOG_LEVELS)}")
    log = DriverLog(logging.getLevelName(name), terminal=level is not None)
    log.install()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return log


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` once ``main`` has returned: the run has shut down (its
    actors, Ray, its sinks, the event log closed), so Python's exit handlers run and the
    streams are flushed, but the interpreter's teardown, a full garbage collection of
    everything torch and the actors built (1-2 s, more on a busy host), is skipped. Where a
    thread of ours is still running, the ordinary exit waits for it."""
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # logging's shutdown among them
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a reader that went away, a stream closed
        pass
    os._exit(code)


def _abort(signum: int, frame: object) -> None:
    # Once: the shutdown that follows (Ray's included) must not be interrupted again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    cap_this_process()  # before the run's threads allocate
    args = parse_args(argv)
    try:
        log = configure_logging(args.log_level)
    except ValueError as error:
        print(error_line(error), file=sys.stderr)
        return 2
    # Until the run's loop takes signals over (the first then stops after the current step),
    # SIGTERM aborts as Ctrl-C does: whatever has started is shut down, exit 130.
    signal.signal(signal.SIGTERM, _abort)
    try:
        return _run(args, log)
    except KeyboardInterrupt:
        print("error: aborted", file=sys.stderr)
        return 130
    finally:
        log.remove()


def make_sinks(config: Config, log: DriverLog | None = None) -> list[Sink]:
    """The run's sinks besides the event log: the run's log file (opened once the run has its
    directory), tracking, the metrics exporter (and where it serves), the control server,
    the console."""
    from miles_events.sinks.console import make_console
    from miles_events.sinks.tracking import make_tracking

    sinks: list[Sink] = [OpenRunLog(log)] if log is not None else []
    # Tracking first: a tracking error must not leave a live display on the screen.
    sinks.extend(make_tracking(config))
    exporter = metrics_exporter(config)
    if exporter is not None:
        sinks.append(exporter)
        if config.console.mode != "quiet":
            sinks.append(ShowMetricsUrl(exporter))
    control = control_server(config)
    if control is not None:
        sinks.append(control)
        if config.run.mini_ft_controller:
            sinks.append(MiniFtController(config, lambda: control.url, control.token))
    sinks.append(make_console(config))
    return sinks


def _run(args: argparse.Namespace, log: DriverLog) -> int:
    from miles_events.app.start_checks import START_ERRORS, check_start

    try:
        config = load_and_check(args.config, args.overrides)
        if args.dry_run:
            # The run's own start-up checks, then nothing: what they hold is given back.
            check_start(config, make_sinks(config), run_id="dry-run").release()
            sys.stdout.write(dump_config(config))
            return 0
    except (*INPUT_ERRORS, *START_ERRORS) as error:
        print(error_line(error), file=sys.stderr)
        return 2

    from miles_events.app.roster import ACTORS
    from miles_events.app.run_dir import event_log_path
    from miles_events.app.session import Session

    try:
        session = Session(config, list(ACTORS), sinks=make_sinks(config, log))
        # A sink that passed its checks can still fail to start (wandb's server unreachable):
        # the run is recorded as failed, and the same one line is printed.
        result = asyncio.run(session.run())
    except START_ERRORS as error:
        print(error_line(error), file=sys.stderr)
        return 2
    finished = result.finished
    if config.console.mode != "quiet":
        print(f"events: {event_log_path(result.run_dir)}  ({result.seconds:.1f}s)")
    if finished.status == "failed":
        where = f" (log: {log.path})" if log.path is not None else ""
        print(f"error: run failed: {finished.reason}{where}", file=sys.stderr)
        return 1
    return 0
