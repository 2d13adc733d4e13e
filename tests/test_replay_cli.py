"""``python -m miles_events.replay``: output formats, filters, exit statuses."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from miles_events.app.replay import format_event, main
from miles_events.bus.codec import encode_event
from miles_events.bus.event_log import FRAME_SIZE, HEADER_SIZE, EventLogWriter, TornRecordError
from schemas.data import DataRef
from schemas.events import (
    ActorFailed,
    Event,
    PublicationMismatch,
    RolloutGenerated,
    RolloutRequested,
    RunFinished,
    TensorMismatch,
    TrainMetrics,
    TrainStepFinished,
    WeightsCheckFinished,
    WeightsStaged,
)
from tests.support import flip_byte

REPO = Path(__file__).resolve().parents[1]


def sample_events(rollouts: int = 3) -> list[Event]:
    events: list[Event] = []
    for rollout_id in range(rollouts):
        events.append(RolloutRequested(rollout_id=rollout_id, source="coordinator"))
        events.append(
            RolloutGenerated(
                rollout_id=rollout_id,
                batch=DataRef("inprocess", f"batch-{rollout_id}", "generator"),
                num_samples=4,
                reward_mean=0.25,
                weight_versions=["default"],
                source="generator",
            )
        )
        events.append(
            TrainStepFinished(
                rollout_id=rollout_id,
                weight_version=str(rollout_id),
                metrics=TrainMetrics(
                    loss=0.5,
                    pg_loss=0.5,
                    entropy=1.0,
                    grad_norm=1.0,
                    train_tokens=10,
                    num_optimizer_steps=rollout_id + 1,
                ),
                source="trainer",
            )
        )
    # Stamp the header as the bus would.
    return [msgspec.structs.replace(e, seq=i + 1, time=1_700_000_000.0 + i) for i, e in enumerate(events)]


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "events.log"
    with EventLogWriter(path) as writer:
        writer.append_many(sample_events())
    return path


def test_default_output_is_one_line_per_event(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [format_event(e) for e in sample_events()]


def test_human_line_shows_seq_source_type_and_key_fields() -> None:
    line = format_event(sample_events()[1])
    assert line.split()[0] == "2"
    assert "generator" in line and "RolloutGenerated" in line
    assert "rollout_id=0" in line and "batch=inprocess:batch-0" in line


def test_json_output_is_one_object_per_line_with_type(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--json"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["type"] for o in objects] == [type(e).__name__ for e in sample_events()]
    assert objects[1]["batch"]["key"] == "batch-0"


def test_type_filter_keeps_only_those_types(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--json", "--type", "TrainStepFinished", "--type", "RolloutRequested"]) == 0
    types = {json.loads(line)["type"] for line in capsys.readouterr().out.splitlines()}
    assert types == {"TrainStepFinished", "RolloutRequested"}


def test_source_and_rollout_filters_combine(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--json", "--source", "trainer,generator", "--rollout-id", "1"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(o["type"], o["rollout_id"]) for o in objects] == [
        ("RolloutGenerated", 1),
        ("TrainStepFinished", 1),
    ]


def test_unknown_type_filter_is_a_usage_error(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--type", "NoSuchEvent"]) == 2
    assert "NoSuchEvent" in capsys.readouterr().err


def test_run_directory_reads_its_events_log(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log.parent), "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(sample_events())


def test_torn_log_prints_complete_records_then_exits_1_naming_the_offset(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = sample_events()
    torn_offset = HEADER_SIZE + sum(FRAME_SIZE + len(encode_event(e)) for e in events[:5])
    log.write_bytes(log.read_bytes()[: torn_offset + FRAME_SIZE + 2])
    assert main([str(log), "--json"]) == 1
    captured = capsys.readouterr()
    assert [json.loads(line)["seq"] for line in captured.out.splitlines()] == [1, 2, 3, 4, 5]
    assert captured.err.splitlines() == [
        f"replay: {log}: torn record at byte {torn_offset}: short payload "
        f"(2 of {len(encode_event(events[5]))} bytes)"
    ]


def test_not_an_event_log_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[run]\nseed = 1\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not a miles-events event log" in err


def test_missing_file_exits_2_without_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "nope.log"
    result = subprocess.run(
        [sys.executable, "-m", "miles_events.replay", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == f"replay: {missing}: no such file"


LONG = 100  # rollouts: 300 events


@pytest.fixture
def long_log(tmp_path: Path) -> tuple[Path, list[int]]:
    """A log of a few hundred events, and where each of its records starts."""
    path = tmp_path / "events.log"
    with EventLogWriter(path) as writer:
        offsets = [writer.append(event) for event in sample_events(LONG)]
    return path, offsets


def test_damage_in_the_middle_is_skipped_with_one_warning_per_range_and_exit_0(
    long_log: tuple[Path, list[int]],
) -> None:
    log, offsets = long_log
    flip_byte(log, offsets[100] + FRAME_SIZE + 3)
    flip_byte(log, offsets[200] + 1)  # the length: beyond the end of the file
    result = subprocess.run(
        [sys.executable, "-m", "miles_events.replay", str(log), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    seqs = [json.loads(line)["seq"] for line in result.stdout.splitlines()]
    assert seqs == [seq for seq in range(1, 3 * LONG + 1) if seq not in (101, 201)]
    first, second = result.stderr.splitlines()
    assert first.startswith(
        f"replay: warning: {log}: bytes {offsets[100]}..{offsets[101]} damaged, skipped (CRC mismatch"
    )
    assert second.startswith(
        f"replay: warning: {log}: bytes {offsets[200]}..{offsets[201]} damaged, skipped (short payload"
    )


def test_damage_in_the_middle_and_a_torn_tail_warn_then_exit_1_naming_the_tear(
    long_log: tuple[Path, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    log, offsets = long_log
    flip_byte(log, offsets[100] + FRAME_SIZE + 3)
    log.write_bytes(log.read_bytes()[: offsets[-1] + 5])
    assert main([str(log), "--json"]) == 1
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3 * LONG - 2
    warning, tear = captured.err.splitlines()
    assert warning.startswith(
        f"replay: warning: {log}: bytes {offsets[100]}..{offsets[101]} damaged, skipped (CRC mismatch"
    )
    assert tear == f"replay: {log}: torn record at byte {offsets[-1]}: short header (5 of 8 bytes)"


def test_the_side_file_of_a_repaired_tail_replays_as_a_torn_record(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = sample_events()
    log.write_bytes(log.read_bytes()[:-4])
    with pytest.raises(TornRecordError):
        EventLogWriter(log)
    with EventLogWriter(log, repair=True) as writer:
        side = writer.torn_copy
    assert side is not None
    assert main([str(side)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    size = len(encode_event(events[-1]))
    assert captured.err.splitlines() == [
        f"replay: {side}: torn record at byte {HEADER_SIZE}: short payload ({size - 4} of {size} bytes)"
    ]
    assert main([str(log), "--json"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(events) - 1


def test_redrive_of_a_log_torn_before_its_first_record_exits_1_naming_the_tear(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log.write_bytes(log.read_bytes()[: HEADER_SIZE + 5])
    assert main([str(log), "--redrive", "coordinator"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"replay: {log}: torn record at byte {HEADER_SIZE}: short header (5 of 8 bytes)"
    ]


# --- what a user needs to diagnose a failure is printed whole ---------------------------------

LONG_REASON = (
    "sink metrics failed to start: cannot listen on 127.0.0.1:9464 ([Errno 98] Address already in use); "
    "choose another metrics.port (0 picks one) or set metrics.enabled = false"
)
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/src/actors/trainer.py", line 412, in on_rollout_generated\n'
    "    loss = self.backend.train(batch)\n"
    '  File "/src/actors/trainer_backend/torch_backend.py", line 88, in train\n'
    "    raise RuntimeError(message)\n"
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 139.81 GiB total capacity)\n"
)


def test_a_long_failure_reason_is_printed_whole() -> None:
    line = format_event(
        RunFinished(status="failed", reason=LONG_REASON, last_rollout_id=3, seq=9, source="coordinator")
    )
    assert f"reason={LONG_REASON!r}" in line
    assert "..." not in line


def test_a_long_actor_error_is_printed_whole() -> None:
    error = "RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB (at torch_backend.py:88)"
    line = format_event(ActorFailed(actor="trainer", error=error, seq=9, source="trainer"))
    assert f"error={error!r}" in line


def test_a_traceback_is_printed_whole_indented_under_its_event() -> None:
    failed = ActorFailed(
        actor="trainer",
        error="RuntimeError: CUDA out of memory",
        event_type="RolloutGenerated",
        event_seq=12,
        traceback=TRACEBACK,
        seq=13,
        source="trainer",
    )
    first, label, *body = format_event(failed).splitlines()
    assert "ActorFailed" in first and "event_seq=12" in first and "traceback" not in first
    assert label == "        traceback:"
    assert body == ["          " + line for line in TRACEBACK.splitlines()]


def test_a_publication_mismatch_names_every_tensor_and_digest_whole() -> None:
    mismatches = [
        TensorMismatch(
            engine="engine-1",
            tensor=f"model.layers.{i}.mlp.down_proj.weight",
            expected="a" * 16,
            actual="b" * 16,
        )
        for i in range(6)
    ]
    event = PublicationMismatch(
        weight_version="3",
        mismatches=mismatches,
        expected_digest="c" * 64,
        engine_digests={"engine-0": "c" * 64, "engine-1": "d" * 64},
        rollout_id=1,
        seq=30,
        source="verifier",
    )
    first, label, *body = format_event(event).splitlines()
    assert f"expected_digest={'c' * 64}" in first and f"engine-1:{'d' * 64}" in first
    assert label == "        mismatches (6):"
    assert body == [
        f"          engine=engine-1 tensor={m.tensor} expected={'a' * 16} actual={'b' * 16} reason=''"
        for m in mismatches
    ]


def test_a_failed_weight_check_message_is_printed_whole() -> None:
    message = "12 tensors differ from the snapshot: model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, ..."
    line = format_event(
        WeightsCheckFinished(engine="engine-0", action="compare", success=False, message=message)
    )
    assert f"message={message!r}" in line


def test_other_long_fields_stay_abbreviated() -> None:
    line = format_event(sample_events()[0])
    staged = format_event(
        WeightsStaged(
            weight_version="2",
            weights=DataRef("inprocess", "w", "trainer"),
            digest="e" * 64,
            num_tensors=1,
            num_bytes=4,
        )
    )
    assert line.startswith("     1 ")
    assert "digest=" + "e" * 45 + "..." in staged


def test_json_keeps_a_traceback_and_a_long_reason_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.log"
    with EventLogWriter(path) as writer:
        writer.append(ActorFailed(actor="trainer", error="RuntimeError: x", traceback=TRACEBACK, seq=1))
        writer.append(RunFinished(status="failed", reason=LONG_REASON, seq=2))
    assert main([str(path), "--json"]) == 0
    failed, finished = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert failed["traceback"] == TRACEBACK and finished["reason"] == LONG_REASON


# --- a path that is not an event log: one line, exit 2, never a hang ----------------------------


def run_replay(*args: str, preexec_fn=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "miles_events.replay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=preexec_fn,
    )


def without_root_file_access() -> None:
    """In a child about to exec: drop root's right to read any file (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH leave the bounding set, so the exec'd program lacks them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_directory_without_an_event_log_is_named_as_such_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"replay: {tmp_path} is a directory without events.log\n"


def test_a_fifo_is_refused_at_once_with_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "events.log"
    os.mkfifo(fifo)
    result = run_replay(str(fifo))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"replay: {fifo} is not a regular file (a FIFO)\n"


def test_a_run_directory_whose_event_log_is_a_fifo_is_refused_with_one_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "events.log")
    result = run_replay(str(tmp_path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"replay: {tmp_path / 'events.log'} is not a regular file (a FIFO)\n"


def test_a_config_that_is_a_fifo_is_refused_with_one_line(log: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "run.toml"
    os.mkfifo(fifo)
    result = run_replay(str(log), "--redrive", "coordinator", "--config", str(fifo))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"replay: --config {fifo} is not a regular file (a FIFO)\n"


def test_an_unreadable_log_is_one_line_with_exit_2(log: Path) -> None:
    log.chmod(0)
    try:
        result = run_replay(str(log), preexec_fn=without_root_file_access if os.geteuid() == 0 else None)
    except subprocess.SubprocessError as error:
        pytest.skip(f"cannot drop root's file access here ({error})")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"replay: {log}: cannot read it (Permission denied)\n"


# --- filters that cannot match ---------------------------------------------------------------


def test_a_source_no_event_comes_from_is_one_line_with_exit_2(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--source", "trainer,nobody"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"replay: --source nobody: no event in {log} comes from it (its sources: coordinator, generator, trainer)\n"
    )


def test_a_negative_rollout_id_is_one_line_with_exit_2(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--rollout-id", "-3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "replay: --rollout-id -3: a rollout id is 0 or more\n"


def test_a_bad_argument_is_one_line_with_exit_2(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(log), "--rollout-id", "two"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "replay: argument --rollout-id: invalid int value: 'two' (see --help)\n"


def test_a_rollout_without_events_gets_a_one_line_note_and_exit_0(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--rollout-id", "7"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"replay: no event of rollout 7 in {log} (its rollouts: 0..2)\n"


def test_filters_that_select_nothing_get_a_one_line_note_and_exit_0(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(log), "--type", "RolloutRequested", "--source", "trainer"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"replay: no event in {log} matches the filters\n"


def test_an_actor_failure_belongs_to_the_rollout_of_the_event_it_failed_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = sample_events(2)
    generated = events[4]  # RolloutGenerated of rollout 1
    failed = ActorFailed(
        actor="trainer", error="RuntimeError: x", event_type="RolloutGenerated", event_seq=generated.seq
    )
    other = ActorFailed(actor="saver", error="OSError: y")
    path = tmp_path / "events.log"
    with EventLogWriter(path) as writer:
        writer.append_many(
            [*events, msgspec.structs.replace(failed, seq=7), msgspec.structs.replace(other, seq=8)]
        )
    assert main([str(path), "--json", "--rollout-id", "1"]) == 0
    seqs = [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()]
    assert seqs == [4, 5, 6, 7]
