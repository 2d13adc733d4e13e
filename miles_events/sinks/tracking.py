"""Experiment tracking as bus subscribers: TensorBoard event files and Weights & Biases runs.

``attach_tracking(bus, session)`` is a ``Session(on_bus=[...])`` hook. Like the seed's
``init_tracking(args)`` it runs before any actor starts, and like its
``finish_tracking()`` in a ``finally`` the session closes the sinks even when the run fails
or is interrupted. A backend that cannot start raises ``TrackingError`` from the hook, so
the run stops with one line before any work is done.

Every scalar is logged at step ``rollout_id``:

    rollout/reward_mean  rollout/response_tokens  perf/generate_seconds  (RolloutGenerated)
    train/loss  train/pg_loss  train/kl  train/entropy  train/grad_norm  train/clipfrac
    perf/train_seconds                                                   (TrainStepFinished)
    perf/publish_seconds  weights/version                                (WeightsPublished)
    perf/verify_seconds                          (PublicationVerified / PublicationMismatch)
    weights/mismatched_tensors                                        (PublicationMismatch)
    checkpoint/save_seconds                                              (CheckpointSaved)
    eval/<metric>                                                        (EvalFinished)

The initial publication (before rollout ``start_rollout_id``) has no rollout step and is
not logged.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec

from miles_events.bus.event_bus import EventBus
from schemas.config import Config
from schemas.events import (
    CheckpointSaved,
    EvalFinished,
    Event,
    PublicationMismatch,
    PublicationVerified,
    RolloutGenerated,
    RunFinished,
    TrainStepFinished,
    WeightsPublished,
)

logger = logging.getLogger(__name__)

TRACKED: tuple[type[Event], ...] = (
    RolloutGenerated, TrainStepFinished, WeightsPublished, PublicationVerified, PublicationMismatch,
    CheckpointSaved, EvalFinished, RunFinished,
)  # fmt: skip
SECTIONS = ("rollout", "train", "perf", "weights", "checkpoint", "eval")
"""Key prefixes; wandb plots every ``<section>/*`` against ``rollout_id``."""
MAX_BATCH = 256


class TrackingError(ValueError):
    """A tracking backend cannot start; the message is one line naming the setting and the fix."""


class SessionLike(Protocol):
    """What the hook needs of ``miles_events.app.session.Session``."""

    config: Config
    run_id: str
    run_dir: Path


Row = tuple[int, float, dict[str, float]]
"""(rollout_id, event time, scalars)."""


def rollout_scalars(event: Event) -> tuple[int, dict[str, float]] | None:
    """The scalars ``event`` contributes, with their step; None for events without any."""
    if isinstance(event, RolloutGenerated):
        return event.rollout_id, {
            "rollout/reward_mean": event.reward_mean,
            "rollout/response_tokens": float(event.response_tokens),
            "perf/generate_seconds": event.generate_seconds,
        }
    if isinstance(event, TrainStepFinished):
        return event.rollout_id, {
            "train/loss": event.loss,
            "train/pg_loss": event.pg_loss,
            "train/kl": event.kl,
            "train/entropy": event.entropy,
            "train/grad_norm": event.grad_norm,
            "train/clipfrac": event.clipfrac,
            "perf/train_seconds": event.train_seconds,
        }
    if isinstance(event, WeightsPublished) and event.rollout_id is not None:
        scalars = {"perf/publish_seconds": event.publish_seconds}
        if event.weight_version.isdigit():
            scalars["weights/version"] = float(event.weight_version)
        return event.rollout_id, scalars
    if isinstance(event, PublicationVerified) and event.rollout_id is not None:
        return event.rollout_id, {"perf/verify_seconds": event.verify_seconds}
    if isinstance(event, PublicationMismatch) and event.rollout_id is not None:
        return event.rollout_id, {
            "perf/verify_seconds": event.verify_seconds,
            "weights/mismatched_tensors": float(len(event.mismatches)),
        }
    if isinstance(event, CheckpointSaved):
        return event.rollout_id, {"checkpoint/save_seconds": event.save_seconds}
    if isinstance(event, EvalFinished):
        return event.rollout_id, {
            key if key.startswith("eval/") else f"eval/{key}": value for key, value in event.metrics.items()
        }
    return None


class TrackingSink:
    """Drains its own mailbox in batches into ``write``; remembers how the run ended.

    The drain never raises: a backend error is logged once and the mailbox keeps draining,
    since a mailbox nobody empties would stall every publisher (backpressure)."""

    name = "tracking"

    def __init__(self, bus: EventBus) -> None:
        self.exit_code = 1
        """1 until ``RunFinished`` says otherwise: an interrupted run did not succeed."""
        self._failed_once = False
        self.mailbox = bus.subscribe(self.name, TRACKED, max_size=max(bus.mailbox_size, 2 * MAX_BATCH))
        self.task = asyncio.create_task(self._drain(), name=self.name)

    async def _drain(self) -> None:
        while batch := await self.mailbox.get_batch(MAX_BATCH):
            rows: list[Row] = []
            for event in batch:
                if isinstance(event, RunFinished):
                    self.exit_code = 1 if event.status == "failed" else 0
                elif (found := rollout_scalars(event)) is not None:
                    rows.append((found[0], event.time, found[1]))
            if not rows:
                continue
            try:
                self.write(rows)
            except Exception:
                if not self._failed_once:
                    self._failed_once = True
                    logger.warning("%s: logging failed; the run goes on", self.name, exc_info=True)

    def write(self, rows: list[Row]) -> None:
        """Log the rows of one batch (they are flushed before the next batch is awaited)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Finish the backend; called once the mailbox is drained."""


class TensorBoardSink(TrackingSink):
    """Scalars into TensorBoard event files, flushed after every batch (so at least once per
    rollout); event times are the wall times, so a replayed log plots like the run."""

    name = "tensorboard"

    def __init__(self, bus: EventBus, writer: Any) -> None:
        self.writer = writer
        super().__init__(bus)

    def write(self, rows: list[Row]) -> None:
        for step, walltime, scalars in rows:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step=step, walltime=walltime or None)
        self.writer.flush()

    async def aclose(self) -> None:
        self.writer.close()


class WandbSink(TrackingSink):
    """Scalars into a wandb run, plotted against ``rollout_id``.

    Saves finish in the background while the next rollout runs, so a rollout's metrics can
    arrive after later rollouts' ones. wandb drops ``log(step=...)`` calls below its current
    step; declaring ``rollout_id`` as the step metric keeps such late values."""

    name = "wandb"

    def __init__(self, bus: EventBus, run: Any) -> None:
        self.run = run
        run.define_metric("rollout_id")
        for section in SECTIONS:
            run.define_metric(f"{section}/*", step_metric="rollout_id")
        super().__init__(bus)

    def write(self, rows: list[Row]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for step, _, scalars in rows:
            by_step.setdefault(step, {}).update(scalars)
        for step, scalars in by_step.items():
            self.run.log({"rollout_id": step, **scalars})

    async def aclose(self) -> None:
        # Finishing syncs the run's files (uploads when online): keep the loop free.
        await anyio.to_thread.run_sync(lambda: self.run.finish(exit_code=self.exit_code))


class Tracking:
    """Every enabled sink as one: ``task`` ends when all mailboxes are drained, ``aclose``
    finishes each backend (one failing does not keep the others from finishing)."""

    def __init__(self, sinks: Sequence[TrackingSink]) -> None:
        self.sinks = list(sinks)
        self.task = asyncio.create_task(self._drained(), name="tracking")

    async def _drained(self) -> None:
        for sink in self.sinks:
            await sink.task

    async def aclose(self) -> None:
        for sink in self.sinks:
            try:
                await sink.aclose()
            except Exception:
                logger.warning("%s: closing failed", sink.name, exc_info=True)


def _missing(package: str, setting: str) -> TrackingError:
    return TrackingError(f"{setting} = true needs the '{package}' package, which is not installed (pip install {package})")


def check_tracking(config: Config) -> None:
    """Raise ``TrackingError`` if an enabled backend's package is missing (no imports, no
    side effects: for a driver to fail fast, before the model is prepared)."""
    tracking = config.tracking
    if tracking.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise _missing("tensorboard", "tracking.tensorboard")
    if tracking.wandb and importlib.util.find_spec("wandb") is None:
        raise _missing("wandb", "tracking.wandb")


def tensorboard_dir(session: SessionLike) -> Path:
    """``tracking.tensorboard_dir``, else ``<run.dir>/tensorboard/<run_id>``."""
    configured = session.config.tracking.tensorboard_dir
    return Path(configured).resolve() if configured else session.run_dir / "tensorboard" / session.run_id


def open_tensorboard(log_dir: Path) -> Any:
    """A ``SummaryWriter`` on ``log_dir``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise _missing("tensorboard", "tracking.tensorboard") from None
    try:
        return SummaryWriter(log_dir=str(log_dir))
    except OSError as error:
        raise TrackingError(f"tracking.tensorboard: cannot write event files to {log_dir}: {error}") from None


def start_wandb(session: SessionLike) -> Any:
    """``wandb.init`` for this run: named and identified by ``run_id`` (so a resumed run
    continues its wandb run), with the resolved config, under ``wandb_dir`` or the run dir."""
    tracking = session.config.tracking
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_MODE"] = tracking.wandb_mode
    try:
        import wandb
    except ImportError:
        raise _missing("wandb", "tracking.wandb") from None
    # wandb puts its files in a "wandb" folder under ``dir``: <run.dir>/wandb/offline-run-*.
    root = Path(tracking.wandb_dir).resolve() if tracking.wandb_dir else session.run_dir
    root.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(
            mode=tracking.wandb_mode,
            project=tracking.wandb_project,
            group=tracking.wandb_group,
            dir=str(root),
            name=session.run_id,
            id=session.run_id,
            config=msgspec.to_builtins(session.config),
            resume="allow",
            # Leave stdout alone: the console display owns it.
            settings=wandb.Settings(console="off"),
        )
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise TrackingError(f"tracking.wandb: cannot start a {tracking.wandb_mode} run: {first_line}") from None


def attach_tracking(bus: EventBus, session: SessionLike) -> Tracking:
    """The ``Session`` hook: start every enabled backend, then subscribe their sinks.

    Raises ``TrackingError`` (a ``ValueError``) before anything is subscribed if a backend
    cannot start; backends already started are closed first."""
    tracking = session.config.tracking
    check_tracking(session.config)
    writer = run = None
    try:
        if tracking.tensorboard:
            writer = open_tensorboard(tensorboard_dir(session))
        if tracking.wandb:
            run = start_wandb(session)
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    sinks: list[TrackingSink] = []
    if writer is not None:
        sinks.append(TensorBoardSink(bus, writer))
    if run is not None:
        sinks.append(WandbSink(bus, run))
    return Tracking(sinks)
