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
import dataclasses
import logging
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import DynamicCache, PreTrainedModel

from actors.trainer_backend.base import TrainerBackend, restore_rng_state
from actors.trainer_backend.grpo import (
    expand_advantages,
    group_advantages,
    logprobs_and_entropy,
    policy_loss,
    truncated_importance,
)
from actors.trainer_backend.parallel import Parallel, by_name, local_shard, share
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.device.buckets import Buckets, bucket_parameters
from miles_events.device.offload import (
    HOST,
    HostCopies,
    Measured,
    move_buckets,
    move_loose,
    move_optimizer_state,
)
from miles_events.rl.finite import NonFiniteError
from miles_events.rl.hf_model import cache_kwarg, load_model, torch_dtype
from miles_events.rl.lr_schedule import LrSchedule
from miles_events.rl.probe import teacher_forced_logprobs
from miles_events.rl.weights import split_tied
from schemas.config import Config
from schemas.events import MemoryPart, RankStep, TrainMetrics
from schemas.rollout import RolloutBatch, Sample

logger = logging.getLogger(__name__)

R = TypeVar("R")

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
    mask = response_mask(samples, max_response)
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
    return SharedPromptBatch(
        indices=indices,
        prompt_ids=torch.tensor([[0] * (width - len(p)) + list(p) for p in distinct], dtype=torch.long),
        prompt_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct], dtype=torch.long),
        prompt_of_row=torch.tensor(prompt_of_row, dtype=torch.long),
        response_input=torch.tensor(response_rows, dtype=torch.long).reshape(len(samples), fed),
        response_positions=torch.tensor(position_rows, dtype=torch.long).reshape(len(samples), fed),
        response_input_mask=torch.tensor(input_mask_rows, dtype=torch.long).reshape(len(samples), fed),
        targets=torch.tensor(target_rows, dtype=torch.long),
        mask=response_mask(samples, max_response),
    )


def response_mask(samples: list[Sample], max_response: int) -> torch.Tensor:
    """``[batch, max_response]`` float32: 1.0 for each response token trained on (all of
    them, less those a sample's ``loss_mask`` leaves out), 0.0 elsewhere."""
    lengths = torch.tensor([len(s.response_ids) for s in samples])
    mask = (torch.arange(max_response).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32)
    for row, sample in enumerate(samples):
        if sample.loss_mask:
            mask[row, : len(sample.loss_mask)] = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return mask


def trained_tokens(sample: Sample) -> int:
    """The response tokens of ``sample`` its loss counts."""
    return sum(sample.loss_mask) if sample.loss_mask else len(sample.response_ids)


def shares_prompts(samples: list[Sample]) -> bool:
    """Whether running each distinct prompt once saves work: at most half as many prompts as samples."""
    return 2 * len({tuple(s.prompt_ids) for s in samples}) <= len(samples)


def split(indices: list[int], size: int) -> list[list[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory: CUDA's most allocated on a GPU, else the peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def empty_like(micro: MicroBatch) -> MicroBatch:
    """``micro`` with every token masked: a forward and backward that changes nothing, run by
    a rank with fewer micro-batches in a step than another (every rank runs the same
    collectives)."""
    return dataclasses.replace(micro, mask=torch.zeros_like(micro.mask))


def output_head(model: PreTrainedModel) -> torch.nn.Module | None:
    """The layer that turns the last hidden state into the model's outputs: the LM head of a
    causal LM, the ``score`` layer of a value model (a ``*ForTokenClassification``)."""
    head: torch.nn.Module | None = model.get_output_embeddings()
    if head is None:
        head = getattr(model, "score", None)
    return head


class ResponseLogits(torch.nn.Module):
    """The forward every micro-batch goes through: ``[batch, max_response_len, vocab]``
    logits that predict each response token of a ``MicroBatch``. A module of its own so that
    it can be the root of a sharded model (its hooks gather what no decoder layer owns)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        model = self.model
        head = output_head(model)
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


class TorchTrainerBackend(TrainerBackend):
    """GRPO on a Hugging Face causal LM: in this process (CPU, or the current CUDA device),
    or as one rank of a process group (``parallel``; see ``actors.trainer_backend.parallel``)."""

    def __init__(self, config: Config, parallel: Parallel | None = None) -> None:
        if config.model.path is None:
            raise ValueError("model.path is unset: the session sets it to the base model before actors start")
        self.config = config
        self.parallel = parallel or Parallel()
        trainer = config.trainer
        torch.manual_seed(config.run.seed)
        if self.parallel.group_device is not None:
            self.device = self.parallel.group_device
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.dtype = torch_dtype(config.model.dtype)
        self.model = self._build_model(config.model.path)
        self.model.eval()
        self._shapes, self._tied_names = self._published_shapes()
        self._parameter_names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self._buckets: Buckets | None = None
        if not self.parallel.sharded:
            # The weights live in one flat bucket per dtype (each parameter a view), before the
            # optimizer sees them: a publication stages them with one copy per dtype.
            unique, _ = split_tied(self.model.state_dict())
            self._buckets = bucket_parameters(self.model, unique)
        self.reference: PreTrainedModel | None = None
        self.reference_root: torch.nn.Module | None = None
        if trainer.use_kl_loss and self.has_reference:
            # Frozen at the base weights for the whole run, resumed or not.
            self.reference = self._frozen_copy(self.model)
            self.reference_root = self.parallel.wrap(
                self._logits_module(self.reference), self.reference, trainable=False
            )
        self.root = self.parallel.wrap(self._logits_module(self.model), self.model, trainable=True)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.root.parameters() if p.requires_grad],
            lr=trainer.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            eps=trainer.adam_eps,
            weight_decay=trainer.weight_decay,
        )
        self._num_optimizer_steps = 0
        self.offloaded = False
        self._host_copies = HostCopies()
        """The state's pinned host copies, kept from one offload to the next (on a GPU)."""
        self.lr_schedule = LrSchedule.of(config)
        self._rank_step: RankStep | None = None

    has_reference = True
    """Whether ``trainer.use_kl_loss`` gives this backend a KL reference (the policy's)."""

    def _build_model(self, path: str) -> PreTrainedModel:
        """The model trained, from the Hugging Face directory ``path``, on ``self.device``."""
        return load_model(path, self.config.model.dtype, self.device)

    def _frozen_copy(self, model: Any) -> Any:
        """A copy of ``model`` that does not train (the KL reference, frozen at the base weights)."""
        return copy.deepcopy(model).requires_grad_(False)

    def _published_shapes(self) -> tuple[dict[str, torch.Size], set[str]]:
        """The whole (unsharded) shape of every tensor ``named_weights`` gives, by its Hugging
        Face name; and the names of tensors tied to one of those (an output head sharing the
        embedding), which a checkpoint may hold or not."""
        unique, tied = split_tied(self.model.state_dict())
        return {name: t.shape for name, t in unique.items()}, set(tied)

    def _logits_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The forward every micro-batch goes through, over ``model`` (the policy or the
        reference): ``(input_ids, attention_mask, logit_index)`` to the logits that predict
        each response token."""
        return ResponseLogits(model)  # type: ignore[arg-type]

    # --- forward passes ------------------------------------------------------------------

    def _pack(self, samples: list[Sample], indices: list[int]) -> MicroBatch | SharedPromptBatch:
        if (
            self.config.trainer.shared_prompts
            and not self.parallel.sharded
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

    def _response_logits(self, reference: bool, micro: MicroBatch | SharedPromptBatch) -> torch.Tensor:
        """``[batch, max_response_len, vocab]``: the logits that predict each response token,
        under the policy or (``reference``) the KL reference; their matrix products in
        bfloat16 with ``trainer.autocast``."""
        if self.config.trainer.autocast == "bfloat16":
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self._response_logits_as_is(reference, micro)
        return self._response_logits_as_is(reference, micro)

    def _response_logits_as_is(self, reference: bool, micro: MicroBatch | SharedPromptBatch) -> torch.Tensor:
        if isinstance(micro, SharedPromptBatch):  # one process only (``_pack``)
            model = self.reference if reference else self.model
            assert model is not None
            head = output_head(model)
            assert head is not None
            return self._shared_prompt_logits(getattr(model, model.base_model_prefix), head, micro)
        root = self.reference_root if reference else self.root
        assert root is not None
        logits: torch.Tensor = root(
            micro.input_ids.to(self.device),
            micro.attention_mask.to(self.device),
            micro.logit_index.to(self.device),
        )
        return logits

    def _forward(
        self, micro: MicroBatch | SharedPromptBatch, with_entropy: bool, reference: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-aligned log-probabilities (and entropies) of ``micro`` under the policy
        (or the reference)."""
        logits = self._response_logits(reference, micro)
        return logprobs_and_entropy(logits, micro.targets.to(self.device), with_entropy)

    @torch.no_grad()
    def response_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-token log-probabilities of each sample's response under the current weights."""
        micro = self._pack(samples, list(range(len(samples))))
        logp, _ = self._forward(micro, with_entropy=False)
        return [logp[row, : len(s.response_ids)].cpu() for row, s in enumerate(samples)]

    def probe_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        if not self.parallel.sharded:
            return teacher_forced_logprobs(self.model, prompt_ids, response_ids)
        # Through the sharded root, one sequence at a time as teacher_forced_logprobs runs them.
        results: list[list[float]] = []
        with torch.no_grad():
            for prompt, response in zip(prompt_ids, response_ids, strict=True):
                ids = (list(prompt) + list(response))[:-1]
                index = list(range(len(prompt) - 1, len(prompt) - 1 + len(response)))
                logits = self.root(
                    torch.tensor([ids], device=self.device),
                    torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                    torch.tensor([index], device=self.device),
                )[0].float()
                picked = torch.log_softmax(logits, dim=-1).gather(
                    1, torch.tensor(list(response), device=self.device).unsqueeze(1)
                )
                results.append([float(v) for v in picked.squeeze(1).tolist()])
        return results

    def _rollout_logprobs(self, samples: list[Sample], micro: MicroBatch | SharedPromptBatch) -> torch.Tensor:
        return self._per_token(samples, micro, "response_logprobs", "rollout logprobs")

    def _per_token(
        self, samples: list[Sample], micro: MicroBatch | SharedPromptBatch, field: str, what: str
    ) -> torch.Tensor:
        """``[batch, max_response_len]``: each sample's per-token ``field``, response-aligned."""
        out = torch.zeros_like(micro.mask)
        for row, index in enumerate(micro.indices):
            sample = samples[index]
            values = getattr(sample, field)
            if len(values) != len(sample.response_ids):
                raise ValueError(
                    f"sample {sample.index}: {len(values)} {what} for {len(sample.response_ids)} response tokens"
                )
            out[row, : len(sample.response_ids)] = torch.tensor(values, dtype=out.dtype)
        return out.to(self.device)

    # --- training ------------------------------------------------------------------------

    def _micro_batches(self, samples: list[Sample], step: list[int]) -> list[MicroBatch | SharedPromptBatch]:
        """This rank's micro-batches of optimizer step ``step`` (sample positions): its part of
        the step cut into ``micro_batch_size``, then empty ones up to the count of the rank
        with the most."""
        size = self.config.trainer.micro_batch_size
        parallel = self.parallel
        micros = [self._pack([samples[i] for i in part], part) for part in split(parallel.share(step), size)]
        most = max(
            -(-len(share(step, rank, parallel.world_size)) // size) for rank in range(parallel.world_size)
        )
        while len(micros) < most:
            micros.append(empty_like(pack_samples([samples[step[0]]], step[:1])))
        return micros

    def _check_cancel(self, cancel: Cancellation | None) -> None:
        """A cancellation point every rank passes together: one cancels, all leave."""
        if cancel is None:
            return
        if not self.parallel.sharded:
            cancel.check()
        elif self.parallel.any(cancel.cancelled):
            raise Cancelled(cancel.reason or "another trainer rank was cancelled")

    def train(self, batch: RolloutBatch, cancel: Cancellation | None = None) -> TrainMetrics:
        self._require_onloaded("train")
        return self._reported(lambda: self._train(batch, cancel))

    def _require_onloaded(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"the trainer cannot {what} while offloaded: onload it first")

    def _reported(self, train: Callable[[], R]) -> R:
        """``train()``, what it took on this rank kept for ``rank_steps``."""
        started = time.perf_counter()
        result = train()
        self._rank_step = RankStep(
            rank=self.parallel.rank,
            pid=os.getpid(),
            step_seconds=time.perf_counter() - started,
            peak_memory_bytes=peak_memory_bytes(self.device),
            state_bytes=self.state_bytes(),
        )
        return result

    def rank_steps(self) -> list[RankStep]:
        return [] if self._rank_step is None else [self._rank_step]

    def _train(self, batch: RolloutBatch, cancel: Cancellation | None) -> TrainMetrics:
        trainer = self.config.trainer
        samples = batch.samples
        if not samples:
            return TrainMetrics()
        # Given per token (PPO: the GAE of the critic's values), or GRPO's over the whole
        # rollout, on every rank, before it is split.
        per_token = any(s.advantages for s in samples)
        advantages = group_advantages(
            torch.tensor([s.reward for s in samples], dtype=torch.float32),
            torch.tensor([s.group for s in samples]),
            normalize_std=trainer.normalize_advantage_std,
        ).to(self.device)
        step_size = trainer.global_batch_size or len(samples)
        step_indices = split(list(range(len(samples))), step_size)
        steps = [self._micro_batches(samples, step) for step in step_indices]
        micro_batches = [micro for step in steps for micro in step]
        # Both FSDP2 and DDP average the ranks' gradients; each rank's loss is its part of
        # the step's sum: scaled by the rank count, the average is that sum.
        loss_scale = float(self.parallel.world_size)

        # Old (and reference) log-probabilities: fixed before the first optimizer step. The
        # first step's old ones are its own forward's (None here), taken as it trains.
        first_step = len(steps[0])
        old_logps: list[torch.Tensor | None] = []
        ref_logps: list[torch.Tensor | None] = []
        rollout_logps: list[torch.Tensor | None] = []
        with torch.no_grad():
            for position, micro in enumerate(micro_batches):
                self._check_cancel(cancel)  # a cancellation point: nothing has changed yet
                rollout_logps.append(
                    None if trainer.rollout_is_cap is None else self._rollout_logprobs(samples, micro)
                )
                if trainer.use_rollout_logprobs:
                    old_logps.append(self._rollout_logprobs(samples, micro))
                elif position < first_step:
                    old_logps.append(None)
                else:
                    old_logps.append(self._forward(micro, with_entropy=False)[0])
                ref_logps.append(
                    None if self.reference is None else self._forward(micro, False, reference=True)[0]
                )

        totals = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "clipfrac", "importance"), 0.0)
        total_tokens = 0
        grad_norm = 0.0
        lr = self.lr_schedule.lr_at(self._num_optimizer_steps)
        position = 0
        trained_steps = 0
        for number, (step, indices) in enumerate(zip(steps, step_indices, strict=True), start=1):
            # The whole step's tokens, every rank's part: each rank knows the whole rollout.
            step_tokens = sum(trained_tokens(samples[i]) for i in indices)
            step_totals = dict.fromkeys(totals, 0.0)
            self.optimizer.zero_grad(set_to_none=True)
            for count, micro in enumerate(step, start=1):
                if trained_steps == 0:
                    self._check_cancel(cancel)  # before the first optimizer step only
                old_logp, ref_logp, rollout_logp = (
                    old_logps[position],
                    ref_logps[position],
                    rollout_logps[position],
                )
                position += 1
                mask = micro.mask.to(self.device)
                with self.parallel.no_sync(self.root, last=count == len(step)):
                    logp, entropy = self._forward(micro, with_entropy=True)
                    if old_logp is None:
                        old_logp = logp.detach()
                    importance = None
                    if rollout_logp is not None and trainer.rollout_is_cap is not None:
                        importance = truncated_importance(old_logp, rollout_logp, trainer.rollout_is_cap)
                    if entropy is not None and not trainer.entropy_coef:
                        entropy = entropy.detach()  # logged only: no backward through the softmax
                    terms = policy_loss(
                        logp,
                        old_logp,
                        self._per_token(samples, micro, "advantages", "advantages") * mask
                        if per_token
                        else expand_advantages(advantages[micro.indices], mask),
                        mask,
                        eps_clip=trainer.eps_clip,
                        eps_clip_high=trainer.eps_clip_high,
                        entropy=entropy,
                        entropy_coef=trainer.entropy_coef,
                        ref_logp=ref_logp,
                        kl_coef=trainer.kl_loss_coef if trainer.use_kl_loss else 0.0,
                        kl_type=trainer.kl_loss_type,
                        num_tokens=step_tokens,
                        importance=importance,
                    )
                    (terms.loss * loss_scale if self.parallel.sharded else terms.loss).backward()
                # Terms are sums / step_tokens: scale back to sums for the rollout-wide mean.
                weight = max(step_tokens, 1)
                weighted = (
                    (importance * mask).sum() / max(step_tokens, 1)
                    if importance is not None
                    else terms.kl.new_zeros(())
                )
                values = torch.stack(
                    [terms.loss.detach(), terms.pg_loss, terms.kl, terms.entropy, terms.clipfrac, weighted]
                ).tolist()  # one device-to-host read per micro-batch
                for key, value in zip(step_totals, values, strict=True):
                    step_totals[key] += value * weight
            stepped = self._optimizer_step(
                step_totals,
                f"rollout {batch.rollout_id}, optimizer step {number} of {len(steps)}",
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
        return TrainMetrics(
            loss=totals["loss"] / denominator,
            pg_loss=totals["pg_loss"] / denominator,
            kl=totals["kl"] / denominator,
            entropy=totals["entropy"] / denominator,
            grad_norm=grad_norm,
            clipfrac=totals["clipfrac"] / denominator,
            importance_weight=totals["importance"] / denominator,
            train_tokens=total_tokens,
            num_optimizer_steps=trained_steps,
            lr=lr,
        )

    def _optimizer_step(
        self, step_totals: dict[str, float], where: str, step_tokens: int
    ) -> tuple[dict[str, float], float, float] | None:
        """End an optimizer step whose gradients are in: its totals (sums over its
        ``step_tokens`` tokens, the loss first) summed over the ranks, the gradients clipped,
        the optimizer stepped at the schedule's rate. Returns (totals, gradient norm,
        learning rate), or None when a total or the norm is not finite: the step is then
        skipped, or ``NonFiniteError`` raised naming it (``where``), as
        ``trainer.on_non_finite`` says."""
        totals = dict(zip(step_totals, self.parallel.sum(list(step_totals.values())), strict=True))
        grad_norm = self._clip_gradients()
        if not (math.isfinite(grad_norm) and all(math.isfinite(v) for v in totals.values())):
            loss_key = next(iter(totals))
            what = (
                f"{where}: non-finite loss or gradient norm ({loss_key} {totals[loss_key] / max(step_tokens, 1)}, "
                f"grad norm {grad_norm})"
            )
            self.optimizer.zero_grad(set_to_none=True)
            policy = self.config.trainer.on_non_finite
            if policy == "fail":
                raise NonFiniteError(f"{what} (trainer.on_non_finite = 'fail')")
            logger.warning("%s: the step is skipped (trainer.on_non_finite = %r)", what, policy)
            return None
        lr = self.lr_schedule.lr_at(self._num_optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._num_optimizer_steps += 1
        return totals, grad_norm, lr

    def _clip_gradients(self) -> float:
        """Clip to ``clip_grad`` (0: no clipping); return the global norm before clipping."""
        params = [p for p in self.root.parameters() if p.grad is not None]
        if not params and not self.parallel.sharded:
            return 0.0
        max_norm = self.config.trainer.clip_grad
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        full_tensor = getattr(norm, "full_tensor", None)  # a sharded norm (FSDP2): reduced over the ranks
        return float((full_tensor() if full_tensor is not None else norm).item())

    # --- state ---------------------------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        # state_dict() already omits non-persistent buffers (rotary inv_freq and the like);
        # tied duplicates (lm_head sharing the embedding) follow the one rule of rl.weights,
        # applied at start (once gathered from shards, a tie is no longer shared storage).
        # Sharded, they are gathered whole on rank 0 (empty on the others).
        unique = {
            n: t for n, t in self.parallel.full_weights(self.model).items() if n not in self._tied_names
        }
        return {name: t.detach() if dtype is None else t.detach().to(dtype) for name, t in unique.items()}

    def weight_buckets(self) -> Buckets | None:
        return self._buckets

    def state_bytes(self) -> int:
        """Bytes of the parameters, gradients and optimizer state this rank holds (its shard)."""
        parameters = list(self.root.parameters())
        tensors = [
            *parameters,
            *(p.grad for p in parameters if p.grad is not None),
            *(
                v
                for state in self.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ),
        ]
        return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)

    @property
    def num_optimizer_steps(self) -> int:
        return self._num_optimizer_steps

    def optimizer_state_dict(self) -> dict[str, Any]:
        # Keyed by parameter name: a checkpoint any number of ranks loads.
        return self.parallel.optimizer_state(self.model, self.optimizer, self._parameter_names)

    # --- offload and onload ----------------------------------------------------------------

    def offload(self) -> list[MemoryPart]:
        with Measured(f"rank-{self.parallel.rank}", self.device) as measure:
            moved = self._move_state(torch.device(HOST)) if not self.offloaded else 0
            self.offloaded = True
        return [measure.part(moved)]

    def onload(self) -> list[MemoryPart]:
        with Measured(f"rank-{self.parallel.rank}", self.device) as measure:
            moved = self._move_state(self.device) if self.offloaded else 0
            self.offloaded = False
        return [measure.part(moved)]

    def _move_state(self, device: torch.device) -> int:
        """The weights (bucket by bucket where they live in buckets), the optimizer's state
        and the KL reference to ``device``; gradients, recomputed every step, are dropped.
        Sharded over a process group on the CPU, nothing moves (there is no device memory
        to release); on GPUs the wrapped module moves as a whole."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.parallel.sharded:
            if self.device.type == HOST:
                return 0
            moved = 0
            for module in (self.root, self.reference_root):
                if module is not None:
                    module.to(device)
                    moved += sum(
                        local_shard(p).numel() * local_shard(p).element_size() for p in module.parameters()
                    )
            return moved + move_optimizer_state(self.optimizer, device, self._host_copies)
        moved, copies = 0, self._host_copies
        if self._buckets is not None:
            moved += self._buckets.num_bytes
            self._buckets = move_buckets(self.model.state_dict(keep_vars=True), self._buckets, device, copies)
        if self.reference is not None:
            moved += move_loose(self.reference.parameters(), device, copies)
        return moved + move_optimizer_state(self.optimizer, device, copies)

    def clear_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Checkpoint ``weights`` (Hugging Face names, no tied duplicates needed) into the
        policy or the reference: checked where they are given (rank 0) before anything is
        copied, ``ValueError`` naming what does not fit."""
        if self.parallel.rank == 0:
            check_fits(self._shapes, self._shapes.keys() | self._tied_names, weights)
        self.parallel.load_full_weights(model, weights)

    def load_reference(self, weights: dict[str, torch.Tensor]) -> None:
        if self.reference is not None:
            self._load_weights(self.reference, weights)

    def load_state(
        self,
        weights: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        num_optimizer_steps: int,
    ) -> None:
        self._load_weights(self.model, weights)
        state = by_name(optimizer, self._parameter_names) if optimizer else optimizer
        self.parallel.load_optimizer_state(self.model, self.optimizer, state, self._parameter_names)
        restore_rng_state(rng)
        self._num_optimizer_steps = num_optimizer_steps


def check_fits(shapes: dict[str, torch.Size], known: set[str], weights: dict[str, torch.Tensor]) -> None:
    """``ValueError`` naming what of checkpoint ``weights`` does not fit a model whose tensors
    (tied duplicates left out) have ``shapes``, and whose state dict names ``known``."""
    # A tied duplicate saved by another writer is harmless: its storage is restored
    # through the name it is tied to.
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - known)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
    for name, shape in shapes.items():
        saved = weights[name]
        if saved.shape != shape:
            raise ValueError(f"checkpoint tensor {name}: shape {tuple(saved.shape)}, model {tuple(shape)}")
