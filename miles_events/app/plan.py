"""Before any actor starts: the resolved config and the run plan.

The plan fixes the loop's bounds and the one checkpoint the trainer starts from (this
run's latest on resume, else the one ``run.load`` or ``run.ref_load`` names): chosen and
verified here, once, and handed to the trainer through the plan.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from miles_events.app.config import config_digest
from miles_events.rl.checkpoint import latest_checkpoint, marked_checkpoint
from miles_events.rl.hf_model import prepare_base_model
from miles_events.rl.prompts import load_prompts, whole_batches_per_epoch
from miles_events.rl.versions import engine_names
from schemas.checkpoint import TrainerState
from schemas.config import Config
from schemas.plan import RunPlan

logger = logging.getLogger(__name__)


def resolve(config: Config) -> Config:
    """Build the model every actor loads (once per run directory); return the config with
    absolute paths to it and to the run directory."""
    run_dir = Path(config.run.dir).resolve()
    model_path = prepare_base_model(config.model, run_dir, config.run.seed)
    model = msgspec.structs.replace(config.model, path=str(Path(model_path).resolve()))
    run = msgspec.structs.replace(config.run, dir=str(run_dir))
    return msgspec.structs.replace(config, model=model, run=run)


def make_plan(config: Config, runtime: str) -> RunPlan:
    """The loop's bounds, and where a resumed run picks up."""
    data = config.data
    per_epoch: int | None = None
    if config.run.num_rollout is not None:
        # As in miles: a given num_rollout has no epoch boundary, so no epoch-end triggers.
        num_rollout = config.run.num_rollout
    else:
        num_prompts = len(load_prompts(data.prompt_data, data.input_key, data.label_key)) if data.prompt_data else 0
        per_epoch = whole_batches_per_epoch(num_prompts, data.rollout_batch_size)
        num_rollout = per_epoch * config.run.num_epoch
    run = config.run
    start, weight_version, resumed = 0, "default", False
    checkpoint: Path | None = None
    iteration: int | None = None
    if run.resume and not run.rollout_only_from_checkpoint:
        checkpoint = latest_checkpoint(Path(run.dir))
        if checkpoint is None:
            logger.info("run.resume: no complete checkpoint under %s", run.dir)
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
        logger.info("starting from %s: rollout %d, weight version %s", checkpoint, start, state.weight_version)
    reference: Path | None = None
    if run.ref_load is not None and config.trainer.use_kl_loss:
        reference = checkpoint if loaded_ref else marked_checkpoint(Path(run.ref_load))[0]
    if run.start_rollout_id is not None:
        start = run.start_rollout_id
    return RunPlan(
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
        rollout_only=run.rollout_only_from_checkpoint,
        checkpoint_iteration=iteration,
    )
