"""The run on the console, as a bus subscriber: a live ``rich`` display on a terminal,
one line per rollout otherwise, or only the final status line.

A rollout is named by its id, 0-based as in the seed, the event log and the checkpoint
names (``rollout_000004``), and this run's progress follows it in brackets:
``rollout 4 [5/50]`` is rollout id 4, the 5th of the 50 this run is to do (a run resumed at
rollout 10 of 50 shows ``rollout 10 [1/40]``). An eval says the weight version it ran on
(the eval before training and the one after rollout 0's training share rollout id 0).

``make_console(config)`` chooses the display by ``config.console.mode``. Every display is a
``Sink`` that folds the same events into a ``RunProgress``; like every sink it never
raises into the bus (see ``miles_events.sinks.base``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import deque
from datetime import timedelta
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from miles_events.bus.clock import SYSTEM_CLOCK, Clock
from miles_events.bus.handlers import HandlerTable, handles
from miles_events.sinks.base import Sink, SinkContext
from schemas.config import Config
from schemas.events import (
    ActorFailed,
    CellFailed,
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
    PublicationEvidenceFailed,
    PublicationEvidenceWritten,
    PublicationFailed,
    PublicationMismatch,
    PublicationVerified,
    RankStep,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainStepFinished,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)  # fmt: skip

logger = logging.getLogger(__name__)

SHOWN: tuple[type[Event], ...] = (
    RunStarted, RolloutGenerated, TrainStepFinished, WeightsStaged, WeightsLoaded, WeightsPublished,
    PublicationVerified, PublicationMismatch, PublicationFailed, EvalFinished, CheckpointSaved,
    CheckpointFailed, ActorFailed, RunFinished, PublicationEvidenceWritten, PublicationEvidenceFailed,
    CriticStepFinished, MemoryOffloaded, MemoryOnloaded,
)  # fmt: skip
STEP_PHASES = (
    ("generate", "gen"),
    ("train", "train"),
    ("publish", "pub"),
    ("verify", "verify"),
    ("save", "save"),
)
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the values' min and max."""
    if not values:
        return ""
    low, high = min(values), max(values)
    if high == low:
        return SPARK[len(SPARK) // 2] * len(values)
    return "".join(SPARK[round((v - low) / (high - low) * (len(SPARK) - 1))] for v in values)


def metric_name(key: str) -> str:
    """``eval/accuracy`` -> ``accuracy``: the section is already on the line."""
    return key.removeprefix("eval/")


def describe_eval(event: EvalFinished) -> str:
    """``rollout 4 (weights v5)``: two evals of one rollout id ran on different weights."""
    versions = ", ".join(f"v{version}" for version in event.weight_versions)
    return f"rollout {event.rollout_id} (weights {versions})" if versions else f"rollout {event.rollout_id}"


def describe_bytes(count: int) -> str:
    """``410 MiB`` below a GiB, ``37.5 GiB`` from one."""
    if count < 1 << 30:
        return f"{count / (1 << 20):.0f} MiB"
    return f"{count / (1 << 30):.1f} GiB"


def describe_ranks(ranks: list[RankStep], separator: str = ", ") -> str:
    """``0: 1.21s 410 MiB, 1: 1.19s 402 MiB``: each rank's step time and peak memory."""
    return separator.join(
        f"{r.rank}: {r.step_seconds:.2f}s {describe_bytes(r.peak_memory_bytes)}" for r in ranks
    )


def describe_mismatch(event: PublicationMismatch) -> str:
    """``MISMATCH in 2 tensor(s), first engine-0:model.norm.weight``: the first is where to look."""
    first = event.mismatches[0] if event.mismatches else None
    where = f", first {first.engine}:{first.tensor}" if first else ""
    return f"MISMATCH in {len(event.mismatches)} tensor(s){where}"


class RunProgress(HandlerTable):
    """Where the run stands, folded from its events (event times only, so a replay shows
    the same numbers as the live run)."""

    def __init__(self, recent: int = 10) -> None:
        self.run_id = ""
        self.runtime = ""
        self.start_rollout_id = 0
        self.num_rollout = 0
        self.started_at: float | None = None
        self.last_time: float | None = None
        self.last_trained: int | None = None
        """The last rollout done: trained, or (rollout-only) generated."""
        self.rollout_only = False
        self.trainer_ranks = 1
        self.trainer_sharding = "none"
        self.rewards: deque[float] = deque(maxlen=recent)
        self.train: TrainStepFinished | None = None
        self.step_seconds: dict[str, float] = {}
        self.trainer_version = "default"
        self.engine_versions: dict[str, str] = {}
        self.verification = ""
        self.verification_ok: bool | None = None
        self.checkpoint: CheckpointSaved | None = None
        self.checkpoint_problem = ""
        self.eval: EvalFinished | None = None
        self.failures: list[str] = []
        self.finished: RunFinished | None = None

    @property
    def total(self) -> int:
        """Rollouts this run is to do (a resumed run starts past 0)."""
        return max(self.num_rollout - self.start_rollout_id, 0)

    @property
    def done(self) -> int:
        """Rollouts done so far in this run."""
        return 0 if self.last_trained is None else self.last_trained - self.start_rollout_id + 1

    def trainer_shape(self) -> str:
        """``2 ranks, fsdp2``; empty for a trainer of one rank."""
        if self.trainer_ranks <= 1:
            return ""
        return f"{self.trainer_ranks} ranks, {self.trainer_sharding}"

    def rollout(self, rollout_id: int) -> str:
        """``rollout 4 [5/50]``: the rollout's id, then which of this run's rollouts it is."""
        return f"rollout {rollout_id} [{rollout_id - self.start_rollout_id + 1}/{self.total}]"

    def nothing_to_run(self) -> str:
        """Why the run has no rollout to do, in the config's terms."""
        if self.start_rollout_id == 0:
            return f"no rollouts to run (run.num_rollout = {self.num_rollout})"
        return f"no rollouts to run (it starts at rollout {self.start_rollout_id}, run.num_rollout = {self.num_rollout})"

    def eta_seconds(self) -> float | None:
        """Remaining time at the pace of the rollouts done so far."""
        if not self.done or self.started_at is None or self.last_time is None:
            return None
        return (self.last_time - self.started_at) / self.done * max(self.total - self.done, 0)

    def apply(self, event: Event) -> None:
        """Fold one event in."""
        if event.time:
            self.last_time = event.time
        handler = self.handler_for(event)
        if handler is not None:
            handler(event)

    @handles(RunStarted)
    def _run_started(self, event: RunStarted) -> None:
        self.run_id, self.runtime = event.run_id, event.runtime
        self.start_rollout_id, self.num_rollout = event.start_rollout_id, event.num_rollout
        self.rollout_only = event.rollout_only
        self.trainer_ranks, self.trainer_sharding = event.trainer_ranks, event.trainer_sharding
        self.started_at = event.time or None
        self.trainer_version = event.weight_version
        # Engines boot from the Hugging Face directory, even on resume, until the first publication.
        self.engine_versions = dict.fromkeys(event.engines, "default")

    @handles(RolloutGenerated)
    def _rollout_generated(self, event: RolloutGenerated) -> None:
        self.rewards.append(event.reward_mean)
        self.step_seconds["generate"] = event.generate_seconds
        if self.rollout_only:
            self.last_trained = event.rollout_id

    @handles(TrainStepFinished)
    def _train_step_finished(self, event: TrainStepFinished) -> None:
        self.train, self.last_trained = event, event.rollout_id
        self.step_seconds["train"] = event.train_seconds

    @handles(WeightsStaged)
    def _weights_staged(self, event: WeightsStaged) -> None:
        self.trainer_version = event.weight_version

    @handles(WeightsLoaded)
    def _weights_loaded(self, event: WeightsLoaded) -> None:
        self.engine_versions[event.engine] = event.weight_version

    @handles(WeightsPublished)
    def _weights_published(self, event: WeightsPublished) -> None:
        self.step_seconds["publish"] = event.publish_seconds

    @handles(PublicationVerified)
    def _publication_verified(self, event: PublicationVerified) -> None:
        self.verification_ok = True
        self.verification = f"v{event.weight_version} verified ({event.num_tensors} tensors)"
        self.step_seconds["verify"] = event.verify_seconds

    @handles(PublicationMismatch)
    def _publication_mismatch(self, event: PublicationMismatch) -> None:
        self.verification_ok = False
        self.verification = f"v{event.weight_version} {describe_mismatch(event)}"
        self.step_seconds["verify"] = event.verify_seconds

    @handles(PublicationFailed)
    def _publication_failed(self, event: PublicationFailed) -> None:
        self.verification_ok = False
        self.verification = f"v{event.weight_version} publication failed ({event.phase}): {event.reason}"

    @handles(CheckpointSaved)
    def _checkpoint_saved(self, event: CheckpointSaved) -> None:
        self.checkpoint, self.checkpoint_problem = event, ""
        self.step_seconds["save"] = event.save_seconds

    @handles(CheckpointFailed)
    def _checkpoint_failed(self, event: CheckpointFailed) -> None:
        self.checkpoint_problem = f"rollout {event.rollout_id} FAILED: {event.reason}"

    @handles(EvalFinished)
    def _eval_finished(self, event: EvalFinished) -> None:
        self.eval = event

    @handles(ActorFailed)
    def _actor_failed(self, event: ActorFailed) -> None:
        self.failures.append(f"{event.actor}: {event.error}")

    @handles(RunFinished)
    def _run_finished(self, event: RunFinished) -> None:
        self.finished = event

    def final_line(self) -> str:
        """The run's outcome in one line; the only output in quiet mode."""
        finished = self.finished
        if finished is None:
            return "run interrupted before it finished"
        reason = f": {finished.reason}" if finished.reason else ""
        if not self.total:
            where = "with no rollouts to run"
            reason = "" if finished.status == "completed" else reason  # the reason says the same
        elif finished.last_rollout_id >= self.start_rollout_id:
            where = f"after {self.rollout(finished.last_rollout_id)}"
        else:
            where = "before any rollout"
        took = ""
        if self.started_at is not None and finished.time:
            took = f" in {finished.time - self.started_at:.1f}s"
        return f"run {finished.status} {where} at weight version {finished.weight_version}{took}{reason}"


class ConsoleSink(Sink):
    """Folds every shown event into ``progress``, then hands it to the display's handler;
    ``finish`` runs once the bus is closed."""

    name = "console"

    def __init__(self) -> None:
        self.progress = RunProgress()

    @handles(*SHOWN)
    def _shown(self, event: Event) -> None:
        """Events the display does not react to itself are still folded in."""

    def observe(self, event: Event) -> None:
        self.progress.apply(event)
        super().observe(event)

    async def close(self) -> None:
        self.finish()

    def finish(self) -> None:
        """The bus is closed and every event shown."""


class PlainProgress(ConsoleSink):
    """One line per rollout (reward, loss, step times, publication outcome; each rank's time
    and peak memory for a trainer of several ranks), plus lines for the start (and the
    trainer's ranks and sharding when it has several), evals, checkpoints, mismatches,
    failures and the end. ``quiet`` keeps only the final line. Lines follow event order, so
    a given log always prints the same."""

    def __init__(self, stream: TextIO | None = None, *, verify: bool = True, quiet: bool = False) -> None:
        super().__init__()
        self.stream = stream or sys.stdout
        self.verify = verify
        self.quiet = quiet
        self.generated: dict[int, RolloutGenerated] = {}
        self.trained: dict[int, TrainStepFinished] = {}
        self.valued: dict[int, CriticStepFinished] = {}
        self.published: dict[int, WeightsPublished] = {}
        self.initial_publications = 0
        self.restored: int | None = None
        """The rollout a restored trainer holds, until its publication's outcome."""
        """Publications before the first rollout (rollout-only republishes once)."""
        self.memory_seconds: dict[int, float] = {}
        """Seconds a rollout's step spent offloading and onloading, until its line."""
        self.ended = False

    def _line(self, text: str, *, final: bool = False) -> None:
        if final or not self.quiet:
            print(text, file=self.stream, flush=True)

    @handles(RunStarted)
    def _run_started(self, event: RunStarted) -> None:
        resumed = f", resumed at weight version {event.weight_version}" if event.resumed else ""
        if event.rollout_only:
            resumed += f", rollout-only from checkpoint iteration {event.checkpoint_iteration}"
        p = self.progress
        todo = (
            f"rollouts {p.start_rollout_id}..{p.num_rollout - 1} ({p.total} to run)"
            if p.total
            else p.nothing_to_run()
        )
        self._line(
            f"run {event.run_id} ({event.runtime}): {todo}, engines {', '.join(event.engines)}{resumed}"
        )
        if p.trainer_shape():
            self._line(f"trainer: {p.trainer_shape()}")
        if event.regenerated:
            again = ", ".join(map(str, event.regenerated))
            self._line(f"rollouts {again}: asked for after the checkpoint before the resume, generated again")

    @handles(RolloutGenerated)
    def _rollout_generated(self, event: RolloutGenerated) -> None:
        if self.progress.rollout_only:
            self._line(
                f"{self.progress.rollout(event.rollout_id)}: reward {event.reward_mean:.3f} | "
                f"gen {event.generate_seconds:.2f}s | not trained (rollout-only)"
            )
        else:
            self.generated[event.rollout_id] = event

    @handles(MemoryOffloaded, MemoryOnloaded)
    def _memory_moved(self, event: MemoryOffloaded | MemoryOnloaded) -> None:
        if event.rollout_id is not None:
            self.memory_seconds[event.rollout_id] = (
                self.memory_seconds.get(event.rollout_id, 0.0) + event.seconds
            )
            return
        self._line(describe_memory(event))

    @handles(PublicationEvidenceWritten)
    def _evidence_written(self, event: PublicationEvidenceWritten) -> None:
        self._line(f"the engines serve the checkpoint exactly: evidence in {event.path}")

    @handles(PublicationEvidenceFailed)
    def _evidence_failed(self, event: PublicationEvidenceFailed) -> None:
        self._line(f"publication evidence FAILED: {event.reason}")

    @handles(TrainStepFinished)
    def _train_step_finished(self, event: TrainStepFinished) -> None:
        self.trained[event.rollout_id] = event

    @handles(CriticStepFinished)
    def _critic_step_finished(self, event: CriticStepFinished) -> None:
        self.valued[event.rollout_id] = event

    @handles(WeightsPublished)
    def _weights_published(self, event: WeightsPublished) -> None:
        if event.rollout_id is None:
            self.initial_publications += 1
            which = "initial weights published" if self.initial_publications == 1 else "weights republished"
            self._line(f"{which} as version {event.weight_version} in {event.publish_seconds:.2f}s")
        else:
            self.published[event.rollout_id] = event
        if not self.verify:
            self._publication(event.rollout_id, f"v{event.weight_version} published")

    @handles(PublicationVerified)
    def _publication_verified(self, event: PublicationVerified) -> None:
        self._publication(event.rollout_id, f"v{event.weight_version} verified", event.verify_seconds)

    @handles(PublicationMismatch)
    def _publication_mismatch(self, event: PublicationMismatch) -> None:
        self._publication(event.rollout_id, f"v{event.weight_version} MISMATCH", event.verify_seconds)
        first = event.mismatches[0] if event.mismatches else None
        detail = f" (expected {first.expected or '-'}, got {first.actual or '-'})" if first else ""
        if first is not None and first.reason:
            detail += f": {first.reason}"
        self._line(f"weight version {event.weight_version}: {describe_mismatch(event)}{detail}")

    @handles(PublicationFailed)
    def _publication_failed(self, event: PublicationFailed) -> None:
        self._publication(event.rollout_id, f"v{event.weight_version} publication failed")
        self._line(
            f"weight version {event.weight_version}: publication failed ({event.phase}): {event.reason}"
        )

    @handles(EvalFinished)
    def _eval_finished(self, event: EvalFinished) -> None:
        metrics = " ".join(f"{metric_name(k)}={v:.3f}" for k, v in sorted(event.metrics.items()))
        self._line(f"eval at {describe_eval(event)}: {metrics}")

    @handles(CheckpointSaved)
    def _checkpoint_saved(self, event: CheckpointSaved) -> None:
        self._line(
            f"checkpoint rollout {event.rollout_id} (trained from version {event.weight_version}) -> {event.path} "
            f"in {event.save_seconds:.2f}s"
        )

    @handles(CheckpointFailed)
    def _checkpoint_failed(self, event: CheckpointFailed) -> None:
        self._line(f"checkpoint rollout {event.rollout_id} FAILED: {event.reason}")

    @handles(ActorFailed)
    def _actor_failed(self, event: ActorFailed) -> None:
        self._line(f"actor {event.actor} failed: {event.error}")

    @handles(CellFailed)
    def _cell_failed(self, event: CellFailed) -> None:
        during = f" during rollout {event.rollout_id}" if event.rollout_id is not None else ""
        self._line(f"{event.cell} {'hung' if event.hung else 'failed'}{during}: {event.reason}")

    @handles(CellRestarted)
    def _cell_restarted(self, event: CellRestarted) -> None:
        if event.cell.startswith("actor-"):
            holding = f" trainer rank, after weight version {event.weight_version},"
        elif event.cell.startswith("rollout-"):
            holding = f" serving weight version {event.weight_version}"
        else:  # an actor of its own process that restarts (the Saver)
            holding = ""
        self._line(
            f"{event.cell} restarted (restart {event.attempt}, pid {event.pid}){holding} "
            f"in {event.restart_seconds:.1f}s"
        )

    @handles(TrainerRestoreRequested)
    def _trainer_restore_requested(self, event: TrainerRestoreRequested) -> None:
        redo = ", ".join(map(str, event.redo)) or "none"
        self._line(
            f"trainer restores {event.checkpoint or 'the run start'} (rollout {event.rollout_id}); "
            f"rollouts done again: {redo}"
        )
        # Trained, not published, and done again: their lines come with their second training.
        for rollout_id in event.redo:
            self.trained.pop(rollout_id, None)

    @handles(TrainerRestored)
    def _trainer_restored(self, event: TrainerRestored) -> None:
        self.restored = event.rollout_id
        self._line(
            f"trainer restored rollout {event.rollout_id} in {event.restore_seconds:.1f}s; "
            f"its next publication follows weight version {event.weight_version}"
        )

    @handles(CellSuspended)
    def _cell_suspended(self, event: CellSuspended) -> None:
        self._line(f"{event.cell} suspended")

    @handles(CellResumed)
    def _cell_resumed(self, event: CellResumed) -> None:
        if event.cell.startswith("actor-"):
            holding = f"trainer rank, after weight version {event.weight_version}"
        else:
            holding = f"serving weight version {event.weight_version}"
        self._line(f"{event.cell} resumed (pid {event.pid}) {holding}")

    @handles(FaultInjected)
    def _fault_injected(self, event: FaultInjected) -> None:
        if event.error:
            self._line(f"fault {event.mode} not injected: {event.error}")
        else:
            self._line(f"fault {event.mode} injected into {event.cell} (pid {event.pid})")

    @handles(RunFinished)
    def _run_finished(self, event: RunFinished) -> None:
        # A rollout trained but never published (a stop, a failure) still gets its line.
        for rollout_id in sorted(self.trained):
            self._publication(rollout_id, "not published")
        self._end()

    def _publication(self, rollout_id: int | None, outcome: str, verify_seconds: float | None = None) -> None:
        """The rollout's line, once its publication has an outcome."""
        if rollout_id is None:
            self._line(
                f"{'initial publication' if self.initial_publications <= 1 else 'republication'} {outcome}"
            )
            return
        generated, train = self.generated.pop(rollout_id, None), self.trained.pop(rollout_id, None)
        published = self.published.pop(rollout_id, None)
        critic = self.valued.pop(rollout_id, None)
        if train is None:
            if rollout_id == self.restored:
                self.restored = None
                self._line(f"restored weights of rollout {rollout_id}: {outcome}")
            return
        reward = f"reward {generated.reward_mean:.3f} " if generated else ""
        times = f"gen {generated.generate_seconds:.2f}s " if generated else ""
        if critic is not None:
            times += f"critic {critic.train_seconds:.2f}s "
        times += f"train {train.train_seconds:.2f}s"
        m = train.metrics
        memory = self.memory_seconds.pop(rollout_id, None)
        if memory is not None:
            times += f" offload {memory:.2f}s"
        if published is not None:
            times += f" pub {published.publish_seconds:.2f}s"
        if verify_seconds is not None:
            times += f" verify {verify_seconds:.2f}s"
        if len(train.ranks) > 1:
            times += f" | ranks {describe_ranks(train.ranks)}"
        losses = (
            "critic only" if train.critic_only else f"loss {m.loss:+.4f} kl {m.kl:.4f} grad {m.grad_norm:.3f}"
        )
        if critic is not None:
            losses += f" vloss {critic.metrics.value_loss:.4f}"
        self._line(f"{self.progress.rollout(rollout_id)}: {reward}{losses} | {times} | {outcome}")

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self._line(self.progress.final_line(), final=True)

    def finish(self) -> None:
        self._end()


def describe_memory(event: MemoryOffloaded | MemoryOnloaded) -> str:
    """One line for a memory move: whose, what, the bytes moved and, on a GPU, what came free."""
    verb = "offloaded" if isinstance(event, MemoryOffloaded) else "onloaded"
    whose = {"rollout": "engines", "actor": "trainer", "critic": "critic"}[event.target]
    what = f" ({', '.join(event.tags)})" if event.tags else ""
    moved = sum(part.bytes for part in event.parts)
    freed = sum(
        part.device_free_after - part.device_free_before for part in event.parts if part.device_free_before
    )
    device = f", device free {freed / 2**30:+.2f} GiB" if freed else ""
    return f"{whose} {verb}{what}: {moved / 2**20:.1f} MiB in {event.seconds:.2f}s{device}"


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def render_progress(progress: RunProgress, *, final: bool = False) -> Panel:
    """The display: progress and ETA, reward trend, losses, step time split, the trainer's
    ranks (several: each one's last step time and peak memory), versions, the last
    publication's verification, checkpoint and eval; ``final`` for the summary."""
    p = progress
    rows = Table.grid(padding=(0, 2))
    rows.add_column(style="bold", no_wrap=True)
    rows.add_column()
    if not p.total:
        where = p.nothing_to_run()
    elif p.last_trained is None or p.last_trained < p.start_rollout_id:
        where = f"no rollout yet [0/{p.total}]"
    else:
        where = p.rollout(p.last_trained)
    eta = p.eta_seconds()
    pace = ""
    if final and p.started_at is not None and p.last_time is not None:
        pace = f"took {_duration(p.last_time - p.started_at)}"
    elif eta is not None:
        pace = f"ETA {_duration(eta)}"
    bar = Table.grid(padding=(0, 2))
    if p.total:
        bar.add_row(ProgressBar(total=p.total, completed=p.done, width=30), Text(where), Text(pace))
    else:
        bar.add_row(Text(where), Text(pace))
    rows.add_row("progress", bar)
    if p.rewards:
        recent = list(p.rewards)
        rows.add_row(
            "reward",
            Text(
                f"{recent[-1]:.3f}  {sparkline(recent)}  min {min(recent):.3f} max {max(recent):.3f} (last {len(recent)})"
            ),
        )
    if p.train is not None:
        m = p.train.metrics
        rows.add_row(
            "train",
            Text(
                f"loss {m.loss:+.4f}  kl {m.kl:.4f}  grad {m.grad_norm:.3f}  lr {m.lr:.3g}  entropy {m.entropy:.3f}  "
                f"clip {m.clipfrac:.3f}"
            ),
        )
    if p.step_seconds:
        split = "  ".join(
            f"{label} {p.step_seconds[phase]:.2f}s" for phase, label in STEP_PHASES if phase in p.step_seconds
        )
        rows.add_row("step time", Text(split))
    if p.trainer_shape():
        ranks = p.train.ranks if p.train is not None else []
        per_rank = f" · {describe_ranks(ranks, '  ')}" if len(ranks) > 1 else ""
        rows.add_row("ranks", Text(p.trainer_shape() + per_rank))
    versions = Text(f"trainer {p.trainer_version}")
    for engine, version in p.engine_versions.items():
        versions.append(f"  {engine} {version}", style="" if version == p.trainer_version else "yellow")
    rows.add_row("versions", versions)
    if p.verification:
        rows.add_row("verification", Text(p.verification, style="green" if p.verification_ok else "bold red"))
    if p.checkpoint_problem:
        rows.add_row("checkpoint", Text(p.checkpoint_problem, style="bold red"))
    elif p.checkpoint is not None:
        c = p.checkpoint
        rows.add_row(
            "checkpoint",
            Text(f"rollout {c.rollout_id} (trained from version {c.weight_version}) -> {c.path}"),
        )
    if p.eval is not None:
        scores = " ".join(f"{metric_name(k)}={v:.4g}" for k, v in sorted(p.eval.metrics.items()))
        rows.add_row("eval", Text(f"{describe_eval(p.eval)}: {scores}"))
    for failure in p.failures[-3:]:
        rows.add_row("failed", Text(failure, style="bold red"))
    status = p.finished.status if p.finished else "running"
    border = {"completed": "green", "stopped": "yellow", "failed": "red"}.get(status, "blue")
    if final:
        rows.add_row("status", Text(p.final_line(), style=border))
    title = f"run {p.run_id} ({p.runtime})" if p.run_id else "run"
    return Panel(rows, title=title, subtitle=status, border_style=border, expand=False)


class RichProgress(ConsoleSink):
    """A live display, redrawn on events at most once per ``min_interval`` seconds; at the
    end it gives way to the final summary, which stays on screen."""

    def __init__(
        self,
        console: Console | None = None,
        *,
        stream: TextIO | None = None,
        verify: bool = True,
        min_interval: float = 0.25,
    ) -> None:
        super().__init__()
        self.console = console or Console(file=stream or sys.stdout)
        self.min_interval = min_interval
        self._last_refresh = float("-inf")
        self._timer: asyncio.Task[None] | None = None
        self._clock: Clock = SYSTEM_CLOCK
        self.live = Live(
            render_progress(self.progress), console=self.console, auto_refresh=False, transient=True
        )
        self._moved: list[tuple[logging.StreamHandler, TextIO]] = []  # type: ignore[type-arg]

    async def start(self, context: SinkContext) -> None:
        self._clock = context.bus.clock
        streams = sys.stdout, sys.stderr
        self.live.start()
        self._moved = self._follow_redirect(streams)

    @staticmethod
    def _follow_redirect(before: tuple[TextIO, TextIO]) -> list[tuple[logging.StreamHandler, TextIO]]:  # type: ignore[type-arg]
        """Point console log handlers at the streams the live display redirected, so log
        lines print above the display instead of tearing it."""
        moved = []
        for old, new in zip(before, (sys.stdout, sys.stderr), strict=True):
            if new is old:
                continue
            for handler in logging.getLogger().handlers:
                if type(handler) is logging.StreamHandler and handler.stream is old:
                    handler.setStream(new)
                    moved.append((handler, old))
        return moved

    @handles(*SHOWN)
    def _shown(self, event: Event) -> None:
        wait = self._last_refresh + self.min_interval - self._clock.monotonic()
        if wait <= 0:
            self._refresh()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._refresh_after(wait))

    async def _refresh_after(self, wait: float) -> None:
        await self._clock.sleep(wait)
        self._timer = None
        try:
            self._refresh()
        except Exception:
            logger.warning("console display failed; the run goes on", exc_info=True)

    def _refresh(self) -> None:
        self._last_refresh = self._clock.monotonic()
        self.live.update(render_progress(self.progress), refresh=True)

    def finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self.live.stop()
        finally:
            for handler, stream in self._moved:
                handler.setStream(stream)
        self.console.print(render_progress(self.progress, final=True))


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def make_console(config: Config, stream: TextIO | None = None) -> ConsoleSink:
    """The display ``config.console.mode`` asks for, on ``stream`` (default ``sys.stdout``).
    ``auto`` is the live display on a terminal, plain lines otherwise (CI logs, files, pipes)."""
    stream = stream or sys.stdout
    mode = config.console.mode
    verify = config.verifier.enabled
    if mode == "auto":
        mode = "rich" if _is_tty(stream) else "plain"
    if mode == "rich":
        return RichProgress(stream=stream, verify=verify)
    return PlainProgress(stream, verify=verify, quiet=mode == "quiet")
