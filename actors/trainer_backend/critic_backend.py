"""PPO's critic on PyTorch: a value model trained with the clipped value loss.

The value model is the policy's architecture as a Hugging Face ``*ForTokenClassification``
with one label: the same decoder, and a ``score`` layer in place of the LM head that reads
one value off the hidden state of every position. Built from the policy's base model its
``score`` layer is zeros (every state is worth 0 until the critic learns, the seed's new
value head); ``run.critic_load`` or a resumed checkpoint then loads its trained weights.

One rollout is trained as the policy is (``TorchTrainerBackend``: optimizer steps of
``global_batch_size`` samples, micro-batches, one rank's share of each step per rank, a
prompt shared by a group run once): first, without gradients, the critic values every
response token (``values``: what the policy's GAE advantages are computed from, with the
weights before this rollout), and the GAE returns of those values are its targets; then
each step minimises ``ppo.value_loss`` around them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from actors.trainer_backend.parallel import Parallel
from actors.trainer_backend.ppo import gae, token_rewards, value_loss
from actors.trainer_backend.torch_backend import (
    MicroBatch,
    SharedPromptBatch,
    TorchTrainerBackend,
    split,
)
from miles_events.bus.cancel import Cancellation
from miles_events.rl.hf_model import torch_dtype
from schemas.config import Config, critic_config
from schemas.events import CriticMetrics
from schemas.rollout import RolloutBatch, Sample


def load_value_model(path: str, dtype: str, device: torch.device) -> PreTrainedModel:
    """The value model of the Hugging Face directory ``path``: a causal LM's decoder with a
    ``score`` layer of zeros, or a saved value model (``*ForTokenClassification``) as saved."""
    import logging

    from transformers import AutoConfig, AutoModelForTokenClassification

    saved = AutoConfig.from_pretrained(path)
    is_value_model = any(a.endswith("ForTokenClassification") for a in (saved.architectures or []))
    # Building from a causal LM, transformers reports the LM head left out and the new
    # score layer; both are intended here.
    modeling = logging.getLogger("transformers.modeling_utils")
    level = modeling.level
    modeling.setLevel(logging.ERROR)
    try:
        model: PreTrainedModel = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=torch_dtype(dtype), use_safetensors=True
        )
    finally:
        modeling.setLevel(level)
    if not is_value_model:
        score: torch.nn.Module = model.get_submodule("score")
        with torch.no_grad():
            for parameter in score.parameters():
                parameter.zero_()
    model = model.to(device)  # type: ignore[arg-type]  # transformers types .to as a plain function
    return model


class TorchCriticBackend(TorchTrainerBackend):
    """The critic's backend: in this process, or one rank of the critic's process group."""

    has_reference = False

    def __init__(self, config: Config, parallel: Parallel | None = None) -> None:
        super().__init__(critic_config(config), parallel)
        self.values: dict[int, list[float]] = {}
        """The last rollout's values this rank computed: sample position -> one per response token."""

    def _build_model(self, path: str) -> PreTrainedModel:
        return load_value_model(path, self.config.model.dtype, self.device)

    def _values(self, micro: MicroBatch | SharedPromptBatch) -> torch.Tensor:
        """``[batch, max_response_len]`` float32: the value of the state in which each
        response token is chosen."""
        return self._response_logits(False, micro).squeeze(-1).float()

    def train(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> Any:
        raise TypeError("the critic trains with train_critic")

    def train_critic(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> CriticMetrics:
        """Value every response token of ``batch`` (``self.values``), then train on it."""
        self._require_onloaded("train")
        return self._reported(lambda: self._train_critic(batch, cancel))

    def _train_critic(self, batch: RolloutBatch, cancel: Cancellation | None) -> CriticMetrics:
        trainer = self.config.trainer
        samples: list[Sample] = batch.samples
        self.values = {}
        if not samples:
            return CriticMetrics()
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=self.device)
        step_size = trainer.global_batch_size or len(samples)
        step_indices = split(list(range(len(samples))), step_size)
        steps = [self._micro_batches(samples, step) for step in step_indices]
        micro_batches = [micro for step in steps for micro in step]
        loss_scale = float(self.parallel.world_size)

        old_values: list[torch.Tensor] = []
        returns: list[torch.Tensor] = []
        with torch.no_grad():
            for micro in micro_batches:
                self._check_cancel(cancel)  # nothing has changed yet
                mask = micro.mask.to(self.device)
                values = self._values(micro) * mask
                targets = gae(
                    token_rewards(rewards[micro.indices], mask), values, mask, trainer.gamma, trainer.lambd
                )[1]
                old_values.append(values)
                returns.append(targets)
                for row, index in enumerate(micro.indices):
                    length = len(samples[index].response_ids)
                    if float(mask[row].sum()) > 0:  # not a rank's empty filler
                        self.values[index] = values[row, :length].tolist()

        totals = dict.fromkeys(("value_loss", "value_clipfrac", "value_mean", "return_mean"), 0.0)
        total_tokens, grad_norm, trained_steps, position = 0, 0.0, 0, 0
        lr = self.lr_schedule.lr_at(self._num_optimizer_steps)
        for number, (step, indices) in enumerate(zip(steps, step_indices, strict=True), start=1):
            step_tokens = sum(len(samples[i].response_ids) for i in indices)
            step_totals = dict.fromkeys(totals, 0.0)
            self.optimizer.zero_grad(set_to_none=True)
            for count, micro in enumerate(step, start=1):
                if trained_steps == 0:
                    self._check_cancel(cancel)
                old, target = old_values[position], returns[position]
                position += 1
                mask = micro.mask.to(self.device)
                with self.parallel.no_sync(self.root, last=count == len(step)):
                    terms = value_loss(
                        self._values(micro),
                        old,
                        target,
                        mask,
                        value_clip=trainer.value_clip,
                        num_tokens=step_tokens,
                    )
                    (terms.loss * loss_scale if self.parallel.sharded else terms.loss).backward()
                weight = max(step_tokens, 1)
                parts = torch.stack(
                    [terms.loss.detach(), terms.clipfrac, terms.value_mean, terms.return_mean]
                ).tolist()
                for key, value in zip(step_totals, parts, strict=True):
                    step_totals[key] += value * weight
            stepped = self._optimizer_step(
                step_totals,
                f"critic, rollout {batch.rollout_id}, optimizer step {number} of {len(steps)}",
                step_tokens,
            )
            if stepped is None:
                continue
            step_totals, grad_norm, lr = stepped
            trained_steps += 1
            total_tokens += step_tokens
            for key, value in step_totals.items():
                totals[key] += value
        self.optimizer.zero_grad(set_to_none=True)
        denominator = max(total_tokens, 1)
        return CriticMetrics(
            value_loss=totals["value_loss"] / denominator,
            value_clipfrac=totals["value_clipfrac"] / denominator,
            value_mean=totals["value_mean"] / denominator,
            return_mean=totals["return_mean"] / denominator,
            grad_norm=grad_norm,
            train_tokens=total_tokens,
            num_optimizer_steps=trained_steps,
            lr=lr,
        )

    def probe_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        raise TypeError("the critic is never published")
