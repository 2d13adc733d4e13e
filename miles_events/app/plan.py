"""Before any actor starts: the resolved config and the run plan.

The plan fixes the loop's bounds and the one checkpoint the trainer starts from (this
run's latest on resume, else the one ``run.load`` or ``run.ref_load`` names): chosen and
verified here, once, and handed to the trainer through the plan.

Planning only reads. What the plan needs changed on disk (checkpoints a resume passes over
and a later save would replace, another run's checkpoints that ``run.overwrite`` replaces)
comes back as ``SetAside`` steps that the session carries out with ``set_aside_all`` once
every start-up check has passed.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from actors.engine import reads_back_every_tensor
from miles_events.app.config import config_digest
from miles_events.app.run_dir import EVENT_LOG
from miles_events.bus.event_log import read_events
from miles_events.checkpoint.format import CheckpointError, checkpoint_rollout_id, has_critic
from miles_events.checkpoint.resume import (
    checkpoint_dirs,
    choose_resume_checkpoint,
    marked_checkpoint,
    saved_lineage,
    set_aside,
)
from miles_events.rl.hf_model import base_model_built, base_model_dir, prepare_base_model
from miles_events.rl.prompts import load_prompts, whole_batches_per_epoch
from miles_events.rl.versions import engine_names
from miles_events.runtime.base import Preparation
from schemas.checkpoint import TrainerState
from schemas.config import Config, resolved_sharding
from schemas.events import RolloutRequested
from schemas.plan import RunPlan

logger = logging.getLogger(__name__)


def resolve(config: Config) -> Config:
    """The config with absolute paths to the run directory and to the model every actor
    loads (a built-in one built from other settings is refused here; one not built yet is
    ``base_model_preparation``'s)."""
    run_dir = Path(config.run.dir).resolve()
    base_model_built(config.model, run_dir, config.run.seed)
    model_path = base_model_dir(config.model, run_dir)
    model = msgspec.structs.replace(config.model, path=str(model_path.resolve()))
    run = msgspec.structs.replace(config.run, dir=str(run_dir))
    return msgspec.structs.replace(config, model=model, run=run)


def base_model_preparation(config: Config) -> Preparation | None:
    """Building the built-in model, when the run directory has none yet (once per run
    directory), for the runtime to run before any actor starts; ``config`` as the run
    had it before ``resolve``."""
    run_dir = Path(config.run.dir).resolve()
    if base_model_built(config.model, run_dir, config.run.seed):
        return None
    build = functools.partial(prepare_base_model, config.model, run_dir, config.run.seed)
    return Preparation("building the built-in base model", build)


@dataclass(frozen=True)
class SetAside:
    """A checkpoint directory (or the whole ``checkpoints/``) to rename out of the way."""

    path: Path
    why: str
    """The suffix it gets (``set_aside``)."""
    reason: str
    """Logged when it is done: what it is and why it goes."""


@dataclass(frozen=True)
class PlannedRun:
    plan: RunPlan
    moves: tuple[SetAside, ...] = ()
    """What the run moves out of the way before it starts (``set_aside_all``)."""


def set_aside_all(steps: tuple[SetAside, ...]) -> None:
    """Carry out the planned ``SetAside`` steps, in order, each logged as a warning."""
    for step in steps:
        moved = set_aside(step.path, step.why)
        logger.warning("%s; set aside as %s", step.reason, moved)


def make_plan(config: Config, runtime: str, run_id: str = "") -> PlannedRun:
    """The loop's bounds, where a resumed run picks up, and what must be set aside first;
    ``run_id`` is the new run's (the lineage of a fresh run). Reads only: a plan that cannot
    be made (a resume with nothing to resume from, another run's checkpoints without
    ``run.overwrite``) raises ``CheckpointError`` with nothing changed."""
    data = config.data
    per_epoch: int | None = None
    if config.run.num_rollout is not None:
        # As in miles: a given num_rollout has no epoch boundary, so no epoch-end triggers.
        num_rollout = config.run.num_rollout
    else:
        num_prompts = (
            len(load_prompts(data.prompt_data, data.input_key, data.label_key, chat=data.apply_chat_template))
            if data.prompt_data
            else 0
        )
        per_epoch = whole_batches_per_epoch(num_prompts, data.rollout_batch_size)
        num_rollout = per_epoch * config.run.num_epoch
    run = config.run
    start, weight_version, resumed = 0, "default", False
    checkpoint: Path | None = None
    iteration: int | None = None
    lineage = run_id
    moves: tuple[SetAside, ...] = ()
    if run.resume and not run.rollout_only_from_checkpoint:
        checkpoint, resumed_lineage, moves = _resume_checkpoint(Path(run.dir))
        lineage = resumed_lineage or lineage
        if checkpoint is None:
            logger.info("run.resume: no checkpoint under %s", run.dir)
    elif not run.rollout_only_from_checkpoint:
        moves = _replace_another_runs_checkpoints(config)
    load = run.load or run.ref_load
    loaded_ref = False
    if checkpoint is None and load is not None:
        loaded_ref = run.load is None
        # As miles' --load: the checkpoint its latest_checkpointed_iteration.txt names.
        checkpoint, iteration = marked_checkpoint(Path(load))
    elif checkpoint is None and run.resume:
        logger.info("run.resume: starting fresh")
    if checkpoint is not None:
        state = msgspec.json.decode((checkpoint / "trainer_state.json").read_bytes(), type=TrainerState)
        start = state.rollout_id + 1
        if not run.rollout_only_from_checkpoint:
            # Publications continue the saved version; rollout-only publishes "1" first.
            weight_version, resumed = state.weight_version, True
        logger.info(
            "starting from %s: rollout %d, weight version %s", checkpoint, start, state.weight_version
        )
    reference: Path | None = None
    if run.ref_load is not None and config.trainer.use_kl_loss:
        reference = checkpoint if loaded_ref else marked_checkpoint(Path(run.ref_load))[0]
    critic: Path | None = None
    if config.trainer.use_critic:
        if checkpoint is not None and has_critic(checkpoint):
            critic = checkpoint
        elif run.critic_load is not None:
            critic = marked_checkpoint(Path(run.critic_load))[0]
            if not has_critic(critic):
                raise CheckpointError(
                    f"run.critic_load: checkpoint {critic} holds no critic (no critic/ in its manifest)"
                )
    if run.start_rollout_id is not None:
        start = run.start_rollout_id
    # Only this run's own log says what it asked for (``run.load`` may start another lineage).
    regenerated = _asked_before(Path(run.dir), start) if resumed and run.resume else ()
    if regenerated:
        logger.info(
            "rollouts asked for before, after the checkpoint, generated again: %s",
            ", ".join(map(str, regenerated)),
        )
    plan = RunPlan(
        start_rollout_id=start,
        num_rollout=num_rollout,
        num_rollout_per_epoch=per_epoch,
        resumed=resumed,
        weight_version=weight_version,
        engines=tuple(engine_names(config)),
        runtime=runtime,
        config_digest=config_digest(config),
        load_checkpoint=str(checkpoint) if checkpoint is not None else None,
        reference_checkpoint=str(reference) if reference is not None else None,
        critic_checkpoint=str(critic) if critic is not None else None,
        rollout_only=run.rollout_only_from_checkpoint,
        checkpoint_iteration=iteration,
        lineage=lineage,
        probe=probe_publications(config),
        trainer_ranks=config.trainer.num_ranks,
        trainer_sharding=resolved_sharding(config.trainer),
        regenerated=regenerated,
    )
    return PlannedRun(plan, moves)


def _asked_before(run_dir: Path, start: int) -> tuple[int, ...]:
    """The rollouts from ``start`` on that the run directory's event log says were asked
    for (what a resume generates again); every readable record counts."""
    path = run_dir / EVENT_LOG
    asked: set[int] = set()
    try:
        for event in read_events(path, on_damage=lambda *_: None):
            if isinstance(event, RolloutRequested) and event.rollout_id >= start:
                asked.add(event.rollout_id)
    except (OSError, ValueError):
        pass  # no log, or one cut short: what it read counts
    return tuple(sorted(asked))


def probe_publications(config: Config) -> bool:
    """``verifier.probe`` resolved: "auto" probes when the engine backend cannot read back
    every tensor it serves (its digests then leave some out)."""
    probe = config.verifier.probe
    if probe == "auto":
        return config.verifier.enabled and not reads_back_every_tensor(config.generator.engine)
    return probe == "on" and config.verifier.enabled


def _resume_checkpoint(run_dir: Path) -> tuple[Path | None, str, tuple[SetAside, ...]]:
    """The checkpoint ``run.resume`` continues from, its lineage, and the checkpoints passed
    over that a later save would replace (to be set aside: renamed, never deleted). With
    checkpoints there but none to resume from, or none there but an earlier run's moved aside
    by ``run.overwrite``, ``CheckpointError`` says so."""
    choice = choose_resume_checkpoint(run_dir)
    if choice.checkpoint is None:
        if choice.found:
            reasons = dict(choice.skipped)
            listed = "; ".join(f"{p.name}: {reasons.get(p, 'not checked')}" for p in choice.found)
            raise CheckpointError(
                f"run.resume: no checkpoint under {run_dir / 'checkpoints'} can be resumed from ({listed}); "
                "nothing was changed: repair or move them, or start in another run.dir"
            )
        replaced = replaced_checkpoints(run_dir)
        if replaced:
            raise CheckpointError(
                f"run.resume: no checkpoint under {run_dir / 'checkpoints'}, but run.overwrite moved an earlier "
                f"run's checkpoints to {replaced[-1]}: move them back to checkpoints/ to resume them, or set "
                "run.resume = false to start over"
            )
        return None, "", ()
    chosen = checkpoint_rollout_id(choice.checkpoint) or 0
    moves: list[SetAside] = []
    for path, reason in choice.skipped:
        if (checkpoint_rollout_id(path) or 0) > chosen:
            why = "other-lineage" if reason.startswith("another run's") else "unreadable"
            moves.append(SetAside(path, why, f"run.resume: {path.name}: {reason}"))
    # Another run's checkpoints are never this run's to replace or to prune, wherever they lie.
    examined = {path for path, _ in choice.skipped} | {choice.checkpoint}
    for path in choice.found:
        lineage = saved_lineage(path)
        if path not in examined and lineage and choice.lineage and lineage != choice.lineage:
            moves.append(
                SetAside(
                    path, "other-lineage", f"run.resume: {path.name} is another run's (lineage {lineage})"
                )
            )
    return choice.checkpoint, choice.lineage, tuple(moves)


REPLACED_PREFIX = "checkpoints.replaced-"
"""How ``run.overwrite`` renames the ``checkpoints/`` it replaces (then a time)."""


def replaced_checkpoints(run_dir: Path) -> list[Path]:
    """The ``checkpoints/`` directories ``run.overwrite`` moved aside in ``run_dir``, oldest
    first."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.name.startswith(REPLACED_PREFIX) and p.is_dir())


def check_run_dir(config: Config) -> None:
    """Refuse a fresh run whose ``run.dir`` holds another run's checkpoints, unless
    ``run.overwrite`` (it would replace some, prune its own and leave a resume to pick the
    other's). Reads only: ``--dry-run`` asks it too."""
    run = config.run
    if run.resume or run.rollout_only_from_checkpoint or run.overwrite:
        return
    run_dir = Path(run.dir)
    existing = checkpoint_dirs(run_dir)
    if existing:
        names = ", ".join(p.name for p in existing[:3]) + (
            f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        )
        raise CheckpointError(
            f"run.dir {run_dir} holds another run's checkpoints ({names}): set run.resume = true to continue "
            "it, choose another run.dir, or set run.overwrite = true to move them aside and start over"
        )


def _replace_another_runs_checkpoints(config: Config) -> tuple[SetAside, ...]:
    """``check_run_dir``; with ``run.overwrite``, another run's checkpoints are to be moved
    aside whole."""
    check_run_dir(config)
    run_dir = Path(config.run.dir)
    if config.run.overwrite and checkpoint_dirs(run_dir):
        why = REPLACED_PREFIX.removeprefix("checkpoints.") + time.strftime("%Y%m%d-%H%M%S")
        return (SetAside(run_dir / "checkpoints", why, "run.overwrite: the previous run's checkpoints"),)
    return ()
