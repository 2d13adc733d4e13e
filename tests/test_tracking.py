"""Tracking sinks, driven through a real bus by the recorded run in tests/fixtures/tiny_run
(3 rollouts, evals at 0..2, checkpoints at 1 and 2), closed the way the session closes sinks."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from miles_events.bus.event_bus import EventBus
from miles_events.bus.event_log import read_events
from miles_events.sinks import tracking
from miles_events.sinks.base import SinkContext
from miles_events.sinks.tracking import TrackingError, TrackingSink, WandbSink, make_tracking
from schemas.config import Config, RunConfig, TrackingConfig
from schemas.events import CheckpointSaved, Event, RunFinished
from tests.support import drive_sink, with_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_run" / "events.log"
EVENTS: list[Event] = list(read_events(FIXTURE))
SPEC_SCALARS = {
    "rollout/reward_mean", "rollout/response_tokens", "train/loss", "train/pg_loss", "train/kl",
    "train/entropy", "train/grad_norm", "train/clipfrac", "perf/generate_seconds", "perf/train_seconds",
    "perf/publish_seconds", "perf/verify_seconds", "checkpoint/save_seconds", "weights/version",
    "eval/accuracy", "eval/reward_mean",
}  # fmt: skip


def config_with(tmp_path: Path, **settings: Any) -> Config:
    return Config(run=RunConfig(dir=str(tmp_path)), tracking=TrackingConfig(**settings))


async def drive(
    sink: TrackingSink, events: list[Event], config: Config | None = None, run_dir: Path | None = None
) -> Any:
    """Run ``sink`` over a real bus as the session does (run id ``run-1``)."""
    sink.host = await drive_sink(sink, events, config, run_dir, run_id="run-1")
    return sink


def only(sinks: list[TrackingSink]) -> TrackingSink:
    assert len(sinks) == 1
    return sinks[0]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: [(s.step, s.value) for s in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


async def test_tensorboard_logs_every_scalar_at_its_rollout_step(tmp_path):
    await drive(
        only(make_tracking(config_with(tmp_path, tensorboard=True))),
        EVENTS,
        config_with(tmp_path, tensorboard=True),
        tmp_path,
    )
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "run-1")
    assert SPEC_SCALARS <= set(scalars)
    assert scalars["rollout/reward_mean"] == [(0, 0.0078125), (1, 0.0234375), (2, 0.0234375)]
    assert scalars["weights/version"] == [(0, 2.0), (1, 3.0), (2, 4.0)]
    assert [step for step, _ in scalars["checkpoint/save_seconds"]] == [1, 2]


async def test_tensorboard_logs_each_ranks_time_and_memory_for_a_trainer_of_two_ranks(tmp_path):
    config = config_with(tmp_path, tensorboard=True)
    await drive(only(make_tracking(config)), with_ranks(EVENTS, 2), config, tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard" / "run-1")
    assert scalars["train/rank1/step_seconds"] == [
        (0, pytest.approx(0.11)),
        (1, pytest.approx(0.21)),
        (2, pytest.approx(0.31)),
    ]
    assert scalars["train/rank0/peak_memory_bytes"] == [(step, 400 * 2**20) for step in (0, 1, 2)]
    assert scalars["train/rank1/state_bytes"] == [(step, 91 * 2**20) for step in (0, 1, 2)]


async def test_a_trainer_of_one_rank_logs_no_per_rank_scalars(tmp_path):
    config = config_with(tmp_path, tensorboard=True)
    await drive(only(make_tracking(config)), with_ranks(EVENTS, 1, "none"), config, tmp_path)
    assert not [tag for tag in tensorboard_scalars(tmp_path / "tensorboard" / "run-1") if "/rank" in tag]


async def test_tensorboard_logs_evals_at_the_eval_rollout_id_including_before_training(tmp_path):
    await drive(
        only(make_tracking(config_with(tmp_path, tensorboard=True))),
        EVENTS,
        config_with(tmp_path, tensorboard=True),
        tmp_path,
    )
    accuracy = tensorboard_scalars(tmp_path / "tensorboard" / "run-1")["eval/accuracy"]
    assert [step for step, _ in accuracy] == [0, 1, 2]
    assert accuracy[2][1] == pytest.approx(1 / 55)


async def test_tensorboard_writes_to_the_configured_directory(tmp_path):
    target = tmp_path / "elsewhere"
    await drive(
        only(make_tracking(config_with(tmp_path, tensorboard=True, tensorboard_dir=str(target)))),
        EVENTS,
        config_with(tmp_path, tensorboard=True, tensorboard_dir=str(target)),
        tmp_path,
    )
    assert list(target.glob("events.out.tfevents.*"))
    assert not (tmp_path / "tensorboard").exists()


def wandb_records(path: Path) -> list[Any]:
    """The records of an offline ``.wandb`` file (LevelDB log framing around protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # block trailer too small for a header
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_diagnosis(run_file: Path, records: list[Any]) -> str:
    """What an offline run wrote, for a failed assertion: its record types, in order, and the
    end of wandb's own log of the run."""
    kinds = [r.WhichOneof("record_type") for r in records]
    internal = run_file.parent / "logs" / "debug-internal.log"
    tail = internal.read_text(errors="replace").splitlines()[-40:] if internal.exists() else ["(no log)"]
    return f"{run_file.stat().st_size} bytes, records {kinds}; debug-internal.log ends:\n" + "\n".join(tail)


async def test_wandb_offline_run_records_the_metrics_against_rollout_id_and_finishes(tmp_path, monkeypatch):
    # The sink sets these for wandb's service process; restore them after the test.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_dir = tmp_path / "wb"
    await drive(
        only(make_tracking(config_with(tmp_path, wandb=True, wandb_dir=str(wandb_dir)))),
        EVENTS,
        config_with(tmp_path, wandb=True, wandb_dir=str(wandb_dir)),
        tmp_path,
    )
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-run-1.wandb")
    records = wandb_records(run_file)
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    rewards = [
        (row["rollout_id"], row["rollout/reward_mean"]) for row in history if "rollout/reward_mean" in row
    ]
    assert rewards == [(0, 0.0078125), (1, 0.0234375), (2, 0.0234375)], wandb_diagnosis(run_file, records)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.run_id == "run-1" and run_record.project == "miles-events"
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


class FakeRun:
    """Records what a wandb run is asked to do."""

    def __init__(self, fail_log: bool = False) -> None:
        self.logged: list[dict[str, float]] = []
        self.metrics: dict[str, str | None] = {}
        self.exit_code: int | None = None
        self.fail_log = fail_log

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics[name] = step_metric

    def log(self, row: dict[str, float]) -> None:
        if self.fail_log:
            raise RuntimeError("wandb service died")
        self.logged.append(row)

    def finish(self, exit_code: int = 0) -> None:
        self.exit_code = exit_code


@pytest.mark.parametrize(
    ("ending", "exit_code"),
    [
        (RunFinished(status="completed"), 0),
        (RunFinished(status="stopped", reason="interrupted"), 0),
        (RunFinished(status="failed", reason="trainer failed"), 1),
        (None, 1),
    ],
)
async def test_wandb_finishes_with_exit_code_1_only_when_the_run_failed_or_never_finished(ending, exit_code):
    run = FakeRun()
    events = [*EVENTS[:-1], *([ending] if ending else [])]
    await drive(WandbSink(run), events)
    assert run.exit_code == exit_code


async def test_wandb_plots_every_section_against_rollout_id():
    run = FakeRun()
    await drive(WandbSink(run), EVENTS)
    assert run.metrics["rollout_id"] is None
    assert {run.metrics[f"{s}/*"] for s in ("rollout", "train", "perf", "weights", "checkpoint", "eval")} == {
        "rollout_id"
    }


async def test_wandb_logs_each_ranks_scalars_with_the_train_step_against_rollout_id():
    run = FakeRun()
    await drive(WandbSink(run), with_ranks(EVENTS, 2))
    (row,) = [r for r in run.logged if r["rollout_id"] == 2 and "train/loss" in r]
    assert {k: row[k] for k in row if "/rank" in k} == pytest.approx(
        {
            "train/rank0/step_seconds": 0.30,
            "train/rank0/peak_memory_bytes": 400 * 2**20,
            "train/rank0/state_bytes": 90 * 2**20,
            "train/rank1/step_seconds": 0.31,
            "train/rank1/peak_memory_bytes": 410 * 2**20,
            "train/rank1/state_bytes": 91 * 2**20,
        }
    )
    assert run.metrics["train/*"] == "rollout_id"


async def test_wandb_keeps_a_checkpoint_that_finishes_after_later_rollouts():
    run = FakeRun()
    late = CheckpointSaved(rollout_id=0, path="/ckpt/0", weight_version="1", num_bytes=1, save_seconds=7.5)
    await drive(WandbSink(run), [*EVENTS[:-1], late, EVENTS[-1]])
    assert run.logged[-1] == {"rollout_id": 0, "checkpoint/save_seconds": 7.5}


async def test_a_backend_that_fails_to_log_keeps_draining_and_still_finishes():
    run = FakeRun(fail_log=True)
    sink = await drive(WandbSink(run), EVENTS)
    assert sink.host.mailbox.statistics().depth == 0
    assert run.exit_code == 0


async def test_enabling_wandb_without_the_package_is_a_one_line_tracking_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TrackingError) as raised:
        make_tracking(config_with(tmp_path, wandb=True))
    message = str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert "\n" not in message and "tracking.wandb" in message and "pip install wandb" in message


async def test_a_backend_failing_to_start_raises_its_one_line_error(tmp_path, monkeypatch):
    def refuse(_context: object) -> None:
        raise TrackingError("tracking.wandb: cannot start a online run: api key not configured")

    monkeypatch.setattr(tracking, "start_wandb", refuse)
    config = config_with(tmp_path, wandb=True)
    bus = EventBus("run-1")

    async def fail(reason: str) -> None:
        raise AssertionError(reason)

    with pytest.raises(TrackingError, match="api key"):
        await only(make_tracking(config)).start(SinkContext("run-1", tmp_path, config, bus, fail))
    assert bus.mailboxes() == []


def test_no_backend_enabled_is_no_sink(tmp_path):
    assert make_tracking(config_with(tmp_path)) == []
