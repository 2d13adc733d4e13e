"""The trainer backend seam: what the Trainer actor needs from a training engine.

The actor owns the protocol (events, weight versions, data-plane references); a backend
owns the model and the optimizer, and is built as ``Backend(config)`` from the run's config
(see ``actors.trainer_backend.BACKENDS``). The PyTorch backend implements this on one process; a
Megatron-core backend would implement the same methods over its parallel groups, gathering
full Hugging Face-named tensors on the rank that publishes.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from miles_events.bus.cancel import Cancellation
from schemas.events import MemoryPart, RankStep, TrainMetrics
from schemas.rollout import RolloutBatch

if TYPE_CHECKING:
    import torch

    from miles_events.device.buckets import Buckets
    from schemas.config import Config


class TrainerBackend(ABC):
    """A policy model with its optimizer, trained on rollout batches."""

    @abstractmethod
    def __init__(self, config: Config) -> None:
        """Build the model and the optimizer of the run ``config`` describes."""

    @abstractmethod
    def train(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> TrainMetrics:
        """Train on every sample of ``batch`` (one or more optimizer steps); blocking.

        ``cancel`` is checked at every micro-batch until the first optimizer step: a cancelled
        step raises ``Cancelled`` with the weights and optimizer untouched. After the first
        optimizer step the rollout is trained to its end (half a rollout is never kept)."""

    @abstractmethod
    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The model's tensors under Hugging Face names, as published to engines.

        Tied duplicates (a tensor sharing storage with one listed earlier) and
        non-persistent buffers are left out. With ``dtype`` the tensors are converted;
        the result may alias live parameters, so callers copy before training continues.
        """

    def weight_buckets(self) -> Buckets | None:
        """The tensors of ``named_weights()``, held in flat buckets that the model trains in
        place (its parameters are views of them), or None when it keeps them otherwise.
        Staging a publication in the weights' own dtype then copies each bucket whole."""
        return None

    @property
    @abstractmethod
    def num_optimizer_steps(self) -> int:
        """Optimizer steps taken since the run began (restored on resume)."""

    @abstractmethod
    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()``, loadable by ``load_state``."""

    @abstractmethod
    def load_state(
        self,
        weights: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        num_optimizer_steps: int,
    ) -> None:
        """Restore a checkpoint staged from ``named_weights``, ``optimizer_state_dict`` and
        ``rng_state``."""

    @abstractmethod
    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        """Make ``weights`` (as ``named_weights`` gives them) the KL reference; without a KL
        loss there is no reference and this does nothing."""

    @abstractmethod
    def probe_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """The current weights' log-probability of each response token after its prompt
        (teacher-forced): the trainer's half of the publication probe (``miles_events.rl.probe``)."""

    def rng_state(self) -> dict[str, Any]:
        """Every random number generator state training may draw from."""
        return capture_rng_state()

    def rank_steps(self) -> list[RankStep]:
        """What each rank's part of the last ``train`` took, in rank order (empty where the
        backend does not say)."""
        return []

    offloaded: bool = False
    """Whether the state lives in its host copy (``offload``) until ``onload``."""

    def offload(self) -> list[MemoryPart]:
        """The seed's ``offload()``: the weights, gradients and optimizer state (and a KL
        reference) to a host copy, freeing the device; ``named_weights``, the optimizer's and
        the RNG's state still read (from the host), but ``train`` refuses until ``onload``.
        One part per rank."""
        raise NotImplementedError(f"{type(self).__name__} cannot offload (run.offload_train)")

    def onload(self) -> list[MemoryPart]:
        """The seed's ``onload()``: the state back on the device. One part per rank."""
        raise NotImplementedError(f"{type(self).__name__} cannot onload (run.offload_train)")

    def clear_memory(self) -> None:
        """The seed's ``clear_memory()`` after a step: the device's cached blocks given back."""

    async def close(self) -> None:
        """Release what the backend started (its ranks' processes); called once, at the end."""


def capture_rng_state() -> dict[str, Any]:
    """The process's RNG states: torch CPU, every CUDA device when present, Python's ``random``."""
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng_state`` took; a missing CUDA entry leaves CUDA alone."""
    import torch

    torch.set_rng_state(state["torch"])
    python_state = state["python"]
    # torch.load may hand back the inner tuple as a list; random.setstate wants tuples.
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
