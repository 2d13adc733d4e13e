"""Print a run's event log: ``python -m miles_events.replay LOG [options]``.

One line per event: ``seq  time  source  type  key=value ...`` (``--json``: one JSON object
per line, its type under ``"type"``). Long values are abbreviated, except what says why
something failed (reasons, errors, messages, tracebacks, and every field of an event that
reports a failure), which is printed whole: a traceback, and a mismatch's list of tensors,
on lines of their own indented under the event. Filters combine with AND; a filter given several
times (or with commas) matches any of its values. ``--rollout-id N`` selects every event of
rollout N, those that answer its events included (``RolloutTracker``). A ``--source`` that
no event of the log comes from, and a negative ``--rollout-id``, are errors; filters that
select nothing (a rollout the log does not reach) print a one-line note on stderr, status 0.
``LOG`` may also be a run directory holding ``events.log``.

``--plot OUT`` draws the log's runs into one figure (``miles_events.app.plot``): mean reward,
evaluation scores, KL, response length and time per rollout over the rollout id; OUT's
extension picks the format. ``--samples [ROLLOUT_ID|all]`` prints the prompts, responses and
rewards a rollout and its evaluation kept (``rollout.log_samples``; the last rollout by
default; ``miles_events.app.replay_samples``). Neither takes the filters. A torn tail is a
warning for ``--plot`` (it draws what was read), exit 1 for ``--samples`` after printing;
an OUT whose directory is missing or cannot be written in, or whose extension matplotlib
does not write, is refused before the log is read.

Damage in the middle of the log (valid records after it) is skipped: every readable record
is printed, and one warning line per damaged byte range goes to stderr (``replay: warning:
LOG: bytes START..END damaged, skipped (REASON)``, END exclusive).

Exit status: 0 when the log was read to its end (damaged ranges skipped included); 1 when
it ends in a torn record (every readable record before it is printed first, then one line
on stderr names its byte offset); 2 for a missing file, a directory without ``events.log``,
a file that is not an event log or cannot be read, or bad arguments (each one line on
stderr). ``--redrive`` re-drives what is readable: a torn tail is a warning there, and
its status is 0 when every decision matches, 1 when one differs or nothing was readable.
For each run it first names the config used and, when that is not the run's recorded
``configs/<run_id>.toml``, the keys in which the two differ (recorded -> used); then one
verdict line per actor.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import msgspec

from miles_events.app.replay_samples import SamplesChoice, parse_choice
from miles_events.app.run_dir import EVENT_LOG, event_log_path, run_config_path
from miles_events.bus.codec import event_to_json_bytes
from miles_events.bus.errors import describe_error
from miles_events.bus.event_log import (
    DamagedRange,
    NotAnEventLogError,
    OnDamage,
    TornRecordError,
    read_events,
)
from schemas.config import Config
from schemas.data import DataRef
from schemas.events import (
    EVENT_TYPES_BY_NAME,
    ActorFailed,
    DataReleased,
    Event,
    RunStarted,
    WeightsLoaded,
    WeightsStaged,
)

_HEADER_FIELDS = frozenset(("run_id", "seq", "time", "source"))
_MAX_TEXT = 48
_WHOLE_FIELDS = frozenset(("reason", "error", "traceback", "message"))
"""Text that says why something failed: never cut, in any event and at any depth."""
_FAILURES = frozenset(
    (
        "ActorFailed",
        "PublicationFailed",
        "PublicationMismatch",
        "PublicationEvidenceFailed",
        "CheckpointFailed",
    )
)
"""Events that report a failure: every field printed whole (no text cut, nothing counted)."""
_BLOCK_INDENT = " " * 8
_KEPT_SAMPLES = "samples"
"""The field of the samples a rollout or an evaluation kept: counted on the event's line
(``--samples`` prints them), left out when empty."""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (``replay: ... (see --help)``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"replay: {message} (see --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The replay command line (kept separate so that more options can join it)."""
    parser = _Parser(
        prog="python -m miles_events.replay",
        description="Print the events of a miles-events event log.",
        epilog="A --source that no event of the log comes from, or a negative --rollout-id, is an "
        "error; filters that select nothing (a rollout the log does not reach) print a note on "
        "stderr. Exit status: 0 read to the end, 1 the log ends in a torn record (or --redrive "
        "found a different decision), 2 a path or argument that cannot be used.",
    )
    parser.add_argument("log", metavar="LOG", help=f"an event log, or a run directory with {EVENT_LOG}")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--type",
        dest="types",
        action="append",
        default=[],
        metavar="T",
        help="only events of this type (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--source",
        dest="sources",
        action="append",
        default=[],
        metavar="S",
        help="only events from this actor (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--rollout-id",
        type=int,
        default=None,
        metavar="N",
        help="only the events of rollout N: its eval, generation and train step, the publication "
        "and save it triggered (each engine's load included), and the data releases and actor "
        "failures that follow them",
    )
    parser.add_argument(
        "--redrive",
        action="append",
        default=[],
        metavar="ACTOR",
        help="re-drive this actor (coordinator, verifier, publisher) from the log and check that "
        "it makes the recorded decisions (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="the run's config for --redrive (default: configs/<run_id>.toml beside the log); "
        "the keys in which it differs from that recorded one are named before the verdicts",
    )
    parser.add_argument(
        "--serve-metrics",
        type=int,
        default=None,
        metavar="PORT",
        help="rebuild the Prometheus metrics of every run in the log and serve them at "
        "http://HOST:PORT/metrics until interrupted (0 picks a free port; filters are ignored)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="H",
        help="the address --serve-metrics listens on (default 127.0.0.1)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="OUT",
        help="draw the log's runs into OUT (its extension picks the format: .png, .svg, .pdf, ...): "
        "mean reward, evaluation scores, KL, response length and time per rollout, by rollout id",
    )
    parser.add_argument(
        "--samples",
        nargs="?",
        const="last",
        default=None,
        type=parse_choice,
        metavar="ROLLOUT_ID",
        help="print the prompts, responses and rewards that rollout ROLLOUT_ID and its evaluation "
        "kept (rollout.log_samples); without a value the last rollout, 'all' every one",
    )
    return parser


def _split(values: Iterable[str]) -> set[str]:
    return {part.strip() for value in values for part in value.split(",") if part.strip()}


class RolloutTracker:
    """Which rollout each event of a log belongs to, fed the log's events in order.

    An event with a ``rollout_id`` belongs to that rollout. The others follow what they
    answer: an engine's ``WeightsLoaded`` belongs to the rollout whose publication staged
    that weight version, a ``DataReleased`` to the rollout of the event that carried the
    released reference, an ``ActorFailed`` to the rollout of the event it failed on. The
    rest (the run's start and end, the initial publication, weight checks) belong to none.
    """

    def __init__(self) -> None:
        self.seen: set[int] = set()
        """Every rollout id an event named, so far."""
        self._by_version: dict[tuple[str, str], int] = {}
        self._by_ref: dict[tuple[str, str, str], int] = {}
        self._by_seq: dict[tuple[str, int], int] = {}

    def rollout_of(self, event: Event) -> int | None:
        run = event.run_id
        rollout = getattr(event, "rollout_id", None)
        if rollout is not None:
            self.seen.add(rollout)
            if isinstance(event, WeightsStaged):
                self._by_version[run, event.weight_version] = rollout
            for value in msgspec.structs.astuple(event):
                if isinstance(value, DataRef):
                    self._by_ref[run, value.transport, value.key] = rollout
        elif isinstance(event, WeightsLoaded):
            rollout = self._by_version.get((run, event.weight_version))
        elif isinstance(event, DataReleased):
            rollout = self._by_ref.get((run, event.ref.transport, event.ref.key))
        elif isinstance(event, ActorFailed):
            rollout = self._by_seq.get((run, event.event_seq))
        if rollout is not None:
            self._by_seq[run, event.seq] = rollout
        return rollout


def filter_events(
    events: Iterable[Event],
    *,
    types: Iterable[str] = (),
    sources: Iterable[str] = (),
    rollout_id: int | None = None,
    tracker: RolloutTracker | None = None,
) -> Iterator[Event]:
    """The events matching every given filter (an empty filter matches everything); a
    rollout's events are those ``tracker`` (a new one by default) assigns to it."""
    type_set, source_set = set(types), set(sources)
    if rollout_id is not None and tracker is None:
        tracker = RolloutTracker()
    for event in events:
        # The tracker sees every event: what ties an event to its rollout may be filtered out.
        if tracker is not None and tracker.rollout_of(event) != rollout_id:
            continue
        if type_set and type(event).__name__ not in type_set:
            continue
        if source_set and event.source not in source_set:
            continue
        yield event


def _log_sources(path: Path) -> set[str]:
    """The sources of every readable event of the log (damage skipped quietly)."""
    sources: set[str] = set()
    try:
        for event in read_events(path, on_damage=lambda damage: None):
            sources.add(event.source)
    except TornRecordError:
        pass
    return sources


def _ranges(numbers: Iterable[int]) -> str:
    """``0..2, 5, 7..9``: sorted, runs of consecutive numbers joined."""
    spans: list[list[int]] = []
    for number in sorted(numbers):
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans) or "none"


def _format_time(seconds: float) -> str:
    if not seconds:
        return "-"
    stamp = dt.datetime.fromtimestamp(seconds, tz=dt.UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S.") + f"{stamp.microsecond // 1000:03d}"


def _format_value(value: Any, whole: bool = False) -> str:
    """A short rendering: big collections are counted, long text is cut; ``whole``: neither,
    and a text field in ``_WHOLE_FIELDS`` is never cut at any depth."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str):
        text = value if whole or len(value) <= _MAX_TEXT else value[: _MAX_TEXT - 3] + "..."
        return repr(text) if (not text or " " in text or "=" in text or "\n" in text) else text
    if isinstance(value, dict):
        if len(value) > 4 and not whole:
            return f"<{len(value)} entries>"
        return "{" + ",".join(f"{k}:{_format_field(str(k), v, whole)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        if len(value) > 4 and not whole:
            return f"<{len(value)} items>"
        return "[" + ",".join(_format_value(v, whole) for v in value) + "]"
    if isinstance(value, msgspec.Struct):
        fields = msgspec.structs.asdict(value)
        if {"transport", "key"} <= fields.keys():
            # A DataRef: where the bulk data lives is what a reader wants.
            return f"{fields['transport']}:{fields['key']}"
        return "{" + ",".join(f"{k}:{_format_field(k, v, whole)}" for k, v in fields.items()) + "}"
    return str(value)


def _format_field(name: str, value: Any, whole: bool) -> str:
    return _format_value(value, whole or name in _WHOLE_FIELDS)


def _is_block(value: Any, whole: bool) -> bool:
    """Printed below the event's line: text of several lines that is printed whole, and, in
    an event that reports a failure, a list of records (one a line)."""
    if isinstance(value, str):
        return whole and "\n" in value.rstrip("\n")
    return (
        whole
        and isinstance(value, list)
        and bool(value)
        and all(isinstance(v, msgspec.Struct) for v in value)
    )


def _format_block(name: str, value: str | list[msgspec.Struct]) -> list[str]:
    inner = _BLOCK_INDENT + "  "
    if isinstance(value, str):
        return [f"{_BLOCK_INDENT}{name}:", *(inner + line for line in value.splitlines())]
    rows = [
        " ".join(f"{k}={_format_value(v, True)}" for k, v in msgspec.structs.asdict(item).items())
        for item in value
    ]
    return [f"{_BLOCK_INDENT}{name} ({len(value)}):", *(inner + row for row in rows)]


def format_event(event: Event) -> str:
    """A human-readable line: seq, UTC time, source, type, then the event's own fields.

    What says why something failed is never cut: text fields named ``reason``, ``error``,
    ``traceback`` or ``message``, and every field of an event that reports a failure
    (``_FAILURES``). Such text of several lines (a traceback), and the list of records of a
    failure (a mismatch's tensors), follow on lines of their own, indented under the event.
    """
    failure = type(event).__name__ in _FAILURES
    parts: list[str] = []
    blocks: list[str] = []
    for name, value in zip(event.__struct_fields__, msgspec.structs.astuple(event), strict=True):
        if name in _HEADER_FIELDS or value is None:
            continue
        if name == _KEPT_SAMPLES and isinstance(value, list):
            if value:
                parts.append(f"{name}=<{len(value)} kept>")
            continue
        whole = failure or name in _WHOLE_FIELDS
        if _is_block(value, whole):
            blocks.extend(_format_block(name, value))
        else:
            parts.append(f"{name}={_format_value(value, whole)}")
    head = f"{event.seq:>6} {_format_time(event.time)} {event.source or '-':<12} {type(event).__name__:<21}"
    return "\n".join([f"{head} {' '.join(parts)}".rstrip(), *blocks])


class _Unusable(Exception):
    """A path the command cannot use; the message is the one line that says why."""


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _file_mode(path: Path, shown: str) -> int | None:
    """``path``'s mode, None when it does not exist; ``_Unusable`` when it cannot be looked at."""
    try:
        return path.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        raise _Unusable(f"{shown}: cannot read it ({error.strerror or error})") from None


def _regular_file(path: Path, shown: str) -> Path:
    """``path`` when it is a regular file (reading anything else could block: a FIFO),
    else ``_Unusable`` naming what it is."""
    mode = _file_mode(path, shown)
    if mode is None:
        raise _Unusable(f"{shown}: no such file")
    for test, kind in _NOT_REGULAR:
        if test(mode):
            raise _Unusable(f"{shown} is not a regular file ({kind})")
    return path


def _resolve_log(log: str) -> Path:
    """The event log ``log`` names: the file itself, or a run directory's ``events.log``."""
    path = Path(log)
    mode = _file_mode(path, log)
    if mode is not None and stat.S_ISDIR(mode):
        inside = event_log_path(path)
        if _file_mode(inside, str(inside)) is None:
            raise _Unusable(f"{log} is a directory without {EVENT_LOG}")
        return _regular_file(inside, str(inside))
    return _regular_file(path, log)


def _print_events(events: Iterable[Event], as_json: bool, out: TextIO) -> int:
    """Writes each event; returns how many."""
    write = out.write
    count = 0
    if as_json:
        for event in events:
            write(event_to_json_bytes(event).decode() + "\n")
            count += 1
    else:
        for event in events:
            write(format_event(event) + "\n")
            count += 1
    return count


def _damage_warning(log: str, out: TextIO, err: TextIO) -> OnDamage:
    """Reports each damaged range that reading skips as one warning line on ``err``, after
    what has been written to ``out`` so far."""

    def warn(damage: DamagedRange) -> None:
        out.flush()
        err.write(
            f"replay: warning: {log}: bytes {damage.start}..{damage.end} damaged, skipped ({damage.reason})\n"
        )

    return warn


def main(argv: Sequence[str] | None = None) -> int:
    """Run the replay CLI; returns the exit status (0 read to the end, 1 torn, 2 unusable)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        types = _split(args.types)
        unknown = sorted(types - EVENT_TYPES_BY_NAME.keys())
        if unknown:
            known = ", ".join(sorted(EVENT_TYPES_BY_NAME))
            parser.error(f"unknown event type {', '.join(unknown)} (known: {known})")
        if args.rollout_id is not None and args.rollout_id < 0:
            sys.stderr.write(f"replay: --rollout-id {args.rollout_id}: a rollout id is 0 or more\n")
            return 2
        _check_views(parser, args)
    except SystemExit as exit_request:
        # argparse exits on --help and on bad arguments; callers of main() get a status.
        return exit_request.code if isinstance(exit_request.code, int) else 2

    out, err = sys.stdout, sys.stderr
    try:
        path = _resolve_log(args.log)
        if args.config is not None:
            _regular_file(Path(args.config), f"--config {args.config}")
        plot_path = _plot_output(args.plot) if args.plot is not None else None
        events = read_events(path, on_damage=_damage_warning(args.log, out, err))
    except _Unusable as error:
        err.write(f"replay: {error}\n")
        return 2
    except FileNotFoundError:  # gone since it was looked at
        err.write(f"replay: {args.log}: no such file\n")
        return 2
    except NotAnEventLogError as error:
        reason = str(error).removeprefix(f"{path}: ")
        err.write(f"replay: {args.log}: {reason}\n")
        return 2
    except OSError as error:
        err.write(f"replay: {args.log}: cannot read it ({error.strerror or error})\n")
        return 2
    except TornRecordError as torn:
        err.write(f"replay: {args.log}: torn record at byte {torn.offset}: {torn.reason}\n")
        return 1

    if plot_path is not None:
        return _plot(events, args.log, plot_path, out, err)
    if args.samples is not None:
        return _samples(events, args.samples, args.log, args.json, out, err)
    if args.serve_metrics is not None:
        return _serve_metrics(events, args.log, args.host, args.serve_metrics, out, err)
    if args.redrive:
        return _redrive(path, events, sorted(_split(args.redrive)), args.config, out, err)
    sources = _split(args.sources)
    if sources:
        in_log = _log_sources(path)
        absent = sorted(sources - in_log)
        if absent:
            known = ", ".join(sorted(in_log)) or "none"
            named = ",".join(absent)
            err.write(
                f"replay: --source {named}: no event in {args.log} comes from it (its sources: {known})\n"
            )
            return 2
    tracker = RolloutTracker() if args.rollout_id is not None else None
    selected = filter_events(
        events, types=types, sources=sources, rollout_id=args.rollout_id, tracker=tracker
    )
    try:
        printed = _print_events(selected, args.json, out)
        out.flush()
        if not printed and (types or sources or tracker is not None):
            if tracker is not None and args.rollout_id not in tracker.seen:
                err.write(
                    f"replay: no event of rollout {args.rollout_id} in {args.log} (its rollouts: {_ranges(tracker.seen)})\n"
                )
            else:
                err.write(f"replay: no event in {args.log} matches the filters\n")
    except TornRecordError as torn:
        out.flush()
        err.write(f"replay: {args.log}: torn record at byte {torn.offset}: {torn.reason}\n")
        return 1
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as a shell tool should.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        return 141
    return 0


def _check_views(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--plot`` and ``--samples`` each read the whole log their own way: neither combines
    with the other, with ``--redrive`` or ``--serve-metrics``, or with the event filters
    (``--plot`` not with ``--json`` either); a usage error otherwise."""
    view = "--plot" if args.plot is not None else "--samples" if args.samples is not None else None
    if view is None:
        return
    given = {
        "--samples": view == "--plot" and args.samples is not None,
        "--redrive": bool(args.redrive),
        "--serve-metrics": args.serve_metrics is not None,
        "--type": bool(args.types),
        "--source": bool(args.sources),
        "--rollout-id": args.rollout_id is not None,
        "--config": args.config is not None,
        "--json": view == "--plot" and args.json,
    }
    clashing = [name for name, present in given.items() if present]
    if clashing:
        parser.error(f"{view} cannot be combined with {', '.join(clashing)}")


def _plot_output(out: str) -> Path:
    """Where ``--plot`` writes, checked before the log is read (``_Unusable`` naming why not)."""
    from miles_events.app.plot import PlotOutputError, check_output

    try:
        return check_output(out)
    except PlotOutputError as error:
        raise _Unusable(str(error)) from None


def _readable(events: Iterable[Event]) -> tuple[list[Event], TornRecordError | None]:
    """Every readable event, and the torn record that ended the log early (None when the
    log was read to its end)."""
    readable: list[Event] = []
    try:
        for event in events:
            readable.append(event)
    except TornRecordError as torn:
        return readable, torn
    return readable, None


def _plot(events: Iterable[Event], log: str, path: Path, out: TextIO, err: TextIO) -> int:
    """Draw the readable part of the log into ``path`` (a torn tail is a warning); 1 when
    not one event is readable, 2 when the file cannot be written."""
    from miles_events.app.plot import write_plot
    from miles_events.app.run_series import run_series

    readable, torn = _readable(events)
    if torn is not None:
        err.write(
            f"replay: warning: {log}: torn record at byte {torn.offset}: {torn.reason}; "
            f"plotting the {len(readable)} records before it\n"
        )
    if not readable:
        err.write(f"replay: {log}: no event to plot\n")
        return 1
    runs = run_series(readable)
    try:
        write_plot(runs, path)
    except OSError as error:
        err.write(f"replay: --plot {path}: cannot write it ({error.strerror or error})\n")
        return 2
    except Exception as error:  # a format whose writer needs what is missing here (LaTeX for .pgf)
        err.write(f"replay: --plot {path}: matplotlib cannot write it ({describe_error(error)})\n")
        return 2
    for run in runs:
        counts = (
            (len(run.reward_mean), "rollout"),
            (run.evaluations, "evaluation"),
            (run.train_steps, "train step"),
        )
        out.write(
            f"run {run.run_id}: "
            + ", ".join(f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts)
            + "\n"
        )
    out.write(f"plotted to {path}\n")
    return 0


def _samples(
    events: Iterable[Event], choice: SamplesChoice, log: str, as_json: bool, out: TextIO, err: TextIO
) -> int:
    """Print the samples ``choice`` selects from the readable part of the log; 1 when the
    log ends in a torn record (after printing what was read), a note on ``err`` when
    nothing matches."""
    from miles_events.app.replay_samples import print_samples, select

    readable, torn = _readable(events)
    selection = select(readable, choice)
    try:
        print_samples(selection, as_json, out)
        out.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
        return 141
    if not selection.rollout_ids:
        err.write(f"replay: no rollout or evaluation in {log}\n")
    elif not selection.events:
        err.write(f"replay: no rollout {choice} in {log} (its rollouts: {_ranges(selection.rollout_ids)})\n")
    if torn is not None:
        err.write(f"replay: {log}: torn record at byte {torn.offset}: {torn.reason}\n")
        return 1
    return 0


def _redrive(
    path: Path, events: Iterable[Event], names: list[str], config: str | None, out: TextIO, err: TextIO
) -> int:
    """Re-drive each named actor over each run in the readable part of the log (a torn tail
    is a warning); 0 when every decision matches."""
    import asyncio

    from miles_events.app.config import ConfigError, load_config
    from miles_events.app.redrive import REDRIVABLE, build_actor, redrive, split_runs

    unknown = [n for n in names if n not in REDRIVABLE]
    if unknown:
        err.write(
            f"replay: cannot re-drive {', '.join(unknown)} (choose from {', '.join(sorted(REDRIVABLE))})\n"
        )
        return 2
    readable: list[Event] = []
    try:
        for event in events:
            readable.append(event)
    except TornRecordError as torn:
        if not readable:
            err.write(f"replay: {path}: torn record at byte {torn.offset}: {torn.reason}\n")
            return 1
        err.write(
            f"replay: warning: {path}: torn record at byte {torn.offset}: {torn.reason}; "
            f"re-driving the {len(readable)} records before it\n"
        )
    runs = split_runs(readable)
    status = 0
    for run_id, recorded in runs.items():
        recorded_path = run_config_path(path.parent, run_id)
        config_path = Path(config) if config else recorded_path
        try:
            if config_path.exists():
                _regular_file(config_path, str(config_path))
            run_config = load_config(config_path, check=False, recorded=True)
        except (ConfigError, _Unusable) as error:
            err.write(f"replay: run {run_id}: {error}\n")
            return 2
        started = next((e for e in recorded if isinstance(e, RunStarted)), None)
        out.write(f"run {run_id}: {_describe_config(config_path, run_config, recorded_path, started)}\n")
        for name in names:
            try:
                actor = build_actor(name, run_config, recorded, run_dir=path.parent)
            except ValueError as error:
                err.write(f"replay: run {run_id}: {error}\n")
                return 2
            result = asyncio.run(redrive(actor, recorded))
            verdict = "same decisions" if result.matches else "DIFFERENT: " + result.first_difference()
            out.write(
                f"{name:12} run {run_id}: {result.inputs} events in, {len(result.produced)} decisions: {verdict}\n"
            )
            status = status or (0 if result.matches else 1)
    return status


_MAX_DIFFERENCES = 8
_MAX_VALUE = 40


def _describe_config(used_path: Path, used: Config, recorded_path: Path, started: RunStarted | None) -> str:
    """Which config a re-drive uses and, when it is not the run's recorded config file, how
    it differs from it: the keys, each with the recorded value and the one used."""
    from miles_events.app.config import ConfigError, config_digest, load_config
    from miles_events.app.redrive import config_differences

    head = f"config {used_path}"
    if used_path == recorded_path or (
        recorded_path.exists() and used_path.resolve() == recorded_path.resolve()
    ):
        return f"{head}, the one recorded for the run"
    if not recorded_path.exists():
        # The digest alone says "the same" only while the config schema has not grown since.
        if started is not None and config_digest(used) == started.config_digest:
            return f"{head}, whose digest is the one the run recorded ({recorded_path} is missing)"
        return f"{head}; the recorded {recorded_path} is missing: not compared"
    try:
        _regular_file(recorded_path, str(recorded_path))
        recorded = load_config(recorded_path, check=False, recorded=True)
    except (ConfigError, _Unusable) as error:
        return f"{head}; the recorded {recorded_path} cannot be read ({error}): not compared"
    differences = config_differences(recorded, used)
    if not differences:
        return f"{head}, the same as the recorded {recorded_path}"
    named = ", ".join(
        f"{key} ({_config_value(before)} -> {_config_value(after)})"
        for key, before, after in differences[:_MAX_DIFFERENCES]
    )
    if len(differences) > _MAX_DIFFERENCES:
        named += f" and {len(differences) - _MAX_DIFFERENCES} more"
    return f"{head} differs from the recorded {recorded_path} in {named}"


def _config_value(value: Any) -> str:
    if value is None:
        return "unset"
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def _serve_metrics(events: Iterable[Event], log: str, host: str, port: int, out: TextIO, err: TextIO) -> int:
    """Serve the metrics rebuilt from the whole log until interrupted (Ctrl-C: status 0).

    A torn log is served up to its last complete record; the tear is reported on ``err``
    (as is each damaged range that reading skipped).
    """
    import time

    from miles_events.sinks.metrics import MetricsError, MetricsServer, RunMetrics

    metrics = RunMetrics()
    count = 0
    try:
        for event in events:
            metrics.observe(event)
            count += 1
    except TornRecordError as torn:
        err.write(f"replay: {log}: torn record at byte {torn.offset}: {torn.reason}\n")
    try:
        server = MetricsServer(
            metrics.registry, host, port, hint="choose another --serve-metrics PORT (0 picks one)"
        )
    except MetricsError as error:
        err.write(f"replay: {error}\n")
        return 2
    out.write(f"serving metrics of {count} events from {log} at {server.url}\n")
    out.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
