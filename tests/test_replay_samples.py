"""``python -m miles_events.replay LOG --samples [ROLLOUT_ID]``: the prompts, responses and
rewards a run's rollouts and evaluations kept in its event log."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from miles_events.app.replay import main
from miles_events.bus.event_log import EventLogWriter
from schemas.data import DataRef
from schemas.events import EvalFinished, Event, RolloutGenerated, RolloutRequested, SampleExcerpt

TINY = Path(__file__).parent / "fixtures" / "tiny_run"
"""Recorded before samples were kept."""


def kept(group: int, prompt: str, response: str, reward: float, **fields: object) -> SampleExcerpt:
    values: dict[str, object] = dict(
        index=10 + group,
        group=group,
        prompt=prompt,
        response=response,
        label="7",
        reward=reward,
        response_tokens=len(response) + 1,
        finish_reason="stop",
        weight_version="2",
        prompt_chars=len(prompt),
        response_chars=len(response),
    )
    values.update(fields)
    return msgspec.convert(values, SampleExcerpt)


def generated(rollout_id: int, samples: list[SampleExcerpt], run_id: str = "run-a") -> list[Event]:
    return [
        RolloutRequested(run_id=run_id, rollout_id=rollout_id),
        RolloutGenerated(
            run_id=run_id,
            rollout_id=rollout_id,
            batch=DataRef("inprocess", f"rollout-{rollout_id}", "generator"),
            num_samples=64,
            reward_mean=0.375,
            weight_versions=["2"],
            samples=samples,
        ),
    ]


def evaluated(rollout_id: int, samples: list[SampleExcerpt], run_id: str = "run-a") -> EvalFinished:
    metrics = {"eval/accuracy": 0.5, "eval/reward_mean": 0.5, "eval/num_samples": 55.0}
    return EvalFinished(run_id=run_id, rollout_id=rollout_id, metrics=metrics, samples=samples)


FIRST = [kept(0, "3+4=", "7", 1.0), kept(1, "2+2=", "5", 0.0)]
SECOND = [
    kept(0, "Q: what is\n3+4?\nA:", "7\x1b[31m", 1.0, prompt_chars=900),
    kept(1, "1+1=", "", 0.0, finish_reason="length"),
]


def write_log(path: Path, events: list[Event]) -> Path:
    stamped = [msgspec.structs.replace(e, seq=i + 1, time=1.0 + i) for i, e in enumerate(events)]
    with EventLogWriter(path) as writer:
        writer.append_many(stamped)
    return path


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return write_log(
        tmp_path / "events.log",
        [*generated(0, FIRST), *generated(1, SECOND), evaluated(1, FIRST[:1])],
    )


LAST = """\
rollout 1: 2 of 64 samples kept, reward mean 0.375, weight version 2
  [1] prompt #10 (group 0), reward 1, 7 tokens (stop), weight version 2
    prompt:   Q: what is
              3+4?
              A:  [900 characters, middle cut]
    response: 7\\x1b[31m
    label:    7
  [2] prompt #11 (group 1), reward 0, 1 tokens (length), weight version 2
    prompt:   1+1=
    response: (empty)
    label:    7

evaluation at rollout 1: 1 of 55 samples kept, accuracy 0.5, reward mean 0.5
  [1] prompt #10 (group 0), reward 1, 2 tokens (stop), weight version 2
    prompt:   3+4=
    response: 7
    label:    7

"""


def test_by_default_the_last_rollout_and_its_evaluation_are_printed(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--samples"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out == LAST


def test_a_rollout_id_prints_that_rollout(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--samples", "0"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "rollout 0: 2 of 64 samples kept, reward mean 0.375, weight version 2"
    assert "  [2] prompt #11 (group 1), reward 0, 2 tokens (stop), weight version 2" in out
    assert "evaluation" not in out and "rollout 1" not in out


def test_all_prints_every_rollout_and_evaluation_in_log_order(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--samples", "all"]) == 0
    headings = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith(" ")]
    assert [h.split(":")[0] for h in headings] == ["rollout 0", "rollout 1", "evaluation at rollout 1"]


def test_json_is_one_object_per_sample_with_its_rollout(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--samples", "all", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["rollout_id"], r["kind"], r["group"]) for r in rows] == [
        (0, "rollout", 0),
        (0, "rollout", 1),
        (1, "rollout", 0),
        (1, "rollout", 1),
        (1, "eval", 0),
    ]
    assert rows[2]["response"] == "7\x1b[31m" and rows[2]["prompt_chars"] == 900
    assert {r["run_id"] for r in rows} == {"run-a"}


def test_a_log_of_two_runs_names_the_run_and_last_is_the_last_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(
        tmp_path / "events.log",
        [*generated(0, FIRST), *generated(1, FIRST), *generated(1, SECOND, run_id="run-b")],
    )
    assert main([str(log), "--samples"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("run run-b rollout 1: 2 of 64 samples kept")
    assert "run-a" not in out
    assert main([str(log), "--samples", "1"]) == 0
    headings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert [h.split(":")[0] for h in headings] == ["run run-a rollout 1", "run run-b rollout 1"]


def test_a_rollout_the_log_does_not_reach_gets_a_note_and_exit_0(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--samples", "7"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"replay: no rollout 7 in {log} (its rollouts: 0..1)\n"


def test_a_log_written_before_samples_were_kept_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(TINY), "--samples", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rollout 1: 0 of 128 samples kept, reward mean 0.02344, weight version 2",
        "  no samples kept (rollout.log_samples = 0, or a log written before samples were kept)",
        "",
        "evaluation at rollout 1: 0 of 55 samples kept, accuracy 0, reward mean 0",
        "  no samples kept (rollout.log_samples = 0, or a log written before samples were kept)",
        "",
    ]


def test_a_torn_log_prints_what_it_reads_then_exits_1(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log.write_bytes(log.read_bytes()[:-3])  # the evaluation's record is torn
    assert main([str(log), "--samples"]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("rollout 1: 2 of 64 samples kept") and "evaluation" not in captured.out
    [tear] = captured.err.splitlines()
    assert tear.startswith(f"replay: {log}: torn record at byte ")


def test_a_log_without_rollouts_gets_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "events.log", [RolloutRequested(run_id="run-a", rollout_id=0)])
    assert main([str(log), "--samples"]) == 0
    assert capsys.readouterr().err == f"replay: no rollout or evaluation in {log}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "-1"], "argument --samples: '-1' is not a rollout id (0 or more), 'last' or 'all'"),
        (
            ["--samples", "first"],
            "argument --samples: 'first' is not a rollout id (0 or more), 'last' or 'all'",
        ),
        (["--samples", "--rollout-id", "1"], "--samples cannot be combined with --rollout-id"),
        (["--samples", "--source", "generator"], "--samples cannot be combined with --source"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(
    log: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main([str(log), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"replay: {message} (see --help)\n"


def test_the_event_line_counts_the_kept_samples_and_leaves_out_none(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--type", "RolloutGenerated"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.endswith(" samples=<2 kept>") for line in lines)
    assert main([str(TINY), "--type", "RolloutGenerated,EvalFinished"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and not any(" samples=" in line for line in lines)
