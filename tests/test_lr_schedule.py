"""The learning-rate schedule: warmup then constant, linear or cosine decay, a pure function
of the optimizer step; the trainer follows it step by step; a schedule that cannot be
followed is refused before the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from actors.trainer_backend.torch_backend import TorchTrainerBackend
from miles_events.app.config import ConfigError
from miles_events.app.preflight import check_lr_schedule
from miles_events.rl.lr_schedule import LrSchedule, ScheduleError, optimizer_steps_per_rollout
from schemas.config import Config, DataConfig, RunConfig, TrainerConfig
from schemas.rollout import RolloutBatch
from tests.test_trainer import make_config, two_group_samples


def schedule(style: str, warmup: int = 2, decay: int = 10, init: float = 0.0) -> LrSchedule:
    return LrSchedule(
        lr=1.0, min_lr=0.1, warmup_init=init, warmup_steps=warmup, decay_style=style, decay_steps=decay
    )


def test_warmup_rises_linearly_from_its_initial_rate() -> None:
    s = schedule("cosine", warmup=4, init=0.2)
    assert [s.lr_at(k) for k in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


@pytest.mark.parametrize(
    ("style", "at_6", "at_10"),
    [
        ("constant", 1.0, 1.0),
        ("linear", 0.55, 0.1),
        ("cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1),
    ],
)
def test_the_decay_reaches_min_lr_at_lr_decay_steps_counted_from_step_0_and_stays(
    style: str, at_6: float, at_10: float
) -> None:
    s = schedule(style)
    assert s.lr_at(2) == 1.0, "the peak right after the warmup"
    assert s.lr_at(6) == pytest.approx(at_6), "half-way from the warmup's end to step 10"
    assert s.lr_at(10) == pytest.approx(at_10)
    assert s.lr_at(1000) == pytest.approx(at_10)


def test_unset_decay_steps_are_the_runs_optimizer_steps() -> None:
    config = Config(
        run=RunConfig(num_rollout=5),
        data=DataConfig(rollout_batch_size=4, n_samples_per_prompt=8),
        trainer=TrainerConfig(global_batch_size=10, lr_decay_style="linear"),
    )
    assert optimizer_steps_per_rollout(config) == 4
    assert LrSchedule.of(config).decay_steps == 20


@pytest.mark.parametrize(
    ("trainer", "run", "message"),
    [
        (
            TrainerConfig(lr_decay_style="cosine"),
            RunConfig(num_rollout=None),
            "trainer.lr_decay_steps: unset with lr_decay_style = 'cosine' and no run.num_rollout",
        ),
        (
            TrainerConfig(lr=0.001, min_lr=0.01),
            RunConfig(),
            "trainer.min_lr: 0.01 is above trainer.lr (0.001)",
        ),
        (
            TrainerConfig(lr_decay_style="linear", lr_warmup_steps=8, lr_decay_steps=8),
            RunConfig(),
            "trainer.lr_decay_steps: 8 steps leave nothing to decay over after trainer.lr_warmup_steps (8)",
        ),
    ],
)
def test_a_schedule_that_cannot_be_followed_is_a_config_error_naming_the_setting(
    trainer: TrainerConfig, run: RunConfig, message: str
) -> None:
    config = Config(run=run, trainer=trainer)
    with pytest.raises(ScheduleError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        LrSchedule.of(config)
    with pytest.raises(ConfigError) as raised:
        check_lr_schedule(config)
    assert raised.value.key == message.partition(":")[0]


def test_the_trainer_steps_at_the_schedules_rate(model_dir: Path, tmp_path: Path) -> None:
    """Each optimizer step's rate is the schedule's at the run's step count, which a
    restored count continues."""
    config = make_config(
        model_dir, tmp_path, lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=6, min_lr=1e-5
    )
    backend = TorchTrainerBackend(config)
    expected = LrSchedule.of(config)
    seen = []
    for rollout_id in range(4):
        metrics = backend.train(RolloutBatch(rollout_id=rollout_id, samples=two_group_samples()))
        seen.append((backend.num_optimizer_steps, metrics.lr, backend.optimizer.param_groups[0]["lr"]))
    steps = [count for count, _, _ in seen]
    assert [lr for _, lr, _ in seen] == [expected.lr_at(count - 1) for count in steps]
    assert [group for _, _, group in seen] == [expected.lr_at(count - 1) for count in steps]
    assert steps == [1, 2, 3, 4]
    assert len({lr for _, lr, _ in seen}) == 4, "the rate changes from step to step"
    restored = TorchTrainerBackend(config)
    restored.load_state(backend.named_weights(), backend.optimizer_state_dict(), backend.rng_state(), 2)
    assert restored.train(RolloutBatch(rollout_id=2, samples=two_group_samples())).lr == seen[2][1]
