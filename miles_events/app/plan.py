"""Before any actor starts: the resolved config and the run plan.

The plan fixes the loop's bounds and, on resume, the one checkpoint the run continues
from: chosen and verified here, once, and handed to the trainer through the plan.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from miles_events.app.config import config_digest
from miles_events.rl.checkpoint import latest_checkpoint
from miles_events.rl.hf_model import prepare_base_model
from miles_events.rl.prompts import DataError, load_prompts
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
        per_epoch = num_prompts // data.rollout_batch_size
        if per_epoch <= 0:
            raise DataError(
                f"run.num_rollout is unset and data.prompt_data has {num_prompts} prompts, fewer than one "
                f"rollout batch (data.rollout_batch_size = {data.rollout_batch_size}): set run.num_rollout "
                "or a smaller batch"
            )
        num_rollout = per_epoch * config.run.num_epoch
    start, weight_version, resumed, checkpoint = 0, "default", False, None
    if config.run.resume:
        checkpoint = latest_checkpoint(Path(config.run.dir))
        if checkpoint is None:
            logger.info("run.resume: no complete checkpoint under %s; starting fresh", config.run.dir)
        else:
            state = msgspec.json.decode((checkpoint / "trainer_state.json").read_bytes(), type=TrainerState)
            start, weight_version, resumed = state.rollout_id + 1, state.weight_version, True
            logger.info("resuming from %s: rollout %d, weight version %s", checkpoint, start, weight_version)
    if config.run.start_rollout_id is not None:
        start = config.run.start_rollout_id
    return RunPlan(
        start_rollout_id=start,
        num_rollout=num_rollout,
        num_rollout_per_epoch=per_epoch,
        resumed=resumed,
        weight_version=weight_version,
        engines=tuple(engine_names(config)),
        runtime=runtime,
        config_digest=config_digest(config),
        resume_checkpoint=str(checkpoint) if checkpoint is not None else None,
    )
