"""python -m miles_events.run cfg.toml [--set a.b=value ...] [--dry-run]

Exit codes: 0 the run completed (or was stopped on request), 1 the run failed, 2 the input
(config, data, model, a run.dir holding another run's checkpoints, a busy metrics port) is
wrong. A user's mistake gets one line naming what is wrong, no traceback; the input
(miles_events.app.preflight) and everything else a start can fail on
(miles_events.app.start_checks) are checked before anything is written, and --dry-run makes
exactly those checks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from miles_events.app.config import dump_config
from miles_events.app.preflight import INPUT_ERRORS, load_and_check
from miles_events.runtime.base import LOG_FORMAT
from miles_events.runtime.malloc import cap_this_process
from miles_events.sinks.base import Sink, SinkContext
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
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a key, e.g. run.num_rollout=3"
    )
    parser.add_argument("--dry-run", action="store_true", help="check the input, print the resolved config and exit")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("MILES_LOG_LEVEL", "WARNING"),
        help="Python logging level of the run's log, the driver's and each actor process's (default: $MILES_LOG_LEVEL, else WARNING)",
    )
    return parser.parse_args(argv)


_LINE_BREAKS = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
"""What ``str.splitlines`` breaks a line at."""


def error_line(error: BaseException) -> str:
    """``error: <message>`` as one line, whatever the input it quotes holds (a key or a path
    with a line break in it comes out escaped)."""
    message = _LINE_BREAKS.sub(lambda match: match.group().encode("unicode_escape").decode(), str(error))
    return f"error: {message}"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _abort(signum: int, frame: object) -> None:
    # Once: the shutdown that follows (Ray's included) must not be interrupted again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    cap_this_process()  # before the run's threads allocate
    args = parse_args(argv)
    configure_logging(args.log_level)
    # Until the run's loop takes signals over (the first then stops after the current step),
    # SIGTERM aborts as Ctrl-C does: whatever has started is shut down, exit 130.
    signal.signal(signal.SIGTERM, _abort)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("error: aborted", file=sys.stderr)
        return 130


def make_sinks(config: Config) -> list[Sink]:
    """The run's sinks besides the event log: tracking, the metrics exporter (and where it
    serves), the console."""
    from miles_events.sinks.console import make_console
    from miles_events.sinks.tracking import make_tracking

    # Tracking first: a tracking error must not leave a live display on the screen.
    sinks: list[Sink] = [*make_tracking(config)]
    exporter = metrics_exporter(config)
    if exporter is not None:
        sinks.append(exporter)
        if config.console.mode != "quiet":
            sinks.append(ShowMetricsUrl(exporter))
    sinks.append(make_console(config))
    return sinks


def _run(args: argparse.Namespace) -> int:
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
        session = Session(config, list(ACTORS), sinks=make_sinks(config))
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
        print(f"error: run failed: {finished.reason}", file=sys.stderr)
        return 1
    return 0
