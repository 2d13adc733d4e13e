"""The learning rate of each optimizer step: a linear warmup, then a decay (constant, linear
or cosine) to ``trainer.min_lr``, as Megatron's scheduler has it.

Step ``k`` (from 0, counting every optimizer step the run has taken, across resumes) trains
at ``lr_at(k)``: from ``lr_warmup_init`` rising linearly to ``lr`` over the first
``lr_warmup_steps`` steps, then decaying over the steps up to ``lr_decay_steps`` (counted
from step 0, warmup included) to ``min_lr``, where it stays. It is a pure function of the
step and the config, so a resumed run, which restores the step count from its checkpoint,
trains at exactly the rates the uninterrupted run would have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.config import Config


class ScheduleError(ValueError):
    """A schedule that cannot be followed; the message names the setting."""


def optimizer_steps_per_rollout(config: Config) -> int:
    """Optimizer steps each rollout takes: its samples cut into global batches."""
    samples = config.data.rollout_batch_size * config.data.n_samples_per_prompt
    batch = config.trainer.global_batch_size or samples
    return math.ceil(samples / batch)


@dataclass(frozen=True)
class LrSchedule:
    lr: float
    min_lr: float
    warmup_init: float
    warmup_steps: int
    decay_style: str
    decay_steps: int

    @classmethod
    def of(cls, config: Config) -> LrSchedule:
        """The run's schedule; ``lr_decay_steps`` unset is the run's optimizer steps
        (``run.num_rollout`` rollouts, counted from rollout 0)."""
        trainer = config.trainer
        decay_steps = trainer.lr_decay_steps
        if decay_steps is None:
            if trainer.lr_decay_style == "constant":
                decay_steps = trainer.lr_warmup_steps
            elif config.run.num_rollout is None:
                raise ScheduleError(
                    f"trainer.lr_decay_steps: unset with lr_decay_style = {trainer.lr_decay_style!r} and no "
                    "run.num_rollout to count the run's steps from; set either"
                )
            else:
                decay_steps = config.run.num_rollout * optimizer_steps_per_rollout(config)
        if trainer.min_lr > trainer.lr:
            raise ScheduleError(f"trainer.min_lr: {trainer.min_lr:g} is above trainer.lr ({trainer.lr:g})")
        if trainer.lr_decay_style != "constant" and decay_steps <= trainer.lr_warmup_steps:
            raise ScheduleError(
                f"trainer.lr_decay_steps: {decay_steps} steps leave nothing to decay over after "
                f"trainer.lr_warmup_steps ({trainer.lr_warmup_steps}); the decay counts from step 0, warmup included"
            )
        return cls(
            lr=trainer.lr,
            min_lr=trainer.min_lr,
            warmup_init=trainer.lr_warmup_init,
            warmup_steps=trainer.lr_warmup_steps,
            decay_style=trainer.lr_decay_style,
            decay_steps=decay_steps,
        )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (from 0)."""
        if step < self.warmup_steps:
            return self.warmup_init + (self.lr - self.warmup_init) * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        if self.decay_style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor
