"""Every check a run can fail at start-up, made before the run writes anything.

``check_start(config, sinks, run_id)`` is what a session does first and what ``--dry-run``
does instead of the run: one place, so the two can never disagree. After the input checks
(``miles_events.app.preflight``, done by the caller), it asks, in order and only reading:

- ``MILES_DEBUG_PYSPY_DUMP_INTERVAL``, when set, is a number of seconds;
- the run directory: it can be created and written, its ``events.log`` (if any) is an event
  log that no other run holds (``run_dir.check_usable``);
- the built-in base model already in the run directory was built from these settings
  (``plan.resolve``);
- the plan: the checkpoint a resume continues from, another run's checkpoints refused
  without ``run.overwrite``, what will be set aside (``plan.make_plan``: nothing is moved
  yet);
- the disk: the run directory's file system has room for the base model (when it is still
  to be built) and one checkpoint (``check_disk``);
- each sink's ``prepare``: the metrics port is taken (and held), tracking can start (its
  directory, wandb's credentials when online).

A failure raises one of ``START_ERRORS`` with one line (the CLI's exit 2), having written,
created, moved or appended nothing; what the sinks prepared so far is released.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_events.app.config import ConfigError
from miles_events.app.plan import PlannedRun, make_plan, resolve
from miles_events.app.pyspy import PySpyError, interval_from_env
from miles_events.app.run_dir import RunDirError, check_usable
from miles_events.checkpoint.format import CheckpointError
from miles_events.rl.hf_model import BaseModelMismatch, base_model_built
from miles_events.rl.model_size import DTYPE_BYTES, builtin_parameter_count
from miles_events.rl.prompts import DataError
from miles_events.sinks.base import Sink
from miles_events.sinks.control.server import ControlError
from miles_events.sinks.metrics import MetricsError
from miles_events.sinks.tracking import TrackingError
from miles_events.util.file_modes import nearest_existing
from schemas.config import Config

START_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    DataError,
    CheckpointError,
    MetricsError,
    TrackingError,
    RunDirError,
    BaseModelMismatch,
    PySpyError,
    ControlError,
)
"""What a start-up check raises for something the user can fix (exit 2)."""

OPTIMIZER_BYTES_PER_PARAMETER = 8
"""AdamW's two float32 moments, saved beside the weights."""


@dataclass
class CheckedStart:
    """What the checks found, for the session to start from."""

    config: Config
    """Resolved: absolute paths, the model every actor loads."""
    planned: PlannedRun
    sinks: list[Sink]
    """Prepared (a port held): started by the session, or released."""
    pyspy_interval: float | None
    """``MILES_DEBUG_PYSPY_DUMP_INTERVAL`` in seconds (None: no dumps)."""

    def release(self) -> None:
        """Give back what the sinks hold (the run is not going to start)."""
        for sink in self.sinks:
            sink.release()


def check_start(config: Config, sinks: Sequence[Sink], run_id: str) -> CheckedStart:
    """Every start-up check, reading only; see the module's docstring."""
    pyspy_interval = interval_from_env()
    run_dir = Path(config.run.dir).resolve()
    check_usable(run_dir)
    resolved = resolve(config)
    planned = make_plan(resolved, resolved.run.runtime, run_id)
    check_disk(config, run_dir)
    prepared: list[Sink] = []
    try:
        for sink in sinks:
            prepared.append(sink)
            sink.prepare(resolved)
    except BaseException:
        for sink in prepared:
            sink.release()
        raise
    return CheckedStart(resolved, planned, prepared, pyspy_interval)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def model_parameters(config: Config) -> int:
    """The model's parameter count: the built-in one's from its shape; a Hugging Face
    directory's from the size of its weight files and the dtype its config names."""
    if config.model.path is None:
        return builtin_parameter_count(config.model.builtin)
    path = Path(config.model.path)
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) + sum(
        p.stat().st_size for p in path.glob("*.bin")
    )
    try:
        stored = json.loads((path / "config.json").read_text(encoding="utf-8"))
        dtype = str(stored.get("torch_dtype") or stored.get("dtype") or "float32")
    except (OSError, ValueError, AttributeError):
        dtype = "float32"
    return weights // DTYPE_BYTES.get(dtype, 4)


def disk_needed(config: Config, run_dir: Path) -> int:
    """Bytes a run writes into ``run_dir`` before its first checkpoint is complete: the
    built-in base model when it is still to be built, and one checkpoint (weights in
    ``model.dtype`` and the optimizer's state) unless the run only rolls out."""
    parameters = model_parameters(config)
    weight_bytes = parameters * DTYPE_BYTES[config.model.dtype]
    needed = 0 if base_model_built(config.model, run_dir, config.run.seed) else weight_bytes
    if not config.run.rollout_only_from_checkpoint:
        needed += weight_bytes + parameters * OPTIMIZER_BYTES_PER_PARAMETER
    return needed


def check_disk(config: Config, run_dir: Path) -> None:
    """The run directory's file system has room for ``disk_needed``."""
    free = shutil.disk_usage(nearest_existing(run_dir)).free
    needed = disk_needed(config, run_dir)
    if needed > free:
        raise RunDirError(
            f"run.dir {run_dir}: its file system has {_gib(free)} free, and the run needs about {_gib(needed)} "
            "before its first checkpoint is complete (the base model, the weights and the optimizer's state): "
            "free some space or choose another run.dir"
        )
