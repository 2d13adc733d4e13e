"""What a run's event log says about its progress, as series over the rollout id.

``run_series`` reads a log's events once and returns, for each run in it (a resumed run
appends to the same log under its own run id), the values ``replay --plot`` draws: the mean
reward of each rollout, each evaluation's metrics, the trainer's KL (and learning rate, when
its metrics carry one), the mean response length, and where each rollout's time went. It
draws nothing: the figure is ``miles_events.app.plot``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.events import (
    CriticStepFinished,
    EvalFinished,
    Event,
    RolloutGenerated,
    RolloutRequested,
    TrainStepFinished,
    WeightsPublished,
)

Point = tuple[int, float]
"""(rollout id, value)."""

EVAL_SCORES = ("eval/accuracy", "eval/reward_mean")
"""The evaluation metrics drawn as scores, when an evaluation reports them."""


@dataclass(frozen=True)
class StepTime:
    """Where one rollout's time went, in seconds."""

    rollout_id: int
    generate: float
    """``RolloutGenerated.generate_seconds``."""
    train: float
    """``TrainStepFinished.train_seconds`` (0 before the rollout was trained on)."""
    publish: float
    """``WeightsPublished.publish_seconds`` of the publication the rollout triggered (0 when
    none)."""
    wall: float
    """From the rollout's ``RolloutRequested`` to the next rollout's, or to the run's last
    event for its last rollout: the phases above plus evaluation, saving, verification and
    waiting."""


@dataclass
class RunSeries:
    """One run's series, each in the order of the log (rollout ids ascend in a run)."""

    run_id: str
    reward_mean: list[Point] = field(default_factory=list)
    """Mean reward of each rollout's samples."""
    eval_scores: dict[str, list[Point]] = field(default_factory=dict)
    """``EVAL_SCORES`` metric -> its value at each evaluation that reported it."""
    kl: list[Point] = field(default_factory=list)
    """The trainer's KL to the reference model at each train step."""
    lr: list[Point] = field(default_factory=list)
    """The learning rate of each train step, when the trainer's metrics report one."""
    value_loss: list[Point] = field(default_factory=list)
    """PPO: the critic's clipped value loss on each rollout (``CriticStepFinished``)."""
    response_length: list[Point] = field(default_factory=list)
    """Mean response tokens of each rollout's samples."""
    eval_response_length: list[Point] = field(default_factory=list)
    """Mean response tokens of each evaluation's samples."""
    step_times: list[StepTime] = field(default_factory=list)
    train_steps: int = 0
    """Train steps in the run (KL and LR have nothing to say without them)."""
    evaluations: int = 0
    """Evaluations in the run."""

    def kl_reported(self) -> bool:
        """Whether the trainer measured a KL: without a reference model (``trainer.use_kl_loss``
        off) it reports 0 at every step."""
        return any(value != 0.0 for _, value in self.kl)

    def lr_reported(self) -> bool:
        """Whether the trainer reported a learning rate (a log written before it did, or a
        trainer that does not, has none or only zeros)."""
        return any(value != 0.0 for _, value in self.lr)


def run_series(events: Iterable[Event]) -> list[RunSeries]:
    """The series of each run in ``events``, in the order the runs start in the log."""
    runs: dict[str, _RunReader] = {}
    for event in events:
        reader = runs.get(event.run_id)
        if reader is None:
            reader = runs[event.run_id] = _RunReader(event.run_id)
        reader.observe(event)
    return [reader.finish() for reader in runs.values()]


class _RunReader:
    """Gathers one run's series from its events, in log order."""

    def __init__(self, run_id: str) -> None:
        self.series = RunSeries(run_id)
        self.requested: dict[int, float] = {}
        """Rollout id -> the time of its ``RolloutRequested``, in request order."""
        self.generate: dict[int, float] = {}
        self.train: dict[int, float] = {}
        self.publish: dict[int, float] = {}
        self.last_time = 0.0

    def observe(self, event: Event) -> None:
        self.last_time = max(self.last_time, event.time)
        series = self.series
        if isinstance(event, RolloutRequested):
            self.requested[event.rollout_id] = event.time
        elif isinstance(event, RolloutGenerated):
            series.reward_mean.append((event.rollout_id, event.reward_mean))
            if event.num_samples:
                series.response_length.append((event.rollout_id, event.response_tokens / event.num_samples))
            self.generate[event.rollout_id] = event.generate_seconds
        elif isinstance(event, TrainStepFinished):
            series.train_steps += 1
            series.kl.append((event.rollout_id, event.metrics.kl))
            lr = getattr(event.metrics, "lr", None)
            if isinstance(lr, int | float):
                series.lr.append((event.rollout_id, float(lr)))
            self.train[event.rollout_id] = event.train_seconds
        elif isinstance(event, CriticStepFinished):
            series.value_loss.append((event.rollout_id, event.metrics.value_loss))
        elif isinstance(event, WeightsPublished) and event.rollout_id is not None:
            self.publish[event.rollout_id] = event.publish_seconds
        elif isinstance(event, EvalFinished):
            series.evaluations += 1
            for name in EVAL_SCORES:
                if name in event.metrics:
                    series.eval_scores.setdefault(name, []).append((event.rollout_id, event.metrics[name]))
            length = event.metrics.get("eval/response_length_mean")
            if length is not None:
                series.eval_response_length.append((event.rollout_id, length))

    def finish(self) -> RunSeries:
        """The series, with each generated rollout's step time (its wall time ends at the next
        rollout's request, or at the run's last event)."""
        starts = list(self.requested.items())
        ends = [start for _, start in starts[1:]] + [self.last_time]
        for (rollout_id, start), end in zip(starts, ends, strict=True):
            if rollout_id not in self.generate:
                continue  # requested, never generated: a run that stopped or failed there
            self.series.step_times.append(
                StepTime(
                    rollout_id=rollout_id,
                    generate=self.generate[rollout_id],
                    train=self.train.get(rollout_id, 0.0),
                    publish=self.publish.get(rollout_id, 0.0),
                    wall=max(end - start, 0.0),
                )
            )
        return self.series
