"""The session's guards: unusable run directories, a reused base model, a dead event log,
sinks that cannot start."""

from __future__ import annotations

import asyncio
import gc

import pytest

from actors.coordinator import Coordinator
from miles_events.app.run_dir import RunDirError, open_event_log
from miles_events.app.session import Session
from miles_events.bus.actor import Actor
from miles_events.bus.event_bus import EventBus
from miles_events.bus.event_log import FRAME_SIZE, MAGIC, EventLogWriter, read_events
from miles_events.bus.handlers import handles
from miles_events.checkpoint.format import CheckpointError
from miles_events.rl.hf_model import BaseModelMismatch, modeling_module, prepare_base_model
from miles_events.sinks.base import Sink, SinkContext, SinkHost
from miles_events.sinks.event_log import EventLogSink
from miles_events.sinks.metrics import MetricsError
from miles_events.sinks.tracking import TrackingError
from schemas.config import BuiltinModelConfig, Config, ModelConfig, RunConfig
from schemas.events import Event, PublishRequested, RolloutRequested, RunFinished


def test_a_run_dir_under_a_file_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="run.dir .*file/run: Not a directory"):
        open_event_log(blocker / "run")


def test_a_run_dir_in_use_by_another_run_is_refused(tmp_path):
    first = open_event_log(tmp_path)
    try:
        with pytest.raises(RunDirError, match="in use by another run"):
            open_event_log(tmp_path)
    finally:
        first.close()


def test_a_torn_log_is_repaired_and_its_tail_kept(tmp_path):
    writer = open_event_log(tmp_path)
    writer.append(RolloutRequested(rollout_id=0, seq=1))
    writer.close()
    with open(tmp_path / "events.log", "ab") as log:
        log.write(b"\x00\x00\x01")  # a crash mid-record
    repaired = open_event_log(tmp_path)
    assert repaired.torn_copy is not None and repaired.torn_copy.read_bytes() == MAGIC + b"\x00\x00\x01"
    repaired.close()


def test_damage_in_the_middle_of_the_log_is_logged_and_the_records_after_it_kept(tmp_path, caplog):
    writer = open_event_log(tmp_path)
    offsets = [writer.append(RolloutRequested(rollout_id=i, seq=i + 1)) for i in range(3)]
    writer.close()
    data = bytearray((tmp_path / "events.log").read_bytes())
    data[offsets[1] + FRAME_SIZE + 2] ^= 0x40
    (tmp_path / "events.log").write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="miles_events.app.run_dir"):
        resumed = open_event_log(tmp_path)
    try:
        assert resumed.torn_copy is None and resumed.offset == len(data)
        resumed.append(RolloutRequested(rollout_id=3, seq=4))
    finally:
        resumed.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'events.log'}: bytes {offsets[1]}..{offsets[2]} are damaged "
        f"({resumed.damaged[0].reason}); the records after them are kept"
    ]
    damaged = []
    assert [e.rollout_id for e in read_events(tmp_path / "events.log", on_damage=damaged.append)] == [0, 2, 3]
    assert len(damaged) == 1


def test_the_built_in_model_of_a_run_dir_is_not_silently_replaced(tmp_path):
    prepare_base_model(ModelConfig(), tmp_path, seed=1)
    assert prepare_base_model(ModelConfig(), tmp_path, seed=1) == tmp_path / "base_model"
    with pytest.raises(BaseModelMismatch, match="run.seed"):
        prepare_base_model(ModelConfig(), tmp_path, seed=2)
    with pytest.raises(BaseModelMismatch):
        prepare_base_model(ModelConfig(builtin=BuiltinModelConfig(hidden_size=32)), tmp_path, seed=1)


class FullDisk(EventLogWriter):
    def append_many(self, events):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")


async def test_an_event_log_that_cannot_be_written_fails_the_run_without_blocking_the_bus(tmp_path):
    bus = EventBus("r", mailbox_size=8)
    finished = bus.subscribe("watch", (RunFinished,))
    sink = EventLogSink(FullDisk(tmp_path / "events.log"))

    async def fail(reason: str) -> None:
        await bus.publish(RunFinished(status="failed", reason=reason))

    await sink.start(SinkContext("r", tmp_path, Config(), bus, fail))
    host = SinkHost(sink, bus, max_batch=4)
    for i in range(200):  # far more than the log's mailbox holds
        await asyncio.wait_for(bus.publish(RolloutRequested(rollout_id=i)), 1)
    event: Event = await asyncio.wait_for(finished.get(), 1)
    assert isinstance(event, RunFinished) and event.status == "failed"
    assert "No space left on device" in event.reason
    bus.close()
    await asyncio.wait_for(host.join(), 1)
    await sink.close()


class Opened(Sink):
    def __init__(self, name: str, refuse: bool = False) -> None:
        self.name = name  # type: ignore[misc]
        self.refuse = refuse
        self.closed = False

    async def start(self, context: SinkContext) -> None:
        if self.refuse:
            raise TrackingError(f"{self.name}: cannot start")

    async def close(self) -> None:
        self.closed = True


async def test_a_sink_failing_to_start_stops_the_run_and_closes_the_sinks_started_before_it(tmp_path):
    config = Config(run=RunConfig(dir=str(tmp_path), runtime="local", num_rollout=1))
    first, refusing, after = Opened("first"), Opened("second", refuse=True), Opened("third")
    session = Session(config, [Coordinator], sinks=[first, refusing, after])
    with pytest.raises(TrackingError, match="second: cannot start"):
        await session.run()
    assert first.closed and refusing.closed and not after.closed
    assert session.log_writer.closed
    [finished] = [e for e in read_events(tmp_path / "events.log") if isinstance(e, RunFinished)]
    assert finished.status == "failed" and "sink second failed to start" in finished.reason


def test_a_run_that_cannot_be_planned_writes_nothing(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    config = Config(run=RunConfig(dir=str(run_dir), runtime="local", num_rollout=1))

    def refuse(*args: object) -> None:
        raise CheckpointError("checkpoint rollout_000003: model.safetensors does not match its sha256")

    monkeypatch.setattr("miles_events.app.start_checks.make_plan", refuse)
    with pytest.raises(CheckpointError):
        Session(config, [Coordinator])
    assert not run_dir.exists()


class Held(Sink):
    """A sink whose ``prepare`` takes something (as the metrics exporter takes its port)."""

    def __init__(self, name: str, refuse: bool = False) -> None:
        self.name = name  # type: ignore[misc]
        self.refuse = refuse
        self.held = False

    def prepare(self, config: Config) -> None:
        if self.refuse:
            raise MetricsError(f"{self.name}: cannot serve on 127.0.0.1:9464: Address already in use")
        self.held = True

    def release(self) -> None:
        self.held = False


def test_a_sink_refusing_its_checks_ends_the_start_with_nothing_written_and_every_hold_given_back(tmp_path):
    """A busy metrics port or tracking without credentials: one error, before the run
    directory, its event log or its configs exist, and a later run there starts cleanly."""
    run_dir = tmp_path / "run"
    config = Config(run=RunConfig(dir=str(run_dir), runtime="local", num_rollout=1))
    first, refusing = Held("first"), Held("second", refuse=True)
    with pytest.raises(MetricsError, match="second: cannot serve"):
        Session(config, [Coordinator], sinks=[first, refusing])
    assert not first.held and not run_dir.exists()


class Boom(Actor):
    name = "trainer"

    @handles(PublishRequested, emits=())
    async def on_publish(self, event: PublishRequested) -> None:
        raise RuntimeError("CUDA out of memory")


async def test_a_failing_run_still_closes_every_sink(tmp_path):
    """Tracking and the other sinks are finished on every exit path (the seed's ``finally:
    finish_tracking()``), a failure included."""
    config = Config(run=RunConfig(dir=str(tmp_path), runtime="local", num_rollout=1))
    tracking = Opened("tracking")
    result = await Session(config, [Boom, Coordinator], sinks=[tracking]).run()
    assert result.finished.status == "failed" and "CUDA out of memory" in result.finished.reason
    assert tracking.closed


def test_the_models_transformers_module_is_named_from_its_files_without_importing_transformers(tmp_path):
    assert modeling_module(ModelConfig()) == "transformers.models.qwen2.modeling_qwen2"
    assert (
        modeling_module(ModelConfig(builtin=BuiltinModelConfig(architecture="llama")))
        == "transformers.models.llama.modeling_llama"
    )
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    assert modeling_module(ModelConfig(path=str(tmp_path))) == "transformers.models.mistral.modeling_mistral"
    for written in ('{"model_type": "no_such_model"}', '{"model_type": "../x"}', "{}", "not json"):
        (tmp_path / "config.json").write_text(written)
        assert modeling_module(ModelConfig(path=str(tmp_path))) is None, written
    assert modeling_module(ModelConfig(path=str(tmp_path / "missing"))) is None


class FreezeProbe(Actor):
    """Records how many objects the collector leaves out when the loop begins."""

    name = "trainer"
    frozen_when_the_loop_began = -1

    @handles(PublishRequested, emits=())
    async def on_publish(self, event: PublishRequested) -> None:
        FreezeProbe.frozen_when_the_loop_began = gc.get_freeze_count()
        raise RuntimeError("enough")


async def test_what_start_up_built_is_left_out_of_full_collections_while_the_run_goes_on(tmp_path):
    config = Config(run=RunConfig(dir=str(tmp_path), runtime="local", num_rollout=1))
    assert gc.get_freeze_count() == 0
    await Session(config, [FreezeProbe, Coordinator]).run()
    assert FreezeProbe.frozen_when_the_loop_began > 10_000, "the imports and the actors' objects"
    assert gc.get_freeze_count() == 0, "given back once the run is over"
