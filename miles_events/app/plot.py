"""Draw a run's progress from its event log: ``python -m miles_events.replay LOG --plot OUT``.

One figure, its panels sharing the rollout-id axis: the mean reward of each rollout, the
evaluations' scores, the trainer's KL, the learning rate (only when the trainer reports
one), the critic's value loss (only with PPO's critic), the mean response length, and each rollout's time split into generation, training
and publication beside its wall time. A panel with nothing to show says why in its middle.
Several runs in one log (a resumed run appends under its own id) are drawn side by side,
each named in the legend. The series come from ``miles_events.app.run_series``; this module
only draws them, with matplotlib's Agg canvas (no display needed), imported when a plot is
asked for.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_events.app.run_series import EVAL_SCORES, Point, RunSeries
from miles_events.util.file_modes import keep

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH_INCHES = 10.0
PANEL_INCHES = 2.2
"""Height of each panel."""
TITLE_INCHES = 1.0
"""Height of the title and the shared axis label, above and below the panels."""
DPI = 100

_PHASES = (("generate", "tab:blue"), ("train", "tab:orange"), ("publish", "tab:green"))
_NOTHING = {"color": "gray", "ha": "center", "va": "center", "fontsize": 10}


class PlotOutputError(ValueError):
    """The plot cannot be written where asked; the message is one line naming why."""


def figure_size(panels: int) -> tuple[float, float]:
    """Width and height in inches of a figure of ``panels`` panels."""
    return WIDTH_INCHES, TITLE_INCHES + PANEL_INCHES * panels


def writable_formats() -> list[str]:
    """The file extensions (without the dot) matplotlib can write here."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return sorted(FigureCanvasAgg(Figure()).get_supported_filetypes())


def check_output(out: str) -> Path:
    """``out`` as a path the plot can be written to, else ``PlotOutputError``: a name
    without an extension matplotlib writes, a directory that is missing or cannot be
    written in, an existing directory or a file that is not a regular one."""
    path = Path(out)
    extension = path.suffix.lower().removeprefix(".")
    formats = writable_formats()
    if extension not in formats:
        named = f".{extension}" if extension else "no extension"
        raise PlotOutputError(
            f"--plot {out}: {named} is not a format matplotlib writes (choose from "
            + ", ".join(f".{f}" for f in formats)
            + ")"
        )
    directory = path.parent
    try:
        mode = directory.stat().st_mode
    except FileNotFoundError:
        raise PlotOutputError(f"--plot {out}: no such directory {directory}") from None
    except OSError as error:
        raise PlotOutputError(f"--plot {out}: cannot use {directory} ({error.strerror or error})") from None
    if not stat.S_ISDIR(mode):
        raise PlotOutputError(f"--plot {out}: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PlotOutputError(f"--plot {out}: cannot write in {directory} (permission denied)")
    try:
        existing = path.stat().st_mode
    except FileNotFoundError:
        return path
    except OSError as error:
        raise PlotOutputError(f"--plot {out}: cannot use it ({error.strerror or error})") from None
    if stat.S_ISDIR(existing):
        raise PlotOutputError(f"--plot {out} is a directory")
    if not stat.S_ISREG(existing):
        raise PlotOutputError(f"--plot {out} exists and is not a regular file")
    return path


def panel_titles(runs: Sequence[RunSeries]) -> list[str]:
    """The panels a figure of ``runs`` has, top to bottom."""
    titles = ["mean reward", "evaluation", "KL"]
    if any(run.lr_reported() for run in runs):
        titles.append("learning rate")
    if any(run.value_loss for run in runs):
        titles.append("critic value loss")
    return [*titles, "mean response length (tokens)", "time per rollout (s)"]


def draw(runs: Sequence[RunSeries]) -> Figure:
    """The figure of ``runs`` (at least one), on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    titles = panel_titles(runs)
    figure = Figure(figsize=figure_size(len(titles)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(titles), 1, sharex=True, squeeze=False)[:, 0]
    ids = [run.run_id for run in runs]
    figure.suptitle(("run " if len(ids) == 1 else "runs ") + ", ".join(ids))
    several = len(runs) > 1
    by_title = dict(zip(titles, axes, strict=True))
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("rollout id")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))

    def label(name: str, run: RunSeries) -> str:
        return f"{name} ({run.run_id})" if several else name

    _lines(
        by_title["mean reward"],
        [(label("rollout", run), run.reward_mean, "o") for run in runs],
        "no rollout generated in this log",
    )
    _lines(
        by_title["evaluation"],
        [
            (label(name.removeprefix("eval/").replace("_", " "), run), run.eval_scores.get(name, []), marker)
            for run in runs
            for name, marker in zip(EVAL_SCORES, ("s", "x"), strict=True)
        ],
        "no evaluation in this log",
    )
    kl = by_title["KL"]
    if not any(run.train_steps for run in runs):
        _nothing(kl, "no train step in this log")
    elif not any(run.kl_reported() for run in runs):
        _nothing(kl, "KL 0 at every train step: not measured (no reference model: trainer.use_kl_loss off)")
    else:
        _lines(kl, [(label("KL", run), run.kl, "o") for run in runs], "")
    if "learning rate" in by_title:
        _lines(by_title["learning rate"], [(label("lr", run), run.lr, "o") for run in runs], "")
    if "critic value loss" in by_title:
        _lines(
            by_title["critic value loss"],
            [(label("value loss", run), run.value_loss, "o") for run in runs],
            "",
        )
    _lines(
        by_title["mean response length (tokens)"],
        [
            *((label("rollout", run), run.response_length, "o") for run in runs),
            *((label("eval", run), run.eval_response_length, "s") for run in runs),
        ],
        "no rollout or evaluation in this log",
    )
    _step_times(by_title["time per rollout (s)"], runs, several)
    return figure


def _nothing(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, **_NOTHING)  # type: ignore[arg-type]
    ax.set_yticks([])


def _lines(ax: Axes, series: Sequence[tuple[str, list[Point], str]], empty: str) -> None:
    drawn = [(name, points, marker) for name, points, marker in series if points]
    if not drawn:
        _nothing(ax, empty)
        return
    for name, points, marker in drawn:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker=marker, markersize=4, linewidth=1.2, label=name)
    ax.legend(loc="best", fontsize=8)


def _step_times(ax: Axes, runs: Sequence[RunSeries], several: bool) -> None:
    """Stacked bars of each rollout's phases (those that took any time in some run), the
    wall time a mark above them; the legend in a headroom of its own."""
    steps = [step for run in runs for step in run.step_times]
    if not steps:
        _nothing(ax, "no rollout generated in this log")
        return
    phases = [(phase, colour) for phase, colour in _PHASES if any(getattr(s, phase) for s in steps)]
    for number, run in enumerate(runs):
        if not run.step_times:
            continue
        xs = [step.rollout_id for step in run.step_times]
        bottom = [0.0] * len(xs)
        for phase, colour in phases:
            heights = [getattr(step, phase) for step in run.step_times]
            ax.bar(xs, heights, bottom=bottom, width=0.6, color=colour, label=None if number else phase)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.plot(
            xs,
            [step.wall for step in run.step_times],
            marker="_",
            markersize=14,
            markeredgewidth=2,
            linestyle="none",
            color=f"C{number + 3}" if several else "black",
            label=f"wall ({run.run_id})" if several else "wall",
        )
    top = max(max(s.wall, s.generate + s.train + s.publish) for s in steps)
    ax.set_ylim(0, top * 1.4 or 1.0)
    ax.legend(loc="upper left", fontsize=8, ncols=len(phases) + len(runs))


def write_plot(runs: Sequence[RunSeries], path: Path) -> None:
    """Draw ``runs`` into ``path`` (its format from its extension), replacing it whole: a
    failure part-way leaves no partial file."""
    figure = draw(runs)
    extension = path.suffix.lower().removeprefix(".")
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            figure.savefig(file, format=extension, dpi=DPI)
        os.replace(keep(Path(temporary)), path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
