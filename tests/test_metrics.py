"""The Prometheus exporter: metrics rebuilt from the recorded tiny run, the live endpoint,
the metrics reference, and ``replay --serve-metrics``."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from miles_events.bus.event_bus import EventBus
from miles_events.bus.event_log import read_events
from miles_events.sinks.base import SinkContext, SinkHost
from miles_events.sinks.metrics import (
    METRICS,
    MetricsError,
    MetricsExporter,
    MetricsServer,
    RunMetrics,
    metrics_exporter,
)
from schemas.config import Config
from schemas.data import DataRef
from schemas.events import (
    ActorFailed,
    CriticMetrics,
    CriticStepFinished,
    EvalFinished,
    Event,
    FaultInjected,
    MemoryOffloaded,
    PublicationMismatch,
    PublicationVerified,
    RankStep,
    RunFinished,
    RunStarted,
    TensorMismatch,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainStepFinished,
    WeightsPublished,
    WeightsStaged,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURE_LOG = REPO / "tests" / "fixtures" / "tiny_run" / "events.log"
FAILURE_ONLY = {"miles_actor_failures_total"}
"""Metrics that get a series only when something fails (the fixture run succeeded)."""
PER_RANK = {
    "miles_trainer_rank_step_seconds",
    "miles_trainer_rank_peak_memory_bytes",
    "miles_trainer_rank_state_bytes",
}
"""Metrics of a trainer that reports its ranks (``TrainStepFinished.ranks``; the fixture
run's trainer did not)."""
FAULT_ONLY = {"miles_fault_injections_total"}
"""Series only once a fault is injected through the control server."""
BY_STALENESS = {"miles_trained_tokens_by_staleness_total"}
"""Series from steps that report their tokens' staleness (the recorded log predates it)."""
OFFLOAD_ONLY = {
    "miles_memory_moved_bytes",
    "miles_memory_device_freed_bytes",
    "miles_memory_move_duration_seconds",
}
"""Metrics of runs that offload (``run.offload_train``, ``run.offload_rollout``)."""
PPO_ONLY = {
    "miles_critic_value_loss",
    "miles_critic_value_clipfrac",
    "miles_critic_value_mean",
    "miles_critic_return_mean",
    "miles_critic_duration_seconds",
}
"""Metrics of PPO's critic (``CriticStepFinished``; the fixture run is GRPO)."""


def critic_step(run_id: str = "r", rollout_id: int = 0) -> CriticStepFinished:
    return CriticStepFinished(
        rollout_id=rollout_id,
        values=DataRef("inprocess", f"critic-values-r{rollout_id}", "critic", 8),
        metrics=CriticMetrics(value_loss=0.25, value_clipfrac=0.125, value_mean=0.5, return_mean=0.75),
        train_seconds=0.5,
        run_id=run_id,
    )


def test_a_critic_step_sets_the_critic_metrics() -> None:
    metrics = RunMetrics()
    metrics.observe(critic_step())
    assert value(metrics, "miles_critic_value_loss", run="r") == 0.25
    assert value(metrics, "miles_critic_value_clipfrac", run="r") == 0.125
    assert value(metrics, "miles_critic_value_mean", run="r") == 0.5
    assert value(metrics, "miles_critic_return_mean", run="r") == 0.75
    assert value(metrics, "miles_critic_duration_seconds_count", run="r") == 1


def two_rank_step(run_id: str = "r", rollout_id: int = 0) -> TrainStepFinished:
    return TrainStepFinished(
        rollout_id=rollout_id,
        weight_version=str(rollout_id),
        train_seconds=1.25,
        token_staleness=[0, 40, 2],
        stale_samples=1,
        stale_tokens=3,
        ranks=[
            RankStep(rank=0, pid=11, step_seconds=1.25, peak_memory_bytes=430 << 20, state_bytes=96 << 20),
            RankStep(rank=1, pid=12, step_seconds=1.5, peak_memory_bytes=400 << 20, state_bytes=94 << 20),
        ],
        run_id=run_id,
    )


@pytest.fixture(scope="module")
def events() -> list[Event]:
    return list(read_events(FIXTURE_LOG))


@pytest.fixture(scope="module")
def run_id(events: list[Event]) -> str:
    return events[0].run_id


@pytest.fixture(scope="module")
def observed(events: list[Event]) -> RunMetrics:
    metrics = RunMetrics()
    for event in events:
        metrics.observe(event)
    return metrics


def value(metrics: RunMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def series(metrics: RunMetrics, name: str) -> list[dict[str, str]]:
    return [s.labels for family in metrics.registry.collect() for s in family.samples if s.name == name]


def exposed_name(family: Metric) -> str:
    return family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")


def last(events: list[Event], kind: type[Event]) -> Event:
    return [e for e in events if isinstance(e, kind)][-1]


# --- metrics rebuilt from the recorded run ------------------------------------------------


def test_final_weight_versions_equal_the_last_published_version(observed: RunMetrics, events, run_id) -> None:
    published = int(last(events, WeightsPublished).weight_version)  # type: ignore[attr-defined]
    assert value(observed, "miles_weight_version", run=run_id, role="trainer", engine="") == published
    for engine in ("engine-0", "engine-1"):
        assert value(observed, "miles_weight_version", run=run_id, role="engine", engine=engine) == published


def test_verified_publications_count_the_verified_events(observed: RunMetrics, events, run_id) -> None:
    verified = sum(isinstance(e, PublicationVerified) for e in events)
    assert verified > 0
    assert value(observed, "miles_publications_total", run=run_id, outcome="verified") == verified


def test_every_publication_outcome_has_a_series_from_run_start(observed: RunMetrics, run_id) -> None:
    assert value(observed, "miles_publications_total", run=run_id, outcome="mismatch") == 0
    assert value(observed, "miles_publications_total", run=run_id, outcome="failed") == 0


def test_checksum_info_has_one_current_series_per_role_and_engine(
    observed: RunMetrics, events, run_id
) -> None:
    info = series(observed, "miles_weight_checksum_info")
    assert sorted((s["role"], s["engine"]) for s in info) == [
        ("engine", "engine-0"),
        ("engine", "engine-1"),
        ("trainer", ""),
    ]
    staged = last(events, WeightsStaged)
    assert {(s["weight_version"], s["digest"]) for s in info} == {(staged.weight_version, staged.digest)}  # type: ignore[attr-defined]


def test_eval_score_has_each_metric_of_the_last_eval(observed: RunMetrics, events, run_id) -> None:
    evaluated = last(events, EvalFinished).metrics  # type: ignore[attr-defined]
    assert evaluated
    for metric, score in evaluated.items():
        assert value(observed, "miles_eval_score", run=run_id, metric=metric) == pytest.approx(score)
    assert {s["metric"] for s in series(observed, "miles_eval_score")} == set(evaluated)


def test_token_counters_sum_the_rollouts_and_train_steps(observed: RunMetrics, events, run_id) -> None:
    generated = sum(getattr(e, "response_tokens", 0) for e in events)
    trained = sum(e.metrics.train_tokens for e in events if isinstance(e, TrainStepFinished))
    assert value(observed, "miles_tokens_generated_total", run=run_id) == generated
    assert value(observed, "miles_train_tokens_total", run=run_id) == trained


def test_bus_events_are_counted_by_type(observed: RunMetrics, events, run_id) -> None:
    for kind in {type(e) for e in events}:
        count = sum(type(e) is kind for e in events)
        assert value(observed, "miles_bus_events_total", run=run_id, type=kind.__name__) == count


def test_run_info_and_finished_show_the_final_status(observed: RunMetrics, run_id) -> None:
    assert series(observed, "miles_run_info") == [{"run": run_id, "runtime": "local", "status": "completed"}]
    assert value(observed, "miles_run_finished", run=run_id) == 1


def test_checkpoint_metrics_follow_the_saves(observed: RunMetrics, run_id) -> None:
    assert value(observed, "miles_checkpoint_last_rollout_id", run=run_id) == 2
    assert value(observed, "miles_checkpoints_total", run=run_id, outcome="saved") == 2
    assert value(observed, "miles_checkpoint_duration_seconds_count", run=run_id) == 2


def test_publication_durations_are_observed_per_phase(observed: RunMetrics, events, run_id) -> None:
    publications = sum(isinstance(e, WeightsPublished) for e in events)
    for phase in ("stage", "load", "total"):
        assert (
            value(observed, "miles_publication_duration_seconds_count", run=run_id, phase=phase)
            == publications
        )


def test_every_series_carries_the_run_label(observed: RunMetrics, run_id) -> None:
    samples = [s for family in observed.registry.collect() for s in family.samples]
    assert samples
    assert all(s.labels.get("run") == run_id for s in samples)


def test_runs_in_one_log_get_separate_series(events: list[Event], run_id: str) -> None:
    metrics = RunMetrics()
    for event in events:
        metrics.observe(event)
    for event in events[:8]:  # a second run up to its first verified publication
        metrics.observe(msgspec.structs.replace(event, run_id="other"))
    assert value(metrics, "miles_weight_version", run=run_id, role="trainer", engine="") == 4
    assert value(metrics, "miles_weight_version", run="other", role="trainer", engine="") == 1
    assert value(metrics, "miles_publications_total", run="other", outcome="verified") == 1


def test_mismatch_counts_and_records_the_mismatched_tensors(events: list[Event], run_id: str) -> None:
    metrics = RunMetrics()
    metrics.observe(events[0])
    mismatch = PublicationMismatch(
        weight_version="1",
        mismatches=[TensorMismatch("engine-0", "lm_head.weight", "a" * 16, "b" * 16)] * 3,
        expected_digest="x",
        engine_digests={"engine-0": "y"},
        verify_seconds=0.002,
        run_id=run_id,
    )
    metrics.observe(mismatch)
    assert value(metrics, "miles_publications_total", run=run_id, outcome="mismatch") == 1
    assert value(metrics, "miles_publication_mismatched_tensors", run=run_id) == 3
    assert value(metrics, "miles_verification_duration_seconds_count", run=run_id) == 1


def test_a_two_rank_step_sets_each_ranks_time_and_memory_labelled_by_rank() -> None:
    metrics = RunMetrics()
    metrics.observe(two_rank_step())
    for rank, seconds, peak, state in (("0", 1.25, 430 << 20, 96 << 20), ("1", 1.5, 400 << 20, 94 << 20)):
        assert value(metrics, "miles_trainer_rank_step_seconds", run="r", rank=rank) == seconds
        assert value(metrics, "miles_trainer_rank_peak_memory_bytes", run="r", rank=rank) == peak
        assert value(metrics, "miles_trainer_rank_state_bytes", run="r", rank=rank) == state
    assert value(metrics, "miles_trainer_ranks", run="r") == 2


def test_the_trainer_rank_count_is_announced_at_run_start(observed: RunMetrics, run_id) -> None:
    assert value(observed, "miles_trainer_ranks", run=run_id) == 1  # a log from before ranks
    metrics = RunMetrics()
    started = RunStarted(
        runtime="local", config_digest="", start_rollout_id=0, num_rollout=2, num_rollout_per_epoch=None,
        trainer_ranks=4, trainer_sharding="fsdp2", run_id="r",
    )  # fmt: skip
    metrics.observe(started)
    assert value(metrics, "miles_trainer_ranks", run="r") == 4


def test_a_step_without_rank_reports_leaves_the_last_ranks_values() -> None:
    metrics = RunMetrics()
    metrics.observe(two_rank_step())
    metrics.observe(TrainStepFinished(rollout_id=1, weight_version="1", run_id="r"))
    assert value(metrics, "miles_trainer_rank_step_seconds", run="r", rank="1") == 1.5
    assert value(metrics, "miles_trainer_ranks", run="r") == 2


def test_actor_failures_are_counted_per_actor() -> None:
    metrics = RunMetrics()
    metrics.observe(ActorFailed(actor="trainer", error="RuntimeError: boom", run_id="r"))
    metrics.observe(ActorFailed(actor="trainer", error="RuntimeError: boom", run_id="r"))
    assert value(metrics, "miles_actor_failures_total", run="r", actor="trainer") == 2


def test_a_failed_run_shows_failed_status() -> None:
    metrics = RunMetrics()
    metrics.observe(RunFinished(status="failed", reason="x", run_id="r"))
    assert series(metrics, "miles_run_info") == [{"run": "r", "runtime": "", "status": "failed"}]


def test_metrics_of_separate_instances_do_not_share_a_registry(observed: RunMetrics) -> None:
    assert RunMetrics().registry.get_sample_value("miles_publications_total", {}) is None
    assert RunMetrics().registry is not observed.registry


# --- the reference table ------------------------------------------------------------------


def test_registered_metrics_are_exactly_the_documented_ones(events: list[Event]) -> None:
    metrics = RunMetrics()
    metrics.attach_bus(EventBus("r"))
    for event in events:
        metrics.observe(event)
    registered = {exposed_name(family) for family in metrics.registry.collect()}
    assert registered == {spec.name for spec in METRICS}


def test_every_documented_metric_gets_a_series_in_a_full_run(events: list[Event]) -> None:
    bus = EventBus("r")
    bus.subscribe("metrics", (Event,))
    metrics = RunMetrics()
    metrics.attach_bus(bus)
    for event in events:
        metrics.observe(event)
    with_samples = {exposed_name(f) for f in metrics.registry.collect() if f.samples}
    assert (
        with_samples
        == {spec.name for spec in METRICS}
        - FAILURE_ONLY
        - PER_RANK
        - PPO_ONLY
        - OFFLOAD_ONLY
        - FAULT_ONLY
        - BY_STALENESS
    )


def test_documented_labels_are_the_exposed_labels(events: list[Event]) -> None:
    bus = EventBus("r")
    bus.subscribe("metrics", (Event,))
    metrics = RunMetrics()
    metrics.attach_bus(bus)
    metrics.observe(ActorFailed(actor="trainer", error="e", run_id="r"))
    metrics.observe(two_rank_step())
    metrics.observe(critic_step())
    metrics.observe(MemoryOffloaded(run_id="r", target="rollout"))
    metrics.observe(FaultInjected(run_id="r", cell="rollout-0", mode="sigkill", pid=1))
    for event in events:
        metrics.observe(event)
    exposed = {
        s.name: set(s.labels) - {"le"}
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == exposed_name(family) or s.name.endswith("_count")
    }
    for spec in METRICS:
        name = spec.name + ("_count" if spec.kind == "histogram" else "")
        assert exposed[name] == set(spec.all_labels), spec.name


# --- the live exporter --------------------------------------------------------------------


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample served at ``url``, grouped by sample name."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


async def serve(bus: EventBus, exporter: MetricsExporter | None = None) -> tuple[MetricsExporter, SinkHost]:
    """``exporter`` started and subscribed as a session does."""
    exporter = exporter or MetricsExporter("127.0.0.1", 0)

    async def fail(reason: str) -> None:
        raise AssertionError(reason)

    await exporter.start(SinkContext(bus.run_id, Path("."), Config(), bus, fail))
    return exporter, SinkHost(exporter, bus, 512)


async def test_live_exporter_serves_the_run_and_mailbox_depths(events: list[Event]) -> None:
    bus = EventBus("live-run")
    idle = bus.subscribe("idle-actor", (Event,))
    exporter, host = await serve(bus)
    try:
        assert exporter.port > 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        for event in events:
            await bus.publish(msgspec.structs.replace(event, run_id="", seq=0))
        while host.mailbox.statistics().depth:
            await asyncio.sleep(0.01)
        found = await asyncio.to_thread(scrape, exporter.url)
        depths = {labels["actor"]: v for labels, v in found["miles_bus_mailbox_depth"]}
        assert depths == {"idle-actor": len(events), "metrics": 0}
        versions = {labels["engine"]: v for labels, v in found["miles_weight_version"]}
        assert versions == {"": 4, "engine-0": 4, "engine-1": 4}
        assert all(labels["run"] == "live-run" for samples in found.values() for labels, _ in samples)
    finally:
        bus.close()
        idle.close()
        await host.join()
        await exporter.close()


async def test_the_live_exporter_serves_a_two_rank_steps_gauges_with_rank_labels() -> None:
    bus = EventBus("ranked")
    exporter, host = await serve(bus)
    try:
        await bus.publish(msgspec.structs.replace(two_rank_step(), run_id=""))
        while host.mailbox.statistics().depth:
            await asyncio.sleep(0.01)
        found = await asyncio.to_thread(scrape, exporter.url)
        seconds = {labels["rank"]: v for labels, v in found["miles_trainer_rank_step_seconds"]}
        memory = {labels["rank"]: v for labels, v in found["miles_trainer_rank_peak_memory_bytes"]}
        state = {labels["rank"]: v for labels, v in found["miles_trainer_rank_state_bytes"]}
        assert seconds == {"0": 1.25, "1": 1.5}
        assert memory == {"0": 430 << 20, "1": 400 << 20}
        assert state == {"0": 96 << 20, "1": 94 << 20}
        assert found["miles_trainer_ranks"] == [({"run": "ranked"}, 2)]
    finally:
        bus.close()
        await host.join()
        await exporter.close()


async def test_exporter_drain_ends_when_the_bus_closes() -> None:
    bus = EventBus("r")
    exporter, host = await serve(bus)
    bus.close()
    await asyncio.wait_for(host.join(), 5)
    await exporter.close()


async def test_closed_exporter_frees_its_port() -> None:
    bus = EventBus("r")
    exporter, host = await serve(bus)
    bus.close()
    await host.join()
    await exporter.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(exporter.url, timeout=5)
    MetricsServer(RunMetrics().registry, "127.0.0.1", exporter.port).close()


def test_closing_the_server_takes_a_moment_not_a_poll_interval() -> None:
    server = MetricsServer(RunMetrics().registry, "127.0.0.1", 0)
    time.sleep(0.05)  # its loop is waiting for a request
    began = time.monotonic()
    server.close()
    assert time.monotonic() - began < 0.2


def test_a_busy_port_is_a_metrics_error_naming_host_port_and_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError) as raised:
            MetricsServer(RunMetrics().registry, "127.0.0.1", port)
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message and "metrics.port" in message and "\n" not in message
    assert isinstance(raised.value, ValueError)


async def test_a_busy_port_fails_the_exporter_start_before_it_subscribes() -> None:
    bus = EventBus("r")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(MetricsError):
            await serve(bus, MetricsExporter("127.0.0.1", taken.getsockname()[1]))
    assert bus.mailboxes() == []


def test_no_exporter_when_metrics_are_disabled() -> None:
    config = Config()
    config = msgspec.structs.replace(config, metrics=msgspec.structs.replace(config.metrics, enabled=False))
    assert metrics_exporter(config) is None


async def test_the_configured_exporter_serves_on_its_port() -> None:
    config = Config()
    config = msgspec.structs.replace(config, metrics=msgspec.structs.replace(config.metrics, port=0))
    bus = EventBus("r")
    exporter = metrics_exporter(config)
    assert exporter is not None
    exporter, host = await serve(bus, exporter)
    try:
        assert [m.name for m in bus.mailboxes()] == ["metrics"]
        assert "miles_bus_mailbox_depth" in await asyncio.to_thread(scrape, exporter.url)
    finally:
        bus.close()
        await host.join()
        await exporter.close()


# --- replay --serve-metrics ---------------------------------------------------------------


def start_replay(log: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_events.replay", str(log), "--serve-metrics", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Interruptible even when this test run was started with SIGINT ignored (a shell's
        # background job): the child would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


def test_replay_serves_the_metrics_of_the_log_until_interrupted(events: list[Event], run_id: str) -> None:
    proc, line = start_replay(FIXTURE_LOG)
    try:
        assert line.startswith(
            f"serving metrics of {len(events)} events from {FIXTURE_LOG} at http://127.0.0.1:"
        )
        found = scrape(line.split()[-1])
    finally:
        status, err = stop(proc)
    assert status == 0, err
    verified = sum(isinstance(e, PublicationVerified) for e in events)
    assert ({"run": run_id, "outcome": "verified"}, verified) in found["miles_publications_total"]
    assert ({"run": run_id, "role": "engine", "engine": "engine-1"}, 4) in found["miles_weight_version"]
    assert "miles_bus_mailbox_depth" not in found


def test_replay_of_a_torn_log_serves_the_complete_records(tmp_path: Path, events: list[Event]) -> None:
    torn = tmp_path / "events.log"
    torn.write_bytes(FIXTURE_LOG.read_bytes()[:-5])
    proc, line = start_replay(torn)
    try:
        assert line.startswith(f"serving metrics of {len(events) - 1} events from {torn} at ")
        found = scrape(line.split()[-1])
    finally:
        status, err = stop(proc)
    assert "miles_run_finished" in found
    assert status == 0
    assert f"replay: {torn}: torn record at byte" in err


def test_each_memory_move_sets_its_bytes_freed_memory_and_duration() -> None:
    from schemas.events import MemoryOnloaded, MemoryPart

    metrics = RunMetrics()
    part = MemoryPart(
        name="engine-0", device="cuda:0", bytes=300, device_free_before=1000, device_free_after=1400
    )
    metrics.observe(
        MemoryOffloaded(run_id="r", target="rollout", tags=["weights"], parts=[part, part], seconds=0.5)
    )
    metrics.observe(
        MemoryOnloaded(run_id="r", target="actor", parts=[MemoryPart(name="rank-0", device="cpu", bytes=7)])
    )
    labels = {"run": "r", "target": "rollout", "direction": "offload"}
    assert metrics.registry.get_sample_value("miles_memory_moved_bytes", labels) == 600
    assert metrics.registry.get_sample_value("miles_memory_device_freed_bytes", labels) == 800
    assert metrics.registry.get_sample_value("miles_memory_move_duration_seconds_sum", labels) == 0.5
    onload = {"run": "r", "target": "actor", "direction": "onload"}
    assert metrics.registry.get_sample_value("miles_memory_moved_bytes", onload) == 7
    assert metrics.registry.get_sample_value("miles_memory_device_freed_bytes", onload) == 0


def test_a_trainer_that_goes_back_to_a_checkpoint_counts_its_restores_and_the_rollouts_done_again() -> None:
    metrics = RunMetrics()
    metrics.observe(TrainerRestoreRequested(checkpoint="c", rollout_id=2, redo=[3, 4, 5], run_id="r"))
    metrics.observe(TrainerRestored(checkpoint="c", rollout_id=2, weight_version="6", run_id="r"))
    assert value(metrics, "miles_rollouts_redone_total", run="r") == 3
    assert value(metrics, "miles_trainer_restores_total", run="r") == 1


def test_trained_tokens_are_counted_by_staleness_and_stale_ones_apart() -> None:
    metrics = RunMetrics()
    metrics.attach_bus(EventBus("r"))
    metrics.observe(two_rank_step())
    metrics.observe(two_rank_step(rollout_id=1))
    assert value(metrics, "miles_trained_tokens_by_staleness_total", run="r", staleness="1") == 80
    assert value(metrics, "miles_trained_tokens_by_staleness_total", run="r", staleness="2") == 4
    assert value(metrics, "miles_trained_tokens_by_staleness_total", run="r", staleness="0") is None
    assert value(metrics, "miles_stale_samples_total", run="r") == 2
    assert value(metrics, "miles_stale_tokens_total", run="r") == 6
