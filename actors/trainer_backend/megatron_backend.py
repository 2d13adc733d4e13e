"""The Megatron-core trainer backend: Megatron's GPT model trained as the torch backend trains.

The model is Megatron-core's ``GPTModel`` (``megatron_model``), built from the run's Hugging
Face checkpoint and loaded through ``megatron_convert``; everything else is the torch
backend's (``TorchTrainerBackend``, which this subclasses): the GRPO and PPO losses, the
micro-batches and optimizer steps, cancellation, the learning-rate schedule, non-finite
handling, AdamW. Its ranks are the torch backend's rank group (``rank_group.TrainerRank``):
each rank a process in one ``torch.distributed`` group (NCCL on GPUs, gloo on the CPU),
with Megatron's parallel state initialised over it (``MegatronGroup``). The ranks are
data-parallel replicas (``megatron.tensor_parallel_size`` and ``pipeline_parallel_size``
are 1): each trains its part of every optimizer step, and their gradients are all-reduced
(torch's DistributedDataParallel).

What leaves the backend is in Hugging Face's names and order: publications (so engines,
the Verifier and rollout-only runs see what the torch backend would give them) and the
weights of a checkpoint, and its optimizer state: AdamW's moments of Megatron's fused
parameters split as the weights are (the state is elementwise, so exactly), keyed by Hugging
Face names as the torch backend keys them. A checkpoint of either backend, and of either
layer spec, resumes on the other.
"""

from __future__ import annotations

from typing import Any

import torch

from actors.trainer_backend.megatron_convert import (
    MegatronLayout,
    optimizer_to_hf,
    optimizer_to_megatron,
    to_hf,
    to_megatron,
)
from actors.trainer_backend.megatron_model import (
    ResponseLogits,
    build_gpt,
    destroy_parallel,
    initialize_parallel,
    load_megatron_state,
    megatron_state,
    resolved_impl,
)
from actors.trainer_backend.parallel import Parallel, ProcessGroup, by_name
from actors.trainer_backend.torch_backend import (
    MicroBatch,
    SharedPromptBatch,
    TorchTrainerBackend,
    check_fits,
    pack_samples,
)
from miles_events.rl.hf_model import load_model
from schemas.config import Config
from schemas.rollout import Sample


class MegatronGroup(ProcessGroup):
    """A rank of the trainer's process group with Megatron's parallel state over it."""

    def __init__(
        self,
        config: Config,
        rank: int,
        store_address: tuple[str, int],
        device: torch.device,
        rendezvous_seconds: float | None = None,
    ) -> None:
        trainer, megatron = config.trainer, config.megatron
        super().__init__(
            "ddp",
            rank,
            trainer.num_ranks,
            store_address,
            trainer.collective_timeout,
            device,
            rendezvous_seconds,
        )
        try:
            initialize_parallel(
                megatron.tensor_parallel_size,
                megatron.pipeline_parallel_size,
                config.run.seed,
                trainer.collective_timeout,
            )
        except BaseException:
            super().close()
            raise

    def close(self) -> None:
        destroy_parallel()
        super().close()


class MegatronTrainerBackend(TorchTrainerBackend):
    """GRPO (or PPO's policy loss) on Megatron-core's GPT model, as one rank of a
    ``MegatronGroup``."""

    def __init__(self, config: Config, parallel: Parallel | None = None) -> None:
        if not isinstance(parallel, MegatronGroup):
            raise ValueError(
                "the Megatron backend runs as a rank group (MegatronGroup): build it through TrainerRank"
            )
        self.layout: MegatronLayout | None = None
        self._hf_order: list[str] = []
        self._impl = resolved_impl(config.megatron.transformer_impl)
        super().__init__(config, parallel)

    def _build_model(self, path: str) -> Any:
        # The Hugging Face model is read once, on the host, and converted.
        hf = load_model(path, self.config.model.dtype, torch.device("cpu"))
        # Transformer Engine's spec folds each norm into the linear layer after it.
        layout = MegatronLayout.of(hf.config, fused_norms=self._impl == "transformer_engine")
        weights = hf.state_dict()
        self.layout = layout
        self._hf_order = [n for n in weights if not (layout.tied_embeddings and n == "lm_head.weight")]
        model = build_gpt(layout, self.dtype, self.device, self._impl)
        load_megatron_state(model, to_megatron(weights, layout))
        del hf, weights
        return model

    def _frozen_copy(self, model: Any) -> Any:
        # A Megatron module holds process groups, which do not copy: built again, loaded the same.
        copy = build_gpt(self._layout, self.dtype, self.device, self._impl)
        load_megatron_state(copy, megatron_state(model))
        return copy.eval().requires_grad_(False)

    def _published_shapes(self) -> tuple[dict[str, torch.Size], set[str]]:
        layout = self._layout
        shapes = layout.hf_shapes()
        return {name: torch.Size(shapes[name]) for name in self._hf_order}, (
            {"lm_head.weight"} if layout.tied_embeddings else set()
        )

    def _logits_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return ResponseLogits(model)

    @property
    def _layout(self) -> MegatronLayout:
        assert self.layout is not None, "the model is built"
        return self.layout

    def _pack(self, samples: list[Sample], indices: list[int]) -> MicroBatch | SharedPromptBatch:
        return pack_samples(samples, indices)

    # --- state ---------------------------------------------------------------------------

    def named_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        # Every rank holds the whole model: rank 0 gives it (the others nothing, as sharded
        # torch backends do).
        if self.parallel.rank != 0:
            return {}
        hf = to_hf(megatron_state(self.model), self._layout)
        return {
            name: hf[name].detach() if dtype is None else hf[name].detach().to(dtype)
            for name in self._hf_order
        }

    def optimizer_state_dict(self) -> dict[str, Any]:
        # Keyed by Hugging Face names, as the torch backend's: a checkpoint of either backend
        # (and of either layer spec) resumes on the other.
        state = super().optimizer_state_dict()
        return optimizer_to_hf(state, self._layout) if state else state

    def load_state(
        self,
        weights: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        rng: dict[str, Any],
        num_optimizer_steps: int,
    ) -> None:
        if optimizer:
            # Keyed by index (checkpoints of the torch backend written before it keyed them by
            # name): Hugging Face's parameter order.
            named = by_name(optimizer, self._hf_order)
            optimizer = optimizer_to_megatron(named, self._layout)
        super().load_state(weights, optimizer, rng, num_optimizer_steps)

    def _load_weights(self, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
        """Hugging Face ``weights`` (rank 0's; the others are handed none) into ``model`` on
        every rank: converted and copied on rank 0, then broadcast."""
        import torch.distributed as dist

        if self.parallel.rank == 0:
            check_fits(self._shapes, self._shapes.keys() | self._tied_names, weights)
            load_megatron_state(model, to_megatron(weights, self._layout))
        if self.parallel.world_size > 1:
            for tensor in megatron_state(model).values():
                dist.broadcast(tensor.data, src=0)
