"""Experiment tracking as bus subscribers: TensorBoard event files and Weights & Biases runs.

``make_tracking(config)`` gives the sinks of the enabled backends. Like the seed's
``init_tracking(args)`` they start before any actor starts, and like its
``finish_tracking()`` in a ``finally`` the session closes them even when the run fails or
is interrupted. A backend that cannot start raises ``TrackingError`` from its ``start``, so
the run stops with one line before any work is done.

Every scalar is logged at step ``rollout_id``:

    rollout/reward_mean  rollout/response_tokens  perf/generate_seconds  (RolloutGenerated)
    train/loss  train/pg_loss  train/kl  train/entropy  train/grad_norm  train/lr  train/clipfrac
    perf/train_seconds                                                   (TrainStepFinished)
    train/critic/value_loss  train/critic/value_clipfrac  train/critic/value_mean
    train/critic/return_mean  train/critic/grad_norm  train/critic/lr
    perf/critic_seconds                              (CriticStepFinished, PPO with a critic)
    train/rank<r>/step_seconds  train/rank<r>/peak_memory_bytes
    train/rank<r>/state_bytes      (TrainStepFinished.ranks, a trainer of several ranks)
    perf/publish_seconds  weights/version                                (WeightsPublished)
    perf/verify_seconds                          (PublicationVerified / PublicationMismatch)
    weights/mismatched_tensors                                        (PublicationMismatch)
    checkpoint/save_seconds                                              (CheckpointSaved)
    eval/<metric>                                                        (EvalFinished)

The initial publication (before rollout ``start_rollout_id``) has no rollout step and is
not logged.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
import urllib.parse
from pathlib import Path
from typing import Any

import anyio
import msgspec

from miles_events.bus.handlers import handles
from miles_events.sinks.base import Sink, SinkContext
from miles_events.util.error_text import first_line
from miles_events.util.file_modes import why_unwritable
from schemas.config import Config
from schemas.events import (
    CheckpointSaved,
    CriticStepFinished,
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

SECTIONS = ("rollout", "train", "perf", "weights", "checkpoint", "eval")
"""Key prefixes; wandb plots every ``<section>/*`` against ``rollout_id``."""


class TrackingError(ValueError):
    """A tracking backend cannot start; the message is one line naming the setting and the fix."""


Row = tuple[int, float, dict[str, float]]
"""(rollout_id, event time, scalars)."""


class TrackingSink(Sink):
    """Collects the scalars of each delivered batch and hands them to ``write`` at its
    end; remembers how the run ended."""

    name = "tracking"

    def __init__(self) -> None:
        self.exit_code = 1
        """1 until ``RunFinished`` says otherwise: an interrupted run did not succeed."""
        self._rows: list[Row] = []

    def _row(self, event: Event, rollout_id: int, scalars: dict[str, float]) -> None:
        self._rows.append((rollout_id, event.time, scalars))

    @handles(RolloutGenerated)
    def _rollout_generated(self, event: RolloutGenerated) -> None:
        self._row(event, event.rollout_id, {
            "rollout/reward_mean": event.reward_mean,
            "rollout/response_tokens": float(event.response_tokens),
            "perf/generate_seconds": event.generate_seconds,
        })  # fmt: skip

    @handles(TrainStepFinished)
    def _train_step_finished(self, event: TrainStepFinished) -> None:
        scalars = {
            "train/loss": event.metrics.loss,
            "train/pg_loss": event.metrics.pg_loss,
            "train/kl": event.metrics.kl,
            "train/entropy": event.metrics.entropy,
            "train/grad_norm": event.metrics.grad_norm,
            "train/lr": event.metrics.lr,
            "train/clipfrac": event.metrics.clipfrac,
            "perf/train_seconds": event.train_seconds,
        }
        if len(event.ranks) > 1:
            for r in event.ranks:
                scalars[f"train/rank{r.rank}/step_seconds"] = r.step_seconds
                scalars[f"train/rank{r.rank}/peak_memory_bytes"] = float(r.peak_memory_bytes)
                scalars[f"train/rank{r.rank}/state_bytes"] = float(r.state_bytes)
        self._row(event, event.rollout_id, scalars)

    @handles(CriticStepFinished)
    def _critic_step_finished(self, event: CriticStepFinished) -> None:
        m = event.metrics
        self._row(event, event.rollout_id, {
            "train/critic/value_loss": m.value_loss,
            "train/critic/value_clipfrac": m.value_clipfrac,
            "train/critic/value_mean": m.value_mean,
            "train/critic/return_mean": m.return_mean,
            "train/critic/grad_norm": m.grad_norm,
            "train/critic/lr": m.lr,
            "perf/critic_seconds": event.train_seconds,
        })  # fmt: skip

    @handles(WeightsPublished)
    def _weights_published(self, event: WeightsPublished) -> None:
        if event.rollout_id is None:
            return
        scalars = {"perf/publish_seconds": event.publish_seconds}
        if event.weight_version.isdigit():
            scalars["weights/version"] = float(event.weight_version)
        self._row(event, event.rollout_id, scalars)

    @handles(PublicationVerified)
    def _publication_verified(self, event: PublicationVerified) -> None:
        if event.rollout_id is not None:
            self._row(event, event.rollout_id, {"perf/verify_seconds": event.verify_seconds})

    @handles(PublicationMismatch)
    def _publication_mismatch(self, event: PublicationMismatch) -> None:
        if event.rollout_id is not None:
            self._row(event, event.rollout_id, {
                "perf/verify_seconds": event.verify_seconds,
                "weights/mismatched_tensors": float(len(event.mismatches)),
            })  # fmt: skip

    @handles(CheckpointSaved)
    def _checkpoint_saved(self, event: CheckpointSaved) -> None:
        self._row(event, event.rollout_id, {"checkpoint/save_seconds": event.save_seconds})

    @handles(EvalFinished)
    def _eval_finished(self, event: EvalFinished) -> None:
        self._row(event, event.rollout_id, {
            key if key.startswith("eval/") else f"eval/{key}": value for key, value in event.metrics.items()
        })  # fmt: skip

    @handles(RunFinished)
    def _run_finished(self, event: RunFinished) -> None:
        self.exit_code = 1 if event.status == "failed" else 0

    def flush(self) -> None:
        rows, self._rows = self._rows, []
        if rows:
            self.write(rows)

    def write(self, rows: list[Row]) -> None:
        """Log the rows of one batch (they are flushed before the next batch is awaited)."""
        raise NotImplementedError


class TensorBoardSink(TrackingSink):
    """Scalars into TensorBoard event files, flushed after every batch (so at least once per
    rollout); event times are the wall times, so a replayed log plots like the run."""

    name = "tensorboard"

    def __init__(self, writer: Any = None) -> None:
        super().__init__()
        self.writer = writer

    def prepare(self, config: Config) -> None:
        if self.writer is None:
            check_writable("tracking.tensorboard_dir", tensorboard_root(config))

    async def start(self, context: SinkContext) -> None:
        if self.writer is None:
            self.writer = open_tensorboard(tensorboard_dir(context))

    def write(self, rows: list[Row]) -> None:
        for step, walltime, scalars in rows:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, global_step=step, walltime=walltime or None)
        self.writer.flush()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbSink(TrackingSink):
    """Scalars into a wandb run, plotted against ``rollout_id``.

    Saves finish in the background while the next rollout runs, so a rollout's metrics can
    arrive after later rollouts' ones. wandb drops ``log(step=...)`` calls below its current
    step; declaring ``rollout_id`` as the step metric keeps such late values."""

    name = "wandb"

    def __init__(self, run: Any = None) -> None:
        super().__init__()
        self.run = run
        self._owns_service = False
        """This sink started the run, and so wandb's service of this process."""

    def prepare(self, config: Config) -> None:
        if self.run is None:
            check_writable("tracking.wandb_dir", wandb_root(config))
            check_wandb_credentials(config)

    async def start(self, context: SinkContext) -> None:
        if self.run is None:
            self.run = start_wandb(context)
            self._owns_service = True
        self.run.define_metric("rollout_id")
        for section in SECTIONS:
            self.run.define_metric(f"{section}/*", step_metric="rollout_id")

    def write(self, rows: list[Row]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for step, _, scalars in rows:
            by_step.setdefault(step, {}).update(scalars)
        for step, scalars in by_step.items():
            self.run.log({"rollout_id": step, **scalars})

    async def close(self) -> None:
        if self.run is not None:
            # Finishing syncs the run's files (uploads when online): keep the loop free.
            await anyio.to_thread.run_sync(self._finish)

    def _finish(self) -> None:
        self.run.finish(exit_code=self.exit_code)
        if self._owns_service:
            # ``finish`` returns before wandb's service has written the run's last records
            # (its file may still be the bare header): tearing the service down waits for
            # them, so the run's files are whole once the session has closed its sinks.
            import wandb

            wandb.teardown(exit_code=self.exit_code)


def _missing(package: str, setting: str) -> TrackingError:
    return TrackingError(
        f"{setting} = true needs the '{package}' package, which is not installed (pip install {package})"
    )


def check_tracking(config: Config) -> None:
    """Raise ``TrackingError`` if an enabled backend's package is missing (no imports, no
    side effects: for a driver to fail fast, before the model is prepared)."""
    tracking = config.tracking
    if tracking.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise _missing("tensorboard", "tracking.tensorboard")
    if tracking.wandb and importlib.util.find_spec("wandb") is None:
        raise _missing("wandb", "tracking.wandb")


def check_writable(key: str, path: Path) -> None:
    """``TrackingError`` naming ``key`` when ``path`` cannot be created or written."""
    reason = why_unwritable(path)
    if reason is not None:
        raise TrackingError(f"{key}: cannot write to {path}: {reason}")


def tensorboard_root(config: Config) -> Path:
    """``tracking.tensorboard_dir``, else ``<run.dir>/tensorboard``."""
    configured = config.tracking.tensorboard_dir
    return Path(configured).resolve() if configured else Path(config.run.dir).resolve() / "tensorboard"


def tensorboard_dir(run: SinkContext) -> Path:
    """``tracking.tensorboard_dir``, else ``<run.dir>/tensorboard/<run_id>``."""
    configured = run.config.tracking.tensorboard_dir
    return Path(configured).resolve() if configured else run.run_dir / "tensorboard" / run.run_id


def wandb_root(config: Config) -> Path:
    """``tracking.wandb_dir``, else the run dir (wandb adds its ``wandb/`` folder)."""
    configured = config.tracking.wandb_dir
    return Path(configured).resolve() if configured else Path(config.run.dir).resolve()


WANDB_HOST = "https://api.wandb.ai"


def check_wandb_credentials(config: Config) -> None:
    """An online wandb run needs credentials: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``
    or a netrc entry for the server (``WANDB_BASE_URL``), where ``wandb login`` keeps them.
    Without them ``wandb.init`` fails only once the run has started."""
    if config.tracking.wandb_mode != "online":
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = os.environ.get("WANDB_BASE_URL") or WANDB_HOST
    if _netrc_has(urllib.parse.urlparse(host).hostname or host):
        return
    raise TrackingError(
        f'tracking.wandb_mode = "online" needs a wandb API key for {host}, and none is set: run `wandb login`, '
        'set WANDB_API_KEY, or use tracking.wandb_mode = "offline"'
    )


def _netrc_has(hostname: str) -> bool:
    """Whether the user's netrc (``NETRC``, else ``~/.netrc``) has a password for ``hostname``."""
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(hostname)
    except (OSError, netrc.NetrcParseError):
        return False
    return entry is not None and bool(entry[2])


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


def start_wandb(run: SinkContext) -> Any:
    """``wandb.init`` for this run: named and identified by ``run_id`` (so a resumed run
    continues its wandb run), with the resolved config, under ``wandb_dir`` or the run dir."""
    tracking = run.config.tracking
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["WANDB_MODE"] = tracking.wandb_mode
    try:
        import wandb
    except ImportError:
        raise _missing("wandb", "tracking.wandb") from None
    # wandb puts its files in a "wandb" folder under ``dir``: <run.dir>/wandb/offline-run-*.
    root = wandb_root(run.config)
    root.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(
            mode=tracking.wandb_mode,
            project=tracking.wandb_project,
            group=tracking.wandb_group,
            dir=str(root),
            name=run.run_id,
            id=run.run_id,
            config=msgspec.to_builtins(run.config),
            resume="allow",
            # Leave stdout alone: the console display owns it.
            settings=wandb.Settings(console="off"),
        )
    except Exception as error:
        raise TrackingError(
            f"tracking.wandb: cannot start a {tracking.wandb_mode} run: {first_line(error)}"
        ) from None


def make_tracking(config: Config) -> list[TrackingSink]:
    """The sinks of every enabled backend; each starts its backend in ``start``, raising
    ``TrackingError`` (a ``ValueError``) with one line when it cannot."""
    check_tracking(config)
    sinks: list[TrackingSink] = []
    if config.tracking.tensorboard:
        sinks.append(TensorBoardSink())
    if config.tracking.wandb:
        sinks.append(WandbSink())
    return sinks
