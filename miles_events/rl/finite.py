"""Non-finite values (NaN, +-inf) in training: found, named, and never trained on silently.

A non-finite reward, loss or gradient norm ends the step as ``trainer.on_non_finite``
says: ``fail`` (the run stops with one line naming the rollout and the samples or the
optimizer step), ``skip_sample`` (samples with a non-finite reward are left out; a
non-finite loss or gradient skips that optimizer step) or ``skip_step`` (the rollout, or
the optimizer step, is not trained on). Whatever the policy, weights with a non-finite
value are never published or saved.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from schemas.rollout import RolloutBatch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


MAX_LISTED = 10


class NonFiniteError(ValueError):
    """A non-finite value where training cannot go on; the message is one line."""


def non_finite_rewards(rewards: Sequence[float]) -> list[int]:
    """Indices of the rewards that are NaN or infinite."""
    return [i for i, reward in enumerate(rewards) if not math.isfinite(reward)]


def describe_samples(rollout_id: int, indices: Sequence[int], rewards: Sequence[float]) -> str:
    shown = ", ".join(f"{i} ({rewards[i]})" for i in indices[:MAX_LISTED])
    more = f" and {len(indices) - MAX_LISTED} more" if len(indices) > MAX_LISTED else ""
    return f"rollout {rollout_id}: non-finite reward in {len(indices)} sample(s): {shown}{more}"


def finite_part(batch: RolloutBatch, policy: str, who: str = "the trainer") -> RolloutBatch:
    """The part of ``batch`` to train on, as ``trainer.on_non_finite`` (``policy``) says for
    non-finite rewards; ``who`` trains on it (logged)."""
    rewards = [s.reward for s in batch.samples]
    bad = non_finite_rewards(rewards)
    if not bad:
        return batch
    what = describe_samples(batch.rollout_id, bad, rewards)
    if policy == "fail":
        raise NonFiniteError(f"{what} (trainer.on_non_finite = 'fail')")
    if policy == "skip_step":
        logger.warning(
            "%s: %s does not train on the rollout (trainer.on_non_finite = 'skip_step')", what, who
        )
        return msgspec.structs.replace(batch, samples=[])
    logger.warning("%s: %s leaves those samples out (trainer.on_non_finite = 'skip_sample')", what, who)
    drop = set(bad)
    return msgspec.structs.replace(batch, samples=[s for i, s in enumerate(batch.samples) if i not in drop])


def non_finite_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    import torch

    return [
        name
        for name, tensor in tensors.items()
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all())
    ]


def require_finite_weights(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """``NonFiniteError`` naming the tensors when any holds a non-finite value."""
    bad = non_finite_tensors(tensors)
    if bad:
        shown = ", ".join(bad[:MAX_LISTED]) + (
            f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        )
        raise NonFiniteError(f"{what}: non-finite values in {len(bad)} tensor(s) ({shown}); refused")
