"""The PyTorch trainer backend: a Hugging Face causal LM trained with GRPO and AdamW.

One rollout is trained as follows. Advantages are normalised within each group over the
whole rollout. The samples, in rollout order, are cut into optimizer steps of
``global_batch_size`` samples (unset: one step; a last, shorter step takes the remainder),
and each step into micro-batches of ``micro_batch_size``. Every micro-batch's loss is
divided by the token count of its whole step, so accumulating gradients over micro-batches
equals one step on the undivided batch.

Old log-probabilities are the weights' before the first optimizer step, computed once: the
first step's are its own training forward (detached: its ratio is exactly 1), the later
steps' come from one forward pass without gradients before the first optimizer step, or,
with ``trainer.use_rollout_logprobs``, from the engine that sampled them (every publication
is verified to serve the trainer's weights, so they are the same policy's). The reference's
(with a KL loss) are computed in that pass too. A forward feeds each sequence less its last
token (which predicts nothing) and applies the output head only at the positions that
predict response tokens; with ``trainer.shared_prompts`` each distinct prompt of a
micro-batch runs once and the responses on its copied KV cache (``SharedPromptBatch``).
Log-probabilities and entropies come from one fused pass over the logits
(``grpo.logprobs_and_entropy``).

The model stays in eval mode: dropout would make the recomputed old log-probabilities
disagree with the ones of the training pass, and RL fine-tuning does not use it.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from actors.trainer_backend.base import TrainerBackend, restore_rng_state
from actors.trainer_backend.grpo import (
    expand_advantages,
    group_advantages,
    logprobs_and_entropy,
    policy_loss,
)
from miles_events.bus.cancel import Cancellation
from miles_events.device.buckets import Buckets, bucket_parameters
from miles_events.rl.finite import NonFiniteError
from miles_events.rl.hf_model import cache_kwarg, load_model, torch_dtype
from miles_events.rl.probe import teacher_forced_logprobs
from miles_events.rl.weights import split_tied
from schemas.config import Config
from schemas.events import TrainMetrics
from schemas.rollout import RolloutBatch, Sample

logger = logging.getLogger(__name__)

PLAIN_HEAD_MODELS = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral"})
"""Architectures whose logits are the output head applied to the base model's last hidden
state, nothing more (no soft-capping or scaling): their head runs at response positions only."""


@dataclass(frozen=True)
class MicroBatch:
    """Samples packed for one forward pass, right-padded; token tensors are response-aligned."""

    indices: list[int]
    """Positions of the samples in the rollout."""
    input_ids: torch.Tensor
    """``[batch, max_len]`` prompt + response ids, padded with 0."""
    attention_mask: torch.Tensor
    logit_index: torch.Tensor
    """``[batch, max_response_len]``: the sequence position whose logits predict each response token."""
    targets: torch.Tensor
    """``[batch, max_response_len]`` response ids, padded with 0."""
    mask: torch.Tensor
    """``[batch, max_response_len]`` float32, 1.0 for real response tokens."""


def pack_samples(samples: list[Sample], indices: list[int]) -> MicroBatch:
    """Right-pad each sample's prompt + response, less the last response token (it predicts
    nothing), and locate the position whose logits predict each response token."""
    for sample in samples:
        if not sample.prompt_ids:
            raise ValueError(f"sample {sample.index} has an empty prompt: nothing predicts its first token")
    fed = [(s.prompt_ids + s.response_ids)[:-1] if s.response_ids else list(s.prompt_ids) for s in samples]
    max_len = max(len(ids) for ids in fed)
    max_response = max(len(s.response_ids) for s in samples)
    input_rows, attention_rows, index_rows, target_rows = [], [], [], []
    for sample, ids in zip(samples, fed, strict=True):
        prompt_len, response_len = len(sample.prompt_ids), len(sample.response_ids)
        pad, response_pad = max_len - len(ids), max_response - response_len
        input_rows.append(ids + [0] * pad)
        attention_rows.append([1] * len(ids) + [0] * pad)
        # Logits at position t predict token t + 1.
        index_rows.append(list(range(prompt_len - 1, prompt_len - 1 + response_len)) + [0] * response_pad)
        target_rows.append(list(sample.response_ids) + [0] * response_pad)
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    mask = (torch.arange(max_response).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32)
    return MicroBatch(
        indices,
        torch.tensor(input_rows, dtype=torch.long),
        torch.tensor(attention_rows, dtype=torch.long),
        torch.tensor(index_rows, dtype=torch.long),
        torch.tensor(target_rows, dtype=torch.long),
        mask,
    )


@dataclass(frozen=True)
class SharedPromptBatch:
    """Samples packed so that each distinct prompt is run once (a GRPO group shares one).

    The prompts go through the model once each, left-padded, filling a KV cache whose rows
    are then copied to every sample of the prompt; the responses (less their last token)
    run on top of it, right-padded. Gradients reach the prompt positions through the copy
    and add up over the group, as if each sample had run its own prompt.
    """

    indices: list[int]
    prompt_ids: torch.Tensor
    """``[prompts, max_prompt_len]`` distinct prompts, left-padded with 0."""
    prompt_mask: torch.Tensor
    prompt_of_row: torch.Tensor
    """``[batch]``: each sample's row in ``prompt_ids``."""
    response_input: torch.Tensor
    """``[batch, max_response_len - 1]`` response ids less the last, right-padded with 0."""
    response_positions: torch.Tensor
    """``[batch, max_response_len - 1]`` their positions (prompt length + k)."""
    response_input_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def pack_shared_prompts(samples: list[Sample], indices: list[int]) -> SharedPromptBatch:
    for sample in samples:
        if not sample.prompt_ids:
            raise ValueError(f"sample {sample.index} has an empty prompt: nothing predicts its first token")
    distinct: dict[tuple[int, ...], int] = {}
    prompt_of_row = [distinct.setdefault(tuple(s.prompt_ids), len(distinct)) for s in samples]
    width = max(len(prompt) for prompt in distinct)
    max_response = max(len(s.response_ids) for s in samples)
    fed = max(max_response - 1, 0)
    response_rows, position_rows, input_mask_rows, target_rows = [], [], [], []
    for sample in samples:
        response, prompt_len = list(sample.response_ids), len(sample.prompt_ids)
        feed = response[:-1]
        response_rows.append(feed + [0] * (fed - len(feed)))
        position_rows.append([prompt_len + k for k in range(fed)])
        input_mask_rows.append([1] * len(feed) + [0] * (fed - len(feed)))
        target_rows.append(response + [0] * (max_response - len(response)))
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    return SharedPromptBatch(
        indices=indices,
        prompt_ids=torch.tensor([[0] * (width - len(p)) + list(p) for p in distinct], dtype=torch.long),
        prompt_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct], dtype=torch.long),
        prompt_of_row=torch.tensor(prompt_of_row, dtype=torch.long),
        response_input=torch.tensor(response_rows, dtype=torch.long).reshape(len(samples), fed),
        response_positions=torch.tensor(position_rows, dtype=torch.long).reshape(len(samples), fed),
        response_input_mask=torch.tensor(input_mask_rows, dtype=torch.long).reshape(len(samples), fed),
        targets=torch.tensor(target_rows, dtype=torch.long),
        mask=(torch.arange(max_response).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32),
    )


def shares_prompts(samples: list[Sample]) -> bool:
    """Whether running each distinct prompt once saves work: at most half as many prompts as samples."""
    return 2 * len({tuple(s.prompt_ids) for s in samples}) <= len(samples)


def split(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


class TorchTrainerBackend(TrainerBackend):
    """GRPO on a Hugging Face causal LM in this process (CPU, or the current CUDA device)."""

    def __init__(self, config: Config) -> None:
        if config.model.path is None:
            raise ValueError("model.path is unset: the session sets it to the base model before actors start")
        self.config = config
        trainer = config.trainer
        torch.manual_seed(config.run.seed)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = torch_dtype(config.model.dtype)
        self.model = load_model(config.model.path, config.model.dtype, self.device)
        self.model.eval()
        # The weights live in one flat bucket per dtype (each parameter a view), before the
        # optimizer sees them: a publication stages them with one copy per dtype.
        self._buckets = bucket_parameters(self.model, split_tied(self.model.state_dict())[0])
        self.reference: PreTrainedModel | None = None
        if trainer.use_kl_loss:
            # Frozen at the base weights for the whole run, resumed or not.
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=trainer.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            eps=trainer.adam_eps,
            weight_decay=trainer.weight_decay,
        )
        self._num_optimizer_steps = 0

    # --- forward passes ------------------------------------------------------------------

    def _pack(self, samples: list[Sample], indices: list[int]) -> MicroBatch | SharedPromptBatch:
        if (
            self.config.trainer.shared_prompts
            and self.model.config.model_type in PLAIN_HEAD_MODELS
            and shares_prompts(samples)
        ):
            return pack_shared_prompts(samples, indices)
        return pack_samples(samples, indices)

    def _shared_prompt_logits(
        self, body: PreTrainedModel, head: torch.nn.Module, micro: SharedPromptBatch
    ) -> torch.Tensor:
        device = self.device
        prompt_mask = micro.prompt_mask.to(device)
        cache = DynamicCache(config=body.config)
        cache_arg = cache_kwarg(body)
        prompt_hidden = body(
            input_ids=micro.prompt_ids.to(device),
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **{cache_arg: cache},
        ).last_hidden_state
        rows = micro.prompt_of_row.to(device)
        # The last prompt position predicts the first response token (none: no position).
        hidden = prompt_hidden[:, -1:][rows][:, : micro.targets.shape[1]]
        if micro.response_input.shape[1]:
            cache.batch_select_indices(rows)
            response_hidden = body(
                input_ids=micro.response_input.to(device),
                attention_mask=torch.cat([prompt_mask[rows], micro.response_input_mask.to(device)], dim=1),
                position_ids=micro.response_positions.to(device),
                use_cache=True,
                **{cache_arg: cache},
            ).last_hidden_state
            hidden = torch.cat([hidden, response_hidden], dim=1)
        logits: torch.Tensor = head(hidden)
        return logits

    def _response_logits(self, model: PreTrainedModel, micro: MicroBatch | SharedPromptBatch) -> torch.Tensor:
        """``[batch, max_response_len, vocab]``: the logits that predict each response token."""
        if isinstance(micro, SharedPromptBatch):
            return self._shared_prompt_logits(
                getattr(model, model.base_model_prefix), model.get_output_embeddings(), micro
            )
        input_ids = micro.input_ids.to(self.device)
        attention_mask = micro.attention_mask.to(self.device)
        index = micro.logit_index.to(self.device)
        head: torch.nn.Module | None = model.get_output_embeddings()
        body: torch.nn.Module | None = getattr(model, model.base_model_prefix, None)
        if model.config.model_type in PLAIN_HEAD_MODELS and head is not None and body is not None:
            # The head's matmul only where a response token is predicted.
            hidden = body(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state
            logits: torch.Tensor = head(
                hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            )
            return logits
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))

    def _forward(
        self, model: PreTrainedModel, micro: MicroBatch | SharedPromptBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned log-probabilities (and entropies) of ``micro`` under ``model``."""
        logits = self._response_logits(model, micro)
        return logprobs_and_entropy(logits, micro.targets.to(self.device), with_entropy)

    @torch.no_grad()
    def response_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-token log-probabilities of each sample's response under the current weights."""
        micro = self._pack(samples, list(range(len(samples))))
        logp, _ = self._forward(self.model, micro, with_entropy=False)
        return [logp[row, : len(s.response_ids)].cpu() for row, s in enumerate(samples)]

    def probe_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        return teacher_forced_logprobs(self.model, prompt_ids, response_ids)

    def _rollout_logprobs(self, samples: list[Sample], micro: MicroBatch | SharedPromptBatch) -> torch.Tensor:
        old = torch.zeros_like(micro.mask)
        for row, index in enumerate(micro.indices):
            sample = samples[index]
            if len(sample.response_logprobs) != len(sample.response_ids):
                raise ValueError(
                    f"sample {sample.index}: {len(sample.response_logprobs)} rollout logprobs "
                    f"for {len(sample.response_ids)} response tokens"
                )
            old[row, : len(sample.response_ids)] = torch.tensor(sample.response_logprobs)
        return old.to(self.device)

    # --- training ------------------------------------------------------------------------

    def train(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> TrainMetrics:
        trainer = self.config.trainer
        samples = batch.samples
        if not samples:
            return TrainMetrics()
        advantages = group_advantages(
            torch.tensor([s.reward for s in samples], dtype=torch.float32),
            torch.tensor([s.group for s in samples]),
            normalize_std=trainer.normalize_advantage_std,
        ).to(self.device)
        step_size = trainer.global_batch_size or len(samples)
        steps = [
            [self._pack([samples[i] for i in part], part) for part in split(step, trainer.micro_batch_size)]
            for step in split(list(range(len(samples))), step_size)
        ]
        micro_batches = [micro for step in steps for micro in step]

        # Old (and reference) log-probabilities: fixed before the first optimizer step. The
        # first step's old ones are its own forward's (None here), taken as it trains.
        first_step = len(steps[0])
        old_logps: list[torch.Tensor | None] = []
        ref_logps: list[torch.Tensor | None] = []
        with torch.no_grad():
            for position, micro in enumerate(micro_batches):
                if cancel is not None:
                    cancel.check()  # a cancellation point: nothing has changed yet
                if trainer.use_rollout_logprobs:
                    old_logps.append(self._rollout_logprobs(samples, micro))
                elif position < first_step:
                    old_logps.append(None)
                else:
                    old_logps.append(self._forward(self.model, micro, with_entropy=False)[0])
                ref_logps.append(
                    None if self.reference is None else self._forward(self.reference, micro, False)[0]
                )

        totals = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "clipfrac"), 0.0)
        total_tokens = 0
        grad_norm = 0.0
        position = 0
        trained_steps = 0
        for number, step in enumerate(steps, start=1):
            step_tokens = int(sum(int(micro.mask.sum().item()) for micro in step))
            step_totals = dict.fromkeys(totals, 0.0)
            self.optimizer.zero_grad(set_to_none=True)
            for micro in step:
                if cancel is not None and trained_steps == 0:
                    cancel.check()  # before the first optimizer step only
                old_logp, ref_logp = old_logps[position], ref_logps[position]
                position += 1
                mask = micro.mask.to(self.device)
                logp, entropy = self._forward(self.model, micro, with_entropy=True)
                if old_logp is None:
                    old_logp = logp.detach()
                if entropy is not None and not trainer.entropy_coef:
                    entropy = entropy.detach()  # logged only: no backward through the softmax
                terms = policy_loss(
                    logp,
                    old_logp,
                    expand_advantages(advantages[micro.indices], mask),
                    mask,
                    eps_clip=trainer.eps_clip,
                    eps_clip_high=trainer.eps_clip_high,
                    entropy=entropy,
                    entropy_coef=trainer.entropy_coef,
                    ref_logp=ref_logp,
                    kl_coef=trainer.kl_loss_coef if trainer.use_kl_loss else 0.0,
                    kl_type=trainer.kl_loss_type,
                    num_tokens=step_tokens,
                )
                terms.loss.backward()
                # Terms are sums / step_tokens: scale back to sums for the rollout-wide mean.
                weight = max(step_tokens, 1)
                values = torch.stack(
                    [terms.loss.detach(), terms.pg_loss, terms.kl, terms.entropy, terms.clipfrac]
                ).tolist()  # one device-to-host read per micro-batch
                for key, value in zip(step_totals, values, strict=True):
                    step_totals[key] += value * weight
            step_grad_norm = self._clip_gradients()
            if not (math.isfinite(step_grad_norm) and all(math.isfinite(v) for v in step_totals.values())):
                what = (
                    f"rollout {batch.rollout_id}, optimizer step {number} of {len(steps)}: non-finite loss or "
                    f"gradient norm (loss {step_totals['loss'] / max(step_tokens, 1)}, grad norm {step_grad_norm})"
                )
                self.optimizer.zero_grad(set_to_none=True)
                if trainer.on_non_finite == "fail":
                    raise NonFiniteError(f"{what} (trainer.on_non_finite = 'fail')")
                logger.warning(
                    "%s: the step is skipped (trainer.on_non_finite = %r)", what, trainer.on_non_finite
                )
                continue
            self.optimizer.step()
            self._num_optimizer_steps += 1
            trained_steps += 1
            grad_norm = step_grad_norm
            total_tokens += step_tokens
            for key, value in step_totals.items():
                totals[key] += value
        self.optimizer.zero_grad(set_to_none=True)

        denominator = max(total_tokens, 1)
        return TrainMetrics(
            loss=totals["loss"] / denominator,
            pg_loss=totals["pg_loss"] / denominator,
            kl=totals["kl"] / denominator,
            entropy=totals["entropy"] / denominator,
            grad_norm=grad_norm,
            clipfrac=totals["clipfrac"] / denominator,
            train_tokens=total_tokens,
            num_optimizer_steps=trained_steps,
        )

    def _clip_gradients(self) -> float:
        """Clip to ``clip_grad`` (0: no clipping); return the norm before clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.trainer.clip_grad
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return float(norm.item())

    # --- state ---------------------------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        # state_dict() already omits non-persistent buffers (rotary inv_freq and the like);
        # tied duplicates (lm_head sharing the embedding) follow the one rule of rl.weights.
        unique, _tied = split_tied(self.model.state_dict())
        return {name: t.detach() if dtype is None else t.detach().to(dtype) for name, t in unique.items()}

    def weight_buckets(self) -> Buckets:
        return self._buckets

    @property
    def num_optimizer_steps(self) -> int:
        return self._num_optimizer_steps

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        if self.reference is not None:
            copy_weights(self.reference, weights)

    def load_state(
        self,
        weights: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        num_optimizer_steps: int,
    ) -> None:
        copy_weights(self.model, weights)
        self.optimizer.load_state_dict(optimizer)
        restore_rng_state(rng)
        self._num_optimizer_steps = num_optimizer_steps


def copy_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint ``weights`` (Hugging Face names, no tied duplicates needed) into
    ``model``; ``ValueError`` naming what does not fit, before anything is copied."""
    live, _tied = split_tied(model.state_dict())
    # A tied duplicate saved by another writer is harmless: its storage is restored
    # through the name it is tied to.
    known = set(model.state_dict())
    missing, unexpected = sorted(set(live) - set(weights)), sorted(set(weights) - known)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
    for name, tensor in live.items():
        saved = weights[name]
        if saved.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name}: shape {tuple(saved.shape)}, model {tuple(tensor.shape)}"
            )
    with torch.no_grad():
        for name, tensor in live.items():
            tensor.copy_(weights[name])
