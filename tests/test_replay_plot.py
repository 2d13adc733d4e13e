"""``python -m miles_events.replay LOG --plot OUT``: the series a log gives, the figure drawn
from them, and the paths it refuses (one line, exit 2, nothing written)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import msgspec
import pytest

from miles_events.app.plot import draw, panel_titles
from miles_events.app.replay import main
from miles_events.app.run_series import RunSeries, StepTime, run_series
from miles_events.bus.event_log import HEADER_SIZE, EventLogWriter, read_events
from schemas.data import DataRef
from schemas.events import (
    Event,
    RolloutGenerated,
    RolloutRequested,
    RunFinished,
    TrainMetrics,
    TrainStepFinished,
    WeightsPublished,
)
from tests.test_replay_cli import run_replay, without_root_file_access

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "tiny_run"
"""3 rollouts of 128 samples, evals at rollouts 0, 1 and 2 (see its README)."""
ROLLOUT_ONLY = FIXTURES / "rollout_only_run"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def panel_texts(figure: object) -> dict[str, list[str]]:
    """Each panel's title -> the texts written in it (what an empty panel says)."""
    return {ax.get_title(loc="left"): [t.get_text() for t in ax.texts] for ax in figure.axes}  # type: ignore[attr-defined]


# --- the series ----------------------------------------------------------------------------


def test_the_series_of_a_recorded_run_are_what_its_events_say() -> None:
    events = list(read_events(TINY / "events.log"))
    [run] = run_series(events)
    assert run.run_id == "20261201-092716-4c9c84"
    assert run.reward_mean == [(0, 0.0078125), (1, 0.0234375), (2, 0.0234375)]
    assert run.response_length == [(0, 482 / 128), (1, 487 / 128), (2, 466 / 128)]
    assert run.eval_scores["eval/accuracy"] == [(0, 0.0), (1, 0.0), (2, 1 / 55)]
    assert [x for x, _ in run.eval_scores["eval/reward_mean"]] == [0, 1, 2]
    assert [x for x, _ in run.eval_response_length] == [0, 1, 2]
    assert (run.train_steps, run.evaluations) == (3, 3)
    assert [x for x, _ in run.kl] == [0, 1, 2] and not run.kl_reported()  # no reference model
    assert not run.lr_reported(), "a log from before the rate was reported reads it as 0"

    by_rollout = {e.rollout_id: e for e in events if isinstance(e, RolloutRequested)}
    generated = {e.rollout_id: e.generate_seconds for e in events if isinstance(e, RolloutGenerated)}
    trained = {e.rollout_id: e.train_seconds for e in events if isinstance(e, TrainStepFinished)}
    published = {e.rollout_id: e.publish_seconds for e in events if isinstance(e, WeightsPublished)}
    finished = next(e for e in events if isinstance(e, RunFinished))
    ends = [by_rollout[1].time, by_rollout[2].time, finished.time]
    assert run.step_times == [
        StepTime(
            rollout_id=k,
            generate=generated[k],
            train=trained[k],
            publish=published[k],
            wall=ends[k] - by_rollout[k].time,
        )
        for k in range(3)
    ]
    assert all(step.wall >= step.generate + step.train + step.publish for step in run.step_times)


def stamped(events: list[Event]) -> list[Event]:
    return [msgspec.structs.replace(e, seq=i + 1, time=100.0 + 10 * i) for i, e in enumerate(events)]


def rollout(run_id: str, rollout_id: int, reward: float, kl: float) -> list[Event]:
    ref = DataRef("inprocess", f"rollout-{rollout_id}", "generator")
    return [
        RolloutRequested(run_id=run_id, rollout_id=rollout_id),
        RolloutGenerated(
            run_id=run_id,
            rollout_id=rollout_id,
            batch=ref,
            num_samples=4,
            reward_mean=reward,
            weight_versions=["1"],
            response_tokens=10,
            generate_seconds=2.0,
        ),
        TrainStepFinished(
            run_id=run_id,
            rollout_id=rollout_id,
            weight_version="1",
            metrics=TrainMetrics(kl=kl),
            train_seconds=3.0,
        ),
    ]


def test_a_resumed_run_is_a_series_of_its_own_and_a_measured_kl_is_drawn() -> None:
    events = stamped(
        [*rollout("first", 0, 0.25, 0.0), *rollout("first", 1, 0.5, 0.01), *rollout("resumed", 2, 0.75, 0.02)]
    )
    first, resumed = run_series(events)
    assert (first.run_id, resumed.run_id) == ("first", "resumed")
    assert first.reward_mean == [(0, 0.25), (1, 0.5)] and resumed.reward_mean == [(2, 0.75)]
    assert first.kl == [(0, 0.0), (1, 0.01)] and first.kl_reported()
    assert first.response_length == [(0, 2.5), (1, 2.5)]
    # Rollout 1's wall time runs to the run's last event; there was no publication.
    assert first.step_times[1] == StepTime(rollout_id=1, generate=2.0, train=3.0, publish=0.0, wall=20.0)
    figure = draw([first, resumed])
    assert figure.get_suptitle() == "runs first, resumed"
    texts = panel_texts(figure)
    assert texts["KL"] == [] and texts["evaluation"] == ["no evaluation in this log"]
    kl_lines = next(ax for ax in figure.axes if ax.get_title(loc="left") == "KL").get_lines()
    assert [line.get_label() for line in kl_lines] == ["KL (first)", "KL (resumed)"]
    assert [list(line.get_ydata()) for line in kl_lines] == [[0.0, 0.01], [0.02]]


def test_a_learning_rate_gets_a_panel_only_when_the_trainer_reports_one() -> None:
    plain = RunSeries("plain")
    assert "learning rate" not in panel_titles([plain])
    scheduled = RunSeries("scheduled", lr=[(0, 1e-4), (1, 2e-4)])
    assert panel_titles([plain, scheduled]) == [
        "mean reward",
        "evaluation",
        "KL",
        "learning rate",
        "mean response length (tokens)",
        "time per rollout (s)",
    ]


def test_a_ppo_run_gets_a_panel_of_the_critics_value_loss() -> None:
    [ppo] = run_series(read_events(Path(__file__).parent / "fixtures" / "ppo_run" / "events.log"))
    assert [rollout for rollout, _ in ppo.value_loss] == [0, 1, 2]
    assert all(loss > 0 for _, loss in ppo.value_loss)
    assert "critic value loss" in panel_titles([ppo])
    assert "critic value loss" not in panel_titles([RunSeries("grpo")])
    figure = draw([ppo])
    [axis] = [ax for ax in figure.axes if ax.get_title(loc="left") == "critic value loss"]
    [line] = axis.get_lines()
    assert list(line.get_ydata()) == [loss for _, loss in ppo.value_loss]


def test_a_panel_with_nothing_to_show_says_so() -> None:
    [run] = run_series(read_events(ROLLOUT_ONLY / "events.log"))
    texts = panel_texts(draw([run]))
    assert texts["KL"] == ["no train step in this log"]
    assert texts["mean reward"] == [] and texts["evaluation"] == []
    [tiny] = run_series(read_events(TINY / "events.log"))
    assert panel_texts(draw([tiny]))["KL"] == [
        "KL 0 at every train step: not measured (no reference model: trainer.use_kl_loss off)"
    ]
    empty = panel_texts(draw([RunSeries("nothing")]))
    assert all(len(said) == 1 for said in empty.values()), empty


# --- the command -----------------------------------------------------------------------------


def test_the_plot_of_a_recorded_run_is_a_png_of_the_figure_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny.png"
    assert main([str(TINY), "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == (
        f"run 20261201-092716-4c9c84: 3 rollouts, 3 evaluations, 3 train steps\nplotted to {out}\n"
    )
    assert png_size(out) == (1000, 1200)  # 10 x (1 + 5 panels x 2.2) inches at 100 dpi
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.png"]  # no temporary file left


@pytest.mark.parametrize(("name", "magic"), [("plot.svg", b"<?xml"), ("plot.PDF", b"%PDF")])
def test_the_extension_picks_the_format(tmp_path: Path, name: str, magic: bytes) -> None:
    out = tmp_path / name
    assert main([str(TINY / "events.log"), "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(magic)


def test_an_existing_plot_is_replaced(tmp_path: Path) -> None:
    out = tmp_path / "plot.png"
    out.write_bytes(b"old")
    assert main([str(TINY), "--plot", str(out)]) == 0
    assert png_size(out) == (1000, 1200)


def test_a_torn_log_is_plotted_as_far_as_it_reads_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.log"
    data = (TINY / "events.log").read_bytes()
    log.write_bytes(data[: len(data) * 2 // 3])
    out = tmp_path / "plot.png"
    assert main([str(log), "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    [warning] = captured.err.splitlines()
    assert warning.startswith(f"replay: warning: {log}: torn record at byte ")
    assert "plotting the " in warning
    rollouts = int(captured.out.split(": ")[1].split()[0])
    assert 0 < rollouts < 3
    assert png_size(out) == (1000, 1200)


def test_a_log_with_no_readable_event_plots_nothing_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.log"
    log.write_bytes((TINY / "events.log").read_bytes()[: HEADER_SIZE + 5])
    out = tmp_path / "plot.png"
    assert main([str(log), "--plot", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"replay: {log}: no event to plot"
    assert not out.exists()


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a refused command (exit 2, nothing on stdout)."""
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    return line


def test_a_missing_directory_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "absent" / "plot.png"
    assert refused([str(TINY), "--plot", str(out)], capsys) == (
        f"replay: --plot {out}: no such directory {out.parent}"
    )
    assert not out.parent.exists()


def test_a_file_where_the_directory_should_be_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "plot.png"
    assert refused([str(TINY), "--plot", str(out)], capsys) == (
        f"replay: --plot {out}: {out.parent} is not a directory"
    )


@pytest.mark.parametrize("name", ["plot.docx", "plot"])
def test_an_extension_matplotlib_cannot_write_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    out = tmp_path / name
    line = refused([str(TINY), "--plot", str(out)], capsys)
    named = ".docx" if name.endswith(".docx") else "no extension"
    assert line.startswith(f"replay: --plot {out}: {named} is not a format matplotlib writes (choose from ")
    assert ".png" in line and ".svg" in line and ".pdf" in line
    assert list(tmp_path.iterdir()) == []


def test_a_directory_as_the_output_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plot.png"
    out.mkdir()
    assert refused([str(TINY), "--plot", str(out)], capsys) == f"replay: --plot {out} is a directory"


def test_a_directory_that_cannot_be_written_in_is_one_line_exit_2(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    out = locked / "plot.png"
    try:
        result = run_replay(
            str(TINY), "--plot", str(out), preexec_fn=without_root_file_access if os.geteuid() == 0 else None
        )
    except subprocess.SubprocessError as error:
        pytest.skip(f"cannot drop root's file access here ({error})")
    finally:
        locked.chmod(0o755)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"replay: --plot {out}: cannot write in {locked} (permission denied)\n"
    assert list(locked.iterdir()) == []


def test_a_missing_log_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plot.png"
    assert refused([str(tmp_path / "nope.log"), "--plot", str(out)], capsys) == (
        f"replay: {tmp_path / 'nope.log'}: no such file"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "clashing"),
    [
        (["--type", "RolloutGenerated"], "--type"),
        (["--json"], "--json"),
        (["--samples"], "--samples"),
        (["--redrive", "coordinator", "--rollout-id", "1"], "--redrive, --rollout-id"),
    ],
)
def test_plot_with_a_filter_or_another_view_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], clashing: str
) -> None:
    out = tmp_path / "plot.png"
    assert refused([str(TINY), "--plot", str(out), *extra], capsys) == (
        f"replay: --plot cannot be combined with {clashing} (see --help)"
    )
    assert not out.exists()


def test_a_log_two_runs_wrote_plots_both(tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(TINY, copy)
    with EventLogWriter(copy / "events.log") as writer:  # a second run appends to the log
        writer.append_many(stamped(rollout("again", 3, 0.5, 0.0)))
    out = tmp_path / "plot.png"
    assert main([str(copy), "--plot", str(out)]) == 0
    assert [run.run_id for run in run_series(read_events(copy / "events.log"))] == [
        "20261201-092716-4c9c84",
        "again",
    ]
    assert png_size(out) == (1000, 1200)
