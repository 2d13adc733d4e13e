"""Megatron-core's GPT model for a Hugging Face Llama or Qwen2 checkpoint, and its forward.

``build_gpt`` makes a ``GPTModel`` of the layout ``megatron_convert`` reads from the
Hugging Face config: RMSNorm, SwiGLU, grouped-query attention with rotary embeddings
(Llama 3's scaling where the config has it), query/key/value biases for Qwen2, tied or
untied output layer, and, as Hugging Face's embedding has it, no gradient for the padding
token's row. The layer spec is Transformer Engine's where it is installed
(``megatron.transformer_impl``), else Megatron's local one (its own attention, torch norms).
No fusion that needs Apex or compiled kernels is on, and nothing drops out.

``ResponseLogits`` runs the model as the torch backend's forward does: right-padded
sequences under a causal mask (padding comes after every real token, so no real token
attends to it), the output layer applied only at the positions that predict a response
token.

Megatron-core is written for CUDA; its layers compute on the CPU as well, but a few of its
calls name the CUDA device outright. In a process that has no CUDA device (where such a call
would fail anyway) ``use_host`` makes the current CUDA device read as the CPU, and
``initialize_parallel`` installs a tensor-parallel RNG tracker over the CPU generator. That
is what lets the Megatron backend be tested on machines with no GPU.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch

from actors.trainer_backend.megatron_convert import MegatronLayout

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

TransformerImpl = Literal["auto", "local", "transformer_engine"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The name under which Megatron's tensor-parallel layers fork their RNG."""

RNG_SEED_OFFSET = 2718
"""Megatron's offset of the tensor-parallel seed from the run's (``model_parallel_cuda_manual_seed``)."""


def has_transformer_engine() -> bool:
    """Whether Transformer Engine's PyTorch layers import here."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # not installed, or installed without its CUDA libraries
        return False
    return True


def resolved_impl(impl: TransformerImpl) -> Literal["local", "transformer_engine"]:
    """``auto``: Transformer Engine's layer spec where it is installed and a GPU is there,
    else the local one."""
    if impl == "auto":
        return "transformer_engine" if torch.cuda.is_available() and has_transformer_engine() else "local"
    return impl


def initialize_parallel(
    tensor_parallel: int, pipeline_parallel: int, seed: int, timeout_seconds: float
) -> None:
    """Megatron's parallel state over the process group this process has joined (any state a
    group before it left is dropped first), its collectives bounded by ``timeout_seconds``,
    and its RNG tracker seeded as ``model_parallel_cuda_manual_seed`` seeds it (on the CPU, a
    tracker of CPU generator states)."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mp_tensor_parallel

    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_parallel,
        pipeline_parallel,
        distributed_timeout_minutes=max(1, math.ceil(timeout_seconds / 60)),
        create_gloo_process_groups=False,
    )
    if torch.cuda.is_available():
        mp_tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return
    use_host()
    from megatron.core.tensor_parallel import random as mp_random

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mp_random._CUDA_RNG_STATE_TRACKER = host_rng_tracker(seed + RNG_SEED_OFFSET + tp_rank)
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def use_host() -> None:
    """In a process with no CUDA device: Megatron's calls of ``torch.cuda.current_device()``
    (which would fail) name the CPU instead (``initialize_parallel`` then installs a tracker
    of CPU RNG states)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = _host_device  # type: ignore[assignment]


def _host_device() -> str:
    return "cpu"


def host_rng_tracker(seed: int) -> Any:
    """Megatron's RNG tracker over the CPU generator, its tensor-parallel state seeded with
    ``seed``: ``fork`` runs its block on the named state and keeps where that state got to."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class HostRngTracker(CudaRNGStatesTracker):  # type: ignore[misc]
        def add(self, name: str, seed: int) -> None:
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"no RNG state {name!r} was added")
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    tracker = HostRngTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed)
    return tracker


def transformer_config(layout: MegatronLayout, dtype: torch.dtype, on_cpu: bool) -> Any:
    """The ``TransformerConfig`` of ``layout``, its parameters in ``dtype``."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.kv_channels,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=layout.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt(
    layout: MegatronLayout,
    dtype: torch.dtype,
    device: torch.device,
    impl: Literal["local", "transformer_engine"],
) -> GPTModel:
    """An uninitialised ``GPTModel`` of ``layout`` on ``device`` (load its weights next)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    on_cpu = device.type == "cpu"
    # The final norm named outright: left to the layer spec, megatron-core picks it by what
    # imports (Transformer Engine, else Apex, whose fused norm is LayerNorm only).
    norm: type
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        layer, norm = get_gpt_layer_with_transformer_engine_spec(), TENorm
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        layer, norm = get_gpt_layer_local_spec(normalization="RMSNorm"), WrappedTorchNorm
    spec = TransformerBlockSubmodules(layer_specs=[layer] * layout.num_layers, layer_norm=norm)
    scaling = layout.rope_scaling_factor
    model = GPTModel(
        config=transformer_config(layout, dtype, on_cpu),
        transformer_layer_spec=spec,
        vocab_size=layout.vocab_size,
        max_sequence_length=layout.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(layout.rotary_base) if layout.rotary_base.is_integer() else layout.rotary_base,
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling if scaling is not None else 8.0,
    )
    # Every tensor in ``dtype``: torch's norms keep float32 weights otherwise (and then run
    # unfused beside bfloat16 activations).
    model = model.to(device=device, dtype=dtype)
    if layout.padding_idx is not None:
        model.embedding.word_embeddings.register_forward_hook(_padding_without_gradient(layout.padding_idx))
    return model


def _padding_without_gradient(padding_idx: int) -> Any:
    """A forward hook on the embedding: as Hugging Face's ``padding_idx``, the rows looked up
    for the padding token pass no gradient back to the embedding (a tied output layer's
    gradient to that row stays)."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        padding = (args[0] == padding_idx).unsqueeze(-1)
        return torch.where(padding, output.detach(), output)

    return hook


def megatron_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by name, less Megatron's ``_extra_state`` entries (none of them a
    tensor in the layers used here)."""
    return {n: t for n, t in model.state_dict().items() if not n.endswith("._extra_state")}


def load_megatron_state(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (``megatron_state``'s names) into ``model``, every tensor of it given."""
    own = megatron_state(model)
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"Megatron weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            given = weights[name]
            if given.shape != tensor.shape:
                raise ValueError(
                    f"Megatron tensor {name}: shape {tuple(given.shape)}, model {tuple(tensor.shape)}"
                )
            tensor.copy_(given)


class ResponseLogits(torch.nn.Module):
    """``[batch, max_response_len, vocab]`` logits that predict each response token of a
    right-padded batch (``torch_backend.MicroBatch``): the model's embedding, decoder and
    final norm over the whole sequences, the output layer only at the positions ``index``
    names."""

    def __init__(self, model: GPTModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        model = self.model
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        # True where attention is masked: every later position (padding only follows).
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)
        hidden = model.embedding(input_ids=input_ids, position_ids=positions)  # [sequence, batch, hidden]
        hidden = model.decoder(
            hidden_states=hidden,
            attention_mask=causal.view(1, 1, length, length),
            rotary_pos_emb=model.rotary_pos_emb(length),
        )
        picked = hidden.transpose(0, 1).gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        weight = (
            model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        )
        logits, _ = model.output_layer(picked.transpose(0, 1).contiguous(), weight=weight)
        out: torch.Tensor = logits.transpose(0, 1)
        return out
