"""The samples a run's rollouts and evaluations kept, as ``replay LOG --samples`` prints them.

A rollout's ``RolloutGenerated`` and an evaluation's ``EvalFinished`` keep a few of their
samples (``rollout.log_samples``, texts cut to ``rollout.log_sample_chars``). This prints
them for a terminal: a heading per rollout or evaluation, then each sample's prompt,
response and label on lines of their own, indented, with its reward and length. Control
characters a model wrote are shown escaped, never sent to the terminal as they are.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

import msgspec

from schemas.events import EvalFinished, Event, RolloutGenerated, SampleExcerpt

SamplesChoice = int | Literal["last", "all"]
"""Which rollouts: a rollout id, the log's last rollout, or every one."""

_INDENT = "    "
_TEXT_INDENT = _INDENT + " " * 10
_KEPT_NOTHING = "no samples kept (rollout.log_samples = 0, or a log written before samples were kept)"


def parse_choice(text: str) -> SamplesChoice:
    """``--samples``'s value: ``all``, ``last`` or a rollout id (0 or more)."""
    if text in ("all", "last"):
        return "all" if text == "all" else "last"
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rollout id (0 or more), 'last' or 'all'")
    return int(text)


@dataclass(frozen=True)
class Selection:
    """The rollouts' and evaluations' events ``--samples`` prints, and what the log holds."""

    events: list[RolloutGenerated | EvalFinished]
    rollout_ids: set[int]
    """Every rollout id of a rollout or an evaluation in the log."""
    several_runs: bool


def select(events: Sequence[Event], choice: SamplesChoice) -> Selection:
    """The ``RolloutGenerated`` and ``EvalFinished`` events of ``choice``, in log order.

    ``last``: the rollout (and the evaluation) with the id of the last of these events in
    the log, in that event's run; a rollout id: every run's rollout and evaluation of it.
    """
    found = [e for e in events if isinstance(e, RolloutGenerated | EvalFinished)]
    ids = {e.rollout_id for e in found}
    several = len({e.run_id for e in events}) > 1
    if choice == "all" or not found:
        return Selection(found, ids, several)
    if choice == "last":
        last = found[-1]
        chosen = [e for e in found if e.run_id == last.run_id and e.rollout_id == last.rollout_id]
    else:
        chosen = [e for e in found if e.rollout_id == choice]
    return Selection(chosen, ids, several)


def heading(event: RolloutGenerated | EvalFinished, several_runs: bool) -> str:
    """One line naming the rollout or evaluation, how many samples it kept of how many, and
    its scores."""
    run = f"run {event.run_id} " if several_runs else ""
    kept = len(event.samples)
    if isinstance(event, RolloutGenerated):
        versions = ",".join(event.weight_versions) or "-"
        return (
            f"{run}rollout {event.rollout_id}: {kept} of {event.num_samples} samples kept, "
            f"reward mean {event.reward_mean:.4g}, weight version {versions}"
        )
    total = int(event.metrics.get("eval/num_samples", 0))
    of = f" of {total}" if total else ""
    scores = ", ".join(
        f"{name.removeprefix('eval/').replace('_', ' ')} {event.metrics[name]:.4g}"
        for name in ("eval/accuracy", "eval/reward_mean")
        if name in event.metrics
    )
    return f"{run}evaluation at rollout {event.rollout_id}: {kept}{of} samples kept" + (
        f", {scores}" if scores else ""
    )


def format_sample(number: int, sample: SampleExcerpt) -> list[str]:
    """A sample's lines: what it scored, then its texts, each line indented."""
    lines = [
        f"  [{number}] prompt #{sample.index} (group {sample.group}), reward {sample.reward:.4g}, "
        f"{sample.response_tokens} tokens ({sample.finish_reason}), weight version {sample.weight_version}"
    ]
    lines += _text("prompt", sample.prompt, sample.prompt_chars)
    lines += _text("response", sample.response, sample.response_chars)
    lines += _text("label", sample.label, len(sample.label))
    return lines


def _text(name: str, text: str, whole_chars: int) -> list[str]:
    """``name: text``, each further line of the text indented under the first."""
    shown = [_printable(line) for line in text.split("\n")] if text else ["(empty)"]
    if whole_chars > len(text):
        shown[-1] += f"  [{whole_chars} characters, middle cut]"
    first, *rest = shown
    return [f"{_INDENT}{name + ':':<10}{first}", *(_TEXT_INDENT + line for line in rest)]


def _printable(line: str) -> str:
    """``line`` with each control character but a tab escaped (``\\x1b``, ``\\r``)."""
    return "".join(
        c if c == "\t" or c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in line
    )


def print_samples(selection: Selection, as_json: bool, out: TextIO) -> None:
    """Each selected rollout's and evaluation's samples; ``as_json``: one JSON object per
    sample (its event's run id, rollout id and kind, then the sample's fields)."""
    for event in selection.events:
        kind = "rollout" if isinstance(event, RolloutGenerated) else "eval"
        if as_json:
            for sample in event.samples:
                row = {"run_id": event.run_id, "rollout_id": event.rollout_id, "kind": kind}
                row.update(msgspec.structs.asdict(sample))
                out.write(msgspec.json.encode(row).decode() + "\n")
            continue
        out.write(heading(event, selection.several_runs) + "\n")
        if not event.samples:
            out.write(f"  {_KEPT_NOTHING}\n")
        for number, sample in enumerate(event.samples, 1):
            out.write("\n".join(format_sample(number, sample)) + "\n")
        out.write("\n")
