"""Prometheus metrics of a run, rebuilt from its events.

``RunMetrics`` turns events into metrics in its own registry: pure and synchronous, so a
live run (``MetricsExporter``, a bus subscriber with an HTTP ``/metrics`` endpoint) and a
replay of an event log (``python -m miles_events.replay LOG --serve-metrics PORT``) give
the same numbers. Every metric carries a ``run`` label (the event's ``run_id``).

``METRICS`` is the one table of every metric; ``docs/metrics.md`` is generated from it
(``python -m miles_events.app.reference_docs``).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal
from wsgiref.simple_server import WSGIRequestHandler, make_server

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer

from miles_events.bus.event_bus import EventBus
from miles_events.bus.handlers import handles
from miles_events.rl.versions import version_number
from miles_events.sinks.base import Sink, SinkContext
from schemas.config import Config
from schemas.events import (
    ActorFailed,
    CellFailed,
    CellHealth,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CheckpointFailed,
    CheckpointSaved,
    CriticStepFinished,
    EvalFinished,
    Event,
    FaultInjected,
    MemoryOffloaded,
    MemoryOnloaded,
    PublicationFailed,
    PublicationMismatch,
    PublicationVerified,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainStepFinished,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)

logger = logging.getLogger(__name__)


DURATION_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Seconds, 1 ms .. 10 min: a tiny CPU run's publication to a large run's checkpoint."""

Kind = Literal["counter", "gauge", "histogram", "info"]


@dataclass(frozen=True)
class MetricSpec:
    """One exposed metric: its full name, type, labels (after ``run``), meaning and source."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    meaning: str
    source: str
    info_labels: tuple[str, ...] = ()
    """For an info metric: the labels that carry its value (replaced, never accumulated)."""
    live_only: bool = False
    """Read from the live bus at scrape time; absent when metrics are rebuilt from a log."""

    @property
    def all_labels(self) -> tuple[str, ...]:
        return ("run", *self.labels, *self.info_labels)


def _m(name: str, kind: Kind, labels: str, meaning: str, source: str, **extra: Any) -> MetricSpec:
    return MetricSpec(name, kind, tuple(labels.split()), meaning, source, **extra)


METRICS: tuple[MetricSpec, ...] = (
    _m("miles_run_info", "info", "", "Always 1; `runtime` (local, ray) and `status` (running, completed, failed, stopped).", "RunStarted, RunFinished", info_labels=("runtime", "status")),
    _m("miles_run_finished", "gauge", "", "0 while the run runs, 1 once it finished.", "RunStarted, RunFinished"),
    _m("miles_rollout_num", "gauge", "", "`run.num_rollout`: the run ends before this rollout id.", "RunStarted"),
    _m("miles_rollout_id", "gauge", "", "The id of the last rollout generated (0-based, as in the event log and checkpoint names).", "RolloutGenerated"),
    _m("miles_rollout_reward_mean", "gauge", "", "Mean reward of the last rollout.", "RolloutGenerated"),
    _m("miles_rollout_duration_seconds", "histogram", "", "Time to generate a rollout.", "RolloutGenerated.generate_seconds"),
    _m("miles_tokens_generated_total", "counter", "", "Response tokens generated for training rollouts.", "RolloutGenerated.response_tokens"),
    _m("miles_rollout_staleness", "gauge", "", "Trainer version minus the oldest version a sample of the last trained batch was generated with.", "TrainStepFinished.staleness_max"),
    _m("miles_trained_tokens_by_staleness_total", "counter", "staleness", "Response tokens trained on, by how many publications behind the trainer's version they were sampled (`staleness`: 0 in the synchronous loop, up to `run.max_staleness` asynchronously).", "TrainStepFinished.token_staleness"),
    _m("miles_stale_samples_total", "counter", "", "Samples left out of training for a token older than `run.max_staleness` publications (`run.staleness_policy` drop).", "TrainStepFinished.stale_samples"),
    _m("miles_stale_tokens_total", "counter", "", "Response tokens older than `run.max_staleness` publications: of the samples left out, or masked (`mask`).", "TrainStepFinished.stale_tokens"),
    _m("miles_train_loss", "gauge", "", "Loss of the last train step.", "TrainStepFinished.metrics"),
    _m("miles_train_kl", "gauge", "", "KL to the reference of the last train step.", "TrainStepFinished"),
    _m("miles_train_grad_norm", "gauge", "", "Gradient norm of the last train step.", "TrainStepFinished"),
    _m("miles_train_lr", "gauge", "", "Learning rate of the last optimizer step.", "TrainStepFinished"),
    _m("miles_train_entropy", "gauge", "", "Policy entropy of the last train step.", "TrainStepFinished"),
    _m("miles_train_clipfrac", "gauge", "", "Fraction of clipped ratios in the last train step.", "TrainStepFinished"),
    _m("miles_train_tokens_total", "counter", "", "Tokens trained on.", "TrainStepFinished.metrics.train_tokens"),
    _m("miles_train_duration_seconds", "histogram", "", "Time of a train step.", "TrainStepFinished.train_seconds"),
    _m("miles_trainer_ranks", "gauge", "", "The trainer's ranks (`trainer.num_ranks`; 1 in a log written before ranks), then how many the last train step reported.", "RunStarted.trainer_ranks, TrainStepFinished.ranks"),
    _m("miles_trainer_rank_step_seconds", "gauge", "rank", "Wall time of each trainer rank's part of the last train step.", "TrainStepFinished.ranks[].step_seconds"),
    _m("miles_trainer_rank_peak_memory_bytes", "gauge", "rank", "Each trainer rank's peak memory so far: CUDA's max allocated bytes on a GPU, the process's peak RSS on CPU.", "TrainStepFinished.ranks[].peak_memory_bytes"),
    _m("miles_trainer_rank_state_bytes", "gauge", "rank", "Parameters, gradients and optimizer state each trainer rank holds (its shard under FSDP2).", "TrainStepFinished.ranks[].state_bytes"),
    _m("miles_critic_value_loss", "gauge", "", "PPO: the critic's clipped value loss on the last rollout.", "CriticStepFinished.metrics.value_loss"),
    _m("miles_critic_value_clipfrac", "gauge", "", "PPO: share of tokens whose value error was clipped in the critic's last step.", "CriticStepFinished.metrics.value_clipfrac"),
    _m("miles_critic_value_mean", "gauge", "", "PPO: the critic's mean value of the last rollout's tokens.", "CriticStepFinished.metrics.value_mean"),
    _m("miles_critic_return_mean", "gauge", "", "PPO: the mean GAE return the critic trained towards on the last rollout.", "CriticStepFinished.metrics.return_mean"),
    _m("miles_critic_duration_seconds", "histogram", "", "PPO: time of a critic step (valuing a rollout and training on it).", "CriticStepFinished.train_seconds"),
    _m("miles_memory_moved_bytes", "gauge", "target direction", "Offload and onload: tensor bytes the last move of `target` (`rollout`, `actor`, `critic`) moved in `direction` (`offload`, `onload`), all engines or ranks together.", "MemoryOffloaded, MemoryOnloaded"),
    _m("miles_memory_device_freed_bytes", "gauge", "target direction", "On a GPU, the device memory the last move really freed (offload) or took (onload, negative), from `torch.cuda.mem_get_info`; 0 off CUDA.", "MemoryOffloaded, MemoryOnloaded (parts)"),
    _m("miles_memory_move_duration_seconds", "histogram", "target direction", "Time of an offload or onload.", "MemoryOffloaded.seconds, MemoryOnloaded.seconds"),
    _m("miles_cell_healthy", "gauge", "cell", "1 while the engine (`rollout-{i}`) or trainer rank (`actor-{i}`) of `cell` runs and answers its health checks, 0 while it fails them, is being restarted or is suspended (every engine's and rank's series from RunStarted on; `saver` once the Saver's process died).", "RunStarted, CellHealth, CellFailed, CellRestarted, CellSuspended, CellResumed"),
    _m("miles_cell_failures_total", "counter", "cell kind", "Engines, trainer ranks and the Saver's process found dead (`kind=died`) or hung (`hung`) (both series of every engine and rank from RunStarted on).", "CellFailed"),
    _m("miles_cell_restarts_total", "counter", "cell", "Cells started again after a failure, or a suspension (`run.ft_components`; the Saver of its own process).", "CellRestarted, CellResumed"),
    _m("miles_cell_restart_duration_seconds", "histogram", "", "Time from a failure seen to the cell running again (an engine: its weights loaded again; the trainer's group: its ranks started).", "CellRestarted.restart_seconds"),
    _m("miles_trainer_restores_total", "counter", "", "Times the trainer's group, restarted or resumed, was given the latest checkpoint back.", "TrainerRestored"),
    _m("miles_rollouts_redone_total", "counter", "", "Rollouts generated and trained again after the trainer went back to a checkpoint.", "TrainerRestoreRequested.redo"),
    _m("miles_fault_injections_total", "counter", "cell mode", "Faults delivered through the control server's inject-fault.", "FaultInjected"),
    _m("miles_eval_score", "gauge", "metric", "The last evaluation, one series per metric it reports.", "EvalFinished.metrics"),
    _m("miles_eval_duration_seconds", "histogram", "", "Time of an evaluation.", "EvalFinished.eval_seconds"),
    _m("miles_weight_version", "gauge", "role engine", 'Weight version as a number (`"default"` = 0). `role="trainer"` (with `engine=""`): staged by the trainer; `role="engine"`: served by that engine. Trainer = the run\'s start version and engines = 0 at RunStarted.', "RunStarted, WeightsStaged, WeightsLoaded"),
    _m("miles_weight_checksum_info", "info", "role engine", "Always 1; the digest of the weights the trainer staged / the engine serves. One series per role and engine: the previous version's series is replaced.", "WeightsStaged.digest, WeightsLoaded.digest", info_labels=("weight_version", "digest")),
    _m("miles_publications_total", "counter", "outcome", "Publications by verification outcome: `verified`, `mismatch`, `failed` (all three exist from RunStarted on).", "PublicationVerified, PublicationMismatch, PublicationFailed"),
    _m("miles_publication_duration_seconds", "histogram", "phase", "Publication time by `phase`: `stage` (trainer), `load` (engines), `total`.", "WeightsPublished.stage_seconds, .load_seconds, .publish_seconds"),
    _m("miles_verification_duration_seconds", "histogram", "", "Time to compare trainer and engine checksums.", "PublicationVerified/PublicationMismatch.verify_seconds"),
    _m("miles_publication_mismatched_tensors", "gauge", "", "Tensors that differed in the last mismatching publication (0 until one).", "RunStarted, PublicationMismatch"),
    _m("miles_checkpoints_total", "counter", "outcome", "Checkpoints by outcome: `saved`, `failed`.", "CheckpointSaved, CheckpointFailed"),
    _m("miles_checkpoint_duration_seconds", "histogram", "", "Time to save a checkpoint.", "CheckpointSaved.save_seconds"),
    _m("miles_checkpoint_last_rollout_id", "gauge", "", "Rollout of the last saved checkpoint.", "CheckpointSaved"),
    _m("miles_checkpoint_bytes", "gauge", "", "Size of the last saved checkpoint.", "CheckpointSaved.num_bytes"),
    _m("miles_actor_failures_total", "counter", "actor", "Actor failures (a handler raised or a process died).", "ActorFailed"),
    _m("miles_bus_events_total", "counter", "type", "Events on the bus, by event class name.", "every event"),
    _m("miles_bus_mailbox_depth", "gauge", "actor", "Events waiting in each bus mailbox, read at scrape time (the actor is the subscriber's name).", "the live bus", live_only=True),
    _m("miles_bus_mailbox_high_water_mark", "gauge", "actor", "Most events a mailbox ever held; near its capacity means backpressure.", "the live bus", live_only=True),
)  # fmt: skip
SPECS_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def _version(weight_version: str) -> float:
    try:
        return float(version_number(weight_version))
    except ValueError:
        return math.nan


class _Family:
    """A labelled metric with its children cached: one dict lookup per update."""

    __slots__ = ("children", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class BusCollector:
    """Mailbox depths and high-water marks of a live bus, read when Prometheus scrapes."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        depth, high = (
            SPECS_BY_NAME["miles_bus_mailbox_depth"],
            SPECS_BY_NAME["miles_bus_mailbox_high_water_mark"],
        )
        return (
            GaugeMetricFamily(depth.name, depth.meaning, labels=depth.all_labels),
            GaugeMetricFamily(high.name, high.meaning, labels=high.all_labels),
        )

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        depth, high = self._families()
        run = self.bus.run_id
        for stats in self.bus.statistics():
            depth.add_metric([run, stats.name], stats.depth)
            high.add_metric([run, stats.name], stats.high_water_mark)
        yield depth
        yield high


class RunMetrics(Sink):
    """Every metric of ``METRICS`` in an own registry, updated by ``observe(event)``."""

    name = "metrics"

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.runtime_by_run: dict[str, str] = {}
        families: dict[str, _Family] = {}
        for spec in METRICS:
            if not spec.live_only:
                families[spec.name] = _Family(self._create(spec))
        self.families = families
        f = families.__getitem__
        self.run_info, self.run_finished, self.rollout_num = (
            f("miles_run_info"),
            f("miles_run_finished"),
            f("miles_rollout_num"),
        )
        self.rollout_id, self.reward_mean = f("miles_rollout_id"), f("miles_rollout_reward_mean")
        self.rollout_seconds, self.tokens_generated = (
            f("miles_rollout_duration_seconds"),
            f("miles_tokens_generated_total"),
        )
        self.staleness, self.loss, self.kl = (
            f("miles_rollout_staleness"),
            f("miles_train_loss"),
            f("miles_train_kl"),
        )
        self.grad_norm, self.entropy, self.clipfrac = (
            f("miles_train_grad_norm"),
            f("miles_train_entropy"),
            f("miles_train_clipfrac"),
        )
        self.lr = f("miles_train_lr")
        self.tokens_by_staleness, self.stale_samples, self.stale_tokens = (
            f("miles_trained_tokens_by_staleness_total"),
            f("miles_stale_samples_total"),
            f("miles_stale_tokens_total"),
        )
        self.train_tokens, self.train_seconds = (
            f("miles_train_tokens_total"),
            f("miles_train_duration_seconds"),
        )
        self.trainer_ranks, self.rank_seconds = f("miles_trainer_ranks"), f("miles_trainer_rank_step_seconds")
        self.rank_peak_memory, self.rank_state = (
            f("miles_trainer_rank_peak_memory_bytes"),
            f("miles_trainer_rank_state_bytes"),
        )
        self.eval_score, self.eval_seconds = f("miles_eval_score"), f("miles_eval_duration_seconds")
        self.weight_version, self.checksum = f("miles_weight_version"), f("miles_weight_checksum_info")
        self.publications, self.publication_seconds = (
            f("miles_publications_total"),
            f("miles_publication_duration_seconds"),
        )
        self.verify_seconds, self.mismatched = (
            f("miles_verification_duration_seconds"),
            f("miles_publication_mismatched_tensors"),
        )
        self.checkpoints, self.checkpoint_seconds = (
            f("miles_checkpoints_total"),
            f("miles_checkpoint_duration_seconds"),
        )
        self.checkpoint_rollout, self.checkpoint_bytes = (
            f("miles_checkpoint_last_rollout_id"),
            f("miles_checkpoint_bytes"),
        )
        self.actor_failures, self.events = f("miles_actor_failures_total"), f("miles_bus_events_total")

    def _create(self, spec: MetricSpec) -> Any:
        labels = ("run", *spec.labels)
        if spec.kind == "counter":
            return Counter(spec.name, spec.meaning, labels, registry=self.registry)
        if spec.kind == "gauge":
            return Gauge(spec.name, spec.meaning, labels, registry=self.registry)
        if spec.kind == "histogram":
            return Histogram(
                spec.name, spec.meaning, labels, buckets=DURATION_BUCKETS, registry=self.registry
            )
        return Info(spec.name.removesuffix("_info"), spec.meaning, labels, registry=self.registry)

    def attach_bus(self, bus: EventBus) -> None:
        """Also expose the live mailbox depths of ``bus`` (read at each scrape)."""
        self.registry.register(BusCollector(bus))

    @handles(Event)
    def _any_event(self, e: Event) -> None:
        pass

    def observe(self, event: Event) -> None:
        """Update the metrics with one event (events of unknown types are only counted)."""
        self.events(event.run_id, type(event).__name__).inc()
        super().observe(event)

    # Durations default to 0.0 in events that did not measure them: those are not observed.

    @handles(RunStarted)
    def _run_started(self, e: RunStarted) -> None:
        run = e.run_id
        self.runtime_by_run[run] = e.runtime
        self.run_info(run).info({"runtime": e.runtime, "status": "running"})
        self.run_finished(run).set(0)
        self.rollout_num(run).set(e.num_rollout)
        self.weight_version(run, "trainer", "").set(_version(e.weight_version))
        for engine in e.engines:
            self.weight_version(run, "engine", engine).set(0)
        for outcome in ("verified", "mismatch", "failed"):
            self.publications(run, outcome)
        for outcome in ("saved", "failed"):
            self.checkpoints(run, outcome)
        self.mismatched(run).set(0)
        self.trainer_ranks(run).set(e.trainer_ranks)
        self.tokens_generated(run)
        self.train_tokens(run)
        f = self.families.__getitem__
        cells = [f"rollout-{index}" for index in range(len(e.engines))]
        for cell in [*cells, *(f"actor-{rank}" for rank in range(e.trainer_ranks))]:
            f("miles_cell_healthy")(run, cell).set(1)
            f("miles_cell_restarts_total")(run, cell)
            for kind in ("died", "hung"):
                f("miles_cell_failures_total")(run, cell, kind)
        f("miles_cell_restart_duration_seconds")(run)
        f("miles_trainer_restores_total")(run)
        f("miles_rollouts_redone_total")(run)

    @handles(CellHealth)
    def _cell_health(self, e: CellHealth) -> None:
        self.families["miles_cell_healthy"](e.run_id, e.cell).set(1 if e.healthy else 0)

    @handles(CellFailed)
    def _cell_failed(self, e: CellFailed) -> None:
        f = self.families.__getitem__
        f("miles_cell_healthy")(e.run_id, e.cell).set(0)
        f("miles_cell_failures_total")(e.run_id, e.cell, "hung" if e.hung else "died").inc()

    @handles(CellSuspended)
    def _cell_suspended(self, e: CellSuspended) -> None:
        self.families["miles_cell_healthy"](e.run_id, e.cell).set(0)

    @handles(CellRestarted, CellResumed)
    def _cell_back(self, e: CellRestarted | CellResumed) -> None:
        f = self.families.__getitem__
        f("miles_cell_healthy")(e.run_id, e.cell).set(1)
        f("miles_cell_restarts_total")(e.run_id, e.cell).inc()
        if isinstance(e, CellRestarted):
            f("miles_cell_restart_duration_seconds")(e.run_id).observe(e.restart_seconds)

    @handles(TrainerRestoreRequested)
    def _trainer_restore_requested(self, e: TrainerRestoreRequested) -> None:
        self.families["miles_rollouts_redone_total"](e.run_id).inc(len(e.redo))

    @handles(TrainerRestored)
    def _trainer_restored(self, e: TrainerRestored) -> None:
        self.families["miles_trainer_restores_total"](e.run_id).inc()

    @handles(FaultInjected)
    def _fault_injected(self, e: FaultInjected) -> None:
        if not e.error:
            self.families["miles_fault_injections_total"](e.run_id, e.cell, e.mode).inc()

    @handles(RunFinished)
    def _run_finished(self, e: RunFinished) -> None:
        self.run_info(e.run_id).info({"runtime": self.runtime_by_run.get(e.run_id, ""), "status": e.status})
        self.run_finished(e.run_id).set(1)

    @handles(RolloutGenerated)
    def _rollout_generated(self, e: RolloutGenerated) -> None:
        run = e.run_id
        self.rollout_id(run).set(e.rollout_id)
        self.reward_mean(run).set(e.reward_mean)
        self.tokens_generated(run).inc(e.response_tokens)
        if e.generate_seconds > 0:
            self.rollout_seconds(run).observe(e.generate_seconds)

    @handles(TrainStepFinished)
    def _train_step_finished(self, e: TrainStepFinished) -> None:
        run, m = e.run_id, e.metrics
        self.loss(run).set(m.loss)
        self.kl(run).set(m.kl)
        self.grad_norm(run).set(m.grad_norm)
        self.lr(run).set(m.lr)
        self.entropy(run).set(m.entropy)
        self.clipfrac(run).set(m.clipfrac)
        self.staleness(run).set(e.staleness_max)
        for staleness, tokens in enumerate(e.token_staleness):
            if tokens:
                self.tokens_by_staleness(run, str(staleness)).inc(tokens)
        self.stale_samples(run).inc(e.stale_samples)
        self.stale_tokens(run).inc(e.stale_tokens)
        self.train_tokens(run).inc(m.train_tokens)
        if e.train_seconds > 0:
            self.train_seconds(run).observe(e.train_seconds)
        # A trainer that does not report its ranks leaves their last values as they are.
        if e.ranks:
            self.trainer_ranks(run).set(len(e.ranks))
        for r in e.ranks:
            rank = str(r.rank)
            self.rank_seconds(run, rank).set(r.step_seconds)
            self.rank_peak_memory(run, rank).set(r.peak_memory_bytes)
            self.rank_state(run, rank).set(r.state_bytes)

    @handles(CriticStepFinished)
    def _critic_step_finished(self, e: CriticStepFinished) -> None:
        f, m = self.families.__getitem__, e.metrics
        f("miles_critic_value_loss")(e.run_id).set(m.value_loss)
        f("miles_critic_value_clipfrac")(e.run_id).set(m.value_clipfrac)
        f("miles_critic_value_mean")(e.run_id).set(m.value_mean)
        f("miles_critic_return_mean")(e.run_id).set(m.return_mean)
        if e.train_seconds > 0:
            f("miles_critic_duration_seconds")(e.run_id).observe(e.train_seconds)

    @handles(MemoryOffloaded, MemoryOnloaded)
    def _memory_moved(self, e: MemoryOffloaded | MemoryOnloaded) -> None:
        f = self.families.__getitem__
        direction = "offload" if isinstance(e, MemoryOffloaded) else "onload"
        f("miles_memory_moved_bytes")(e.run_id, e.target, direction).set(sum(p.bytes for p in e.parts))
        freed = sum(p.device_free_after - p.device_free_before for p in e.parts)
        f("miles_memory_device_freed_bytes")(e.run_id, e.target, direction).set(freed)
        f("miles_memory_move_duration_seconds")(e.run_id, e.target, direction).observe(e.seconds)

    @handles(EvalFinished)
    def _eval_finished(self, e: EvalFinished) -> None:
        for metric, value in e.metrics.items():
            self.eval_score(e.run_id, metric).set(value)
        if e.eval_seconds > 0:
            self.eval_seconds(e.run_id).observe(e.eval_seconds)

    @handles(WeightsStaged)
    def _weights_staged(self, e: WeightsStaged) -> None:
        self.weight_version(e.run_id, "trainer", "").set(_version(e.weight_version))
        # Info keeps one value per (run, role, engine): the previous digest's series goes.
        self.checksum(e.run_id, "trainer", "").info({"weight_version": e.weight_version, "digest": e.digest})

    @handles(WeightsLoaded)
    def _weights_loaded(self, e: WeightsLoaded) -> None:
        self.weight_version(e.run_id, "engine", e.engine).set(_version(e.weight_version))
        self.checksum(e.run_id, "engine", e.engine).info(
            {"weight_version": e.weight_version, "digest": e.digest}
        )

    @handles(WeightsPublished)
    def _weights_published(self, e: WeightsPublished) -> None:
        for phase, seconds in (
            ("stage", e.stage_seconds),
            ("load", e.load_seconds),
            ("total", e.publish_seconds),
        ):
            if seconds > 0:
                self.publication_seconds(e.run_id, phase).observe(seconds)

    @handles(PublicationVerified)
    def _publication_verified(self, e: PublicationVerified) -> None:
        self.publications(e.run_id, "verified").inc()
        if e.verify_seconds > 0:
            self.verify_seconds(e.run_id).observe(e.verify_seconds)

    @handles(PublicationMismatch)
    def _publication_mismatch(self, e: PublicationMismatch) -> None:
        self.publications(e.run_id, "mismatch").inc()
        self.mismatched(e.run_id).set(len(e.mismatches))
        if e.verify_seconds > 0:
            self.verify_seconds(e.run_id).observe(e.verify_seconds)

    @handles(PublicationFailed)
    def _publication_failed(self, e: PublicationFailed) -> None:
        self.publications(e.run_id, "failed").inc()

    @handles(CheckpointFailed)
    def _checkpoint_failed(self, e: CheckpointFailed) -> None:
        self.checkpoints(e.run_id, "failed").inc()

    @handles(ActorFailed)
    def _actor_failed(self, e: ActorFailed) -> None:
        self.actor_failures(e.run_id, e.actor).inc()

    @handles(CheckpointSaved)
    def _checkpoint_saved(self, e: CheckpointSaved) -> None:
        run = e.run_id
        self.checkpoints(run, "saved").inc()
        self.checkpoint_rollout(run).set(e.rollout_id)
        self.checkpoint_bytes(run).set(e.num_bytes)
        if e.save_seconds > 0:
            self.checkpoint_seconds(run).observe(e.save_seconds)


class MetricsError(ValueError):
    """The metrics endpoint cannot be served (the port is taken, the host is wrong)."""


CONFIG_HINT = "set metrics.port to a free port (0 picks one) or metrics.enabled = false"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per request."""


POLL_SECONDS = 0.05
"""How often the server's loop looks whether it is to stop: ``close`` waits up to this long."""


def _serve(registry: CollectorRegistry, host: str, port: int) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """As ``prometheus_client.start_http_server`` (IPv4 or IPv6 as ``host`` is, a thread per
    request, no request lines), with a loop that stops within ``POLL_SECONDS``, not 0.5 s."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class MetricsHTTPServer(ThreadingWSGIServer):
        address_family = family

    server = make_server(
        str(address[0]), port, make_wsgi_app(registry), MetricsHTTPServer, handler_class=_Quiet
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_SECONDS}, name="metrics-http", daemon=True
    )
    thread.start()
    return server, thread


class MetricsServer:
    """``/metrics`` of one registry over HTTP, in a daemon thread, until ``close()``."""

    def __init__(
        self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, hint: str = CONFIG_HINT
    ) -> None:
        try:
            self._server, self._thread = _serve(registry, host, port)
        except (OSError, OverflowError) as error:
            # OverflowError: a port outside 0..65535, from socket.bind.
            reason = getattr(error, "strerror", None) or str(error)
            raise MetricsError(f"metrics: cannot serve on {host}:{port}: {reason}; {hint}") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (blocks up to ``POLL_SECONDS``)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class MetricsExporter(RunMetrics):
    """``RunMetrics`` of the live run, with the bus's mailbox depths, served at ``url``
    from ``start`` until ``close``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        self.host = host
        self.requested_port = port
        self.server: MetricsServer | None = None

    def prepare(self, config: Config) -> None:
        """Take the port now: a busy one is refused before the run writes anything."""
        if self.server is None:
            self.server = MetricsServer(self.registry, self.host, self.requested_port)

    def release(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    async def start(self, context: SinkContext) -> None:
        self.attach_bus(context.bus)
        self.prepare(context.config)
        logger.info("metrics at %s", self.url)

    @property
    def port(self) -> int:
        assert self.server is not None, "the exporter serves once started"
        return self.server.port

    @property
    def url(self) -> str:
        assert self.server is not None, "the exporter serves once started"
        return self.server.url

    async def close(self) -> None:
        """Stop serving (off the event loop: shutting the server down waits for its thread)."""
        if self.server is not None:
            await anyio.to_thread.run_sync(self.server.close)


def metrics_exporter(config: Config) -> MetricsExporter | None:
    """The exporter ``config.metrics`` asks for, or None when disabled."""
    if not config.metrics.enabled:
        return None
    return MetricsExporter(config.metrics.host, config.metrics.port)


def metrics_reference() -> str:
    """The text of ``docs/metrics.md``, generated from ``METRICS``."""
    buckets = ", ".join(f"{b:g}" for b in DURATION_BUCKETS)
    lines = [
        "# Metrics reference",
        "",
        "Generated from `miles_events/sinks/metrics.py` by `python -m miles_events.app.reference_docs`; do not edit.",
        "",
        "The exporter subscribes to the bus and serves Prometheus metrics at",
        "`http://<metrics.host>:<metrics.port>/metrics` while a run runs (`[metrics]` in the config;",
        "`port = 0` picks a free port). `python -m miles_events.replay LOG --serve-metrics PORT`",
        "rebuilds the same metrics from an event log, for every run in it.",
        "",
        "- Every metric carries `run`, the run id, so a dashboard can select one run.",
        '- Weight versions are numbers: `"default"` (the bootstrap weights) is 0, then 1, 2, ...',
        '  The trainer\'s series have `role="trainer"` and `engine=""` (no engine label in PromQL).',
        "- Info metrics are always 1; their value is in their labels. Only the current value of",
        "  each series exists: a new digest replaces the old one instead of adding a series.",
        f"- Histograms are in seconds with buckets {buckets}.",
        "  A duration an event did not measure (0) is not observed.",
        "- Counters also expose `<name>_created` (prometheus_client's creation timestamp).",
        "- Metrics read from the live bus are absent when rebuilt from a log.",
        "",
        "| metric | type | labels | meaning | source |",
        "|---|---|---|---|---|",
    ]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.all_labels)
        kind = f"{spec.kind} (live only)" if spec.live_only else spec.kind
        lines.append(f"| `{spec.name}` | {kind} | {labels} | {spec.meaning} | {spec.source} |")
    return "\n".join(lines) + "\n"
