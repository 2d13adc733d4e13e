"""Hugging Face <-> Megatron-core weights for the Llama and Qwen2 families, both ways.

Megatron's GPT layers fuse what Hugging Face keeps apart:

- attention's query, key and value projections are one ``linear_qkv``, whose rows go by
  query group: for each key/value head ``g``, the rows of the query heads that share it,
  then its key rows, then its value rows (biases alike, Qwen2's);
- the MLP's gate and up projections are one ``linear_fc1``, gate rows first (Megatron's
  SwiGLU applies the activation to the first half);
- with Transformer Engine's layer spec the norm before each of them is part of the fused
  linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); with the
  local spec it is a module of its own (``input_layernorm``, ``pre_mlp_layernorm``).

Rotary embeddings need no permutation: both sides rotate halves (``rotate_half``). Tied
embeddings have no ``output_layer.weight`` on the Megatron side and no ``lm_head.weight``
on the Hugging Face side. Every tensor is moved, cut or concatenated, never computed:
a round trip is bitwise.

Nothing here imports megatron-core; ``megatron_model`` builds the model these names fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FAMILIES = ("llama", "qwen2")
"""Hugging Face ``model_type`` values converted."""

LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama 3 RoPE scaling Megatron's ``rope_scaling`` applies: only its factor is a parameter."""


@dataclass(frozen=True)
class MegatronLayout:
    """What of a Hugging Face config decides the Megatron model and its tensors' names."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    """The head dimension."""
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling_factor: float | None
    """Llama 3's RoPE scaling factor, None without scaling."""
    tied_embeddings: bool
    qkv_bias: bool
    padding_idx: int | None = None
    """The token whose embedding row Hugging Face's model never trains (its
    ``pad_token_id``: ``nn.Embedding``'s ``padding_idx``); None: every row trains."""
    fused_norms: bool = False
    """Transformer Engine's layer spec: each norm is part of the linear after it."""

    @classmethod
    def of(cls, hf_config: Any, fused_norms: bool = False) -> MegatronLayout:
        """The layout of a Hugging Face ``PretrainedConfig`` (or its ``to_dict()``);
        ``ValueError`` naming what Megatron's GPT model cannot express."""
        c = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        model_type = c.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"model type {model_type!r} has no Megatron conversion; converted: {', '.join(FAMILIES)}"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r}: Megatron's SwiGLU needs 'silu'")
        if c.get("mlp_bias"):
            raise ValueError(
                "mlp_bias: the MLP projections have biases, which this conversion does not carry"
            )
        if model_type == "qwen2" and c.get("use_sliding_window"):
            raise ValueError("use_sliding_window: Megatron's GPT attention here is full attention")
        heads = int(c["num_attention_heads"])
        groups = int(c.get("num_key_value_heads") or heads)
        if heads % groups:
            raise ValueError(f"num_key_value_heads {groups} does not divide num_attention_heads {heads}")
        head_dim = c.get("head_dim") or int(c["hidden_size"]) // heads
        # transformers 5 keeps RoPE's settings in ``rope_parameters``; earlier versions in
        # ``rope_theta`` and ``rope_scaling``.
        rope = c.get("rope_parameters") or {
            **(c.get("rope_scaling") or {}),
            "rope_theta": c.get("rope_theta", 10000.0),
        }
        qkv_bias = model_type == "qwen2" or bool(c.get("attention_bias"))
        if model_type == "llama" and c.get("attention_bias"):
            raise ValueError(
                "attention_bias: Llama's output projection then has a bias, which Megatron's has not"
            )
        return cls(
            model_type=str(model_type),
            num_layers=int(c["num_hidden_layers"]),
            hidden_size=int(c["hidden_size"]),
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=int(head_dim),
            ffn_hidden_size=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            max_position_embeddings=int(c["max_position_embeddings"]),
            norm_epsilon=float(c.get("rms_norm_eps", 1e-6)),
            rotary_base=float(rope.get("rope_theta", 10000.0)),
            rope_scaling_factor=_rope_scaling(rope),
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            padding_idx=None if c.get("pad_token_id") is None else int(c["pad_token_id"]),
            fused_norms=fused_norms,
        )

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor the conversion gives (tied duplicates left out), with its
        shape, in Hugging Face's order."""
        meta = {name: torch.empty(shape, device="meta") for name, shape in self.megatron_shapes().items()}
        return {name: tuple(t.shape) for name, t in to_hf(meta, self).items()}

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the Megatron model under its name, with its shape."""
        hidden, head, groups = self.hidden_size, self.kv_channels, self.num_query_groups
        qkv_rows = (self.num_attention_heads + 2 * groups) * head
        shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (self.vocab_size, hidden)}
        for i in range(self.num_layers):
            layer = f"decoder.layers.{i}"
            shapes[_attention_norm(layer, self.fused_norms)] = (hidden,)
            shapes[f"{layer}.self_attention.linear_qkv.weight"] = (qkv_rows, hidden)
            if self.qkv_bias:
                shapes[f"{layer}.self_attention.linear_qkv.bias"] = (qkv_rows,)
            shapes[f"{layer}.self_attention.linear_proj.weight"] = (hidden, self.num_attention_heads * head)
            shapes[_mlp_norm(layer, self.fused_norms)] = (hidden,)
            shapes[f"{layer}.mlp.linear_fc1.weight"] = (2 * self.ffn_hidden_size, hidden)
            shapes[f"{layer}.mlp.linear_fc2.weight"] = (hidden, self.ffn_hidden_size)
        shapes["decoder.final_layernorm.weight"] = (hidden,)
        if not self.tied_embeddings:
            shapes["output_layer.weight"] = (self.vocab_size, hidden)
        return shapes


def _rope_scaling(scaling: Mapping[str, Any]) -> float | None:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r}: Megatron's GPT model applies only Llama 3's")
    for key, value in LLAMA3_ROPE.items():
        if not math.isclose(float(scaling.get(key, value)), value):
            raise ValueError(f"rope_scaling {key} {scaling[key]}: Megatron's Llama 3 scaling has {value}")
    return float(scaling["factor"])


def _attention_norm(layer: str, fused: bool) -> str:
    return (
        f"{layer}.self_attention.linear_qkv.layer_norm_weight" if fused else f"{layer}.input_layernorm.weight"
    )


def _mlp_norm(layer: str, fused: bool) -> str:
    return f"{layer}.mlp.linear_fc1.layer_norm_weight" if fused else f"{layer}.pre_mlp_layernorm.weight"


def _renames(layout: MegatronLayout) -> dict[str, str]:
    """Megatron name -> Hugging Face name of every tensor that moves unchanged."""
    names = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    if not layout.tied_embeddings:
        names["output_layer.weight"] = "lm_head.weight"
    for i in range(layout.num_layers):
        layer, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        names[_attention_norm(layer, layout.fused_norms)] = f"{hf}.input_layernorm.weight"
        names[f"{layer}.self_attention.linear_proj.weight"] = f"{hf}.self_attn.o_proj.weight"
        names[_mlp_norm(layer, layout.fused_norms)] = f"{hf}.post_attention_layernorm.weight"
        names[f"{layer}.mlp.linear_fc2.weight"] = f"{hf}.mlp.down_proj.weight"
    return names


def hf_names(layout: MegatronLayout) -> list[str]:
    """Every Hugging Face tensor name the conversion gives (tied duplicates left out)."""
    return sorted(hf_to_megatron_names(layout))


def hf_to_megatron_names(layout: MegatronLayout) -> dict[str, str]:
    """Hugging Face name -> the Megatron tensor it goes into (three and two of them share one)."""
    names = {hf: mc for mc, hf in _renames(layout).items()}
    for i in range(layout.num_layers):
        layer, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        for part in ("q", "k", "v"):
            names[f"{hf}.self_attn.{part}_proj.weight"] = f"{layer}.self_attention.linear_qkv.weight"
            if layout.qkv_bias:
                names[f"{hf}.self_attn.{part}_proj.bias"] = f"{layer}.self_attention.linear_qkv.bias"
        names[f"{hf}.mlp.gate_proj.weight"] = f"{layer}.mlp.linear_fc1.weight"
        names[f"{hf}.mlp.up_proj.weight"] = f"{layer}.mlp.linear_fc1.weight"
    return names


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    """Hugging Face's q, k, v projections (weights or biases) as Megatron's ``linear_qkv``."""
    groups, head = layout.num_query_groups, layout.kv_channels
    rest = q.shape[1:]
    per_group = torch.cat(
        [
            q.reshape(groups, layout.heads_per_group * head, *rest),
            k.reshape(groups, head, *rest),
            v.reshape(groups, head, *rest),
        ],
        dim=1,
    )
    return per_group.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, layout: MegatronLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fuse_qkv``'s inverse."""
    groups, head = layout.num_query_groups, layout.kv_channels
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (layout.heads_per_group + 2) * head, *rest)
    q, k, v = per_group.split([layout.heads_per_group * head, head, head], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def to_megatron(weights: Mapping[str, torch.Tensor], layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """Hugging Face weights (a tied ``lm_head.weight`` may be there or not) under Megatron's
    names; ``ValueError`` naming any tensor missing or left over."""
    expected = set(hf_to_megatron_names(layout))
    given = set(weights) - ({"lm_head.weight"} if layout.tied_embeddings else set())
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(
            f"Hugging Face weights do not fit the {layout.model_type} layout: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    out = {mc: weights[hf] for mc, hf in _renames(layout).items()}
    for i in range(layout.num_layers):
        layer, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        attention = f"{hf}.self_attn"
        for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
            q, k, v = (weights[f"{attention}.{p}_proj.{kind}"] for p in "qkv")
            out[f"{layer}.self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, layout)
        out[f"{layer}.mlp.linear_fc1.weight"] = torch.cat(
            [weights[f"{hf}.mlp.gate_proj.weight"], weights[f"{hf}.mlp.up_proj.weight"]]
        )
    return out


def to_hf(weights: Mapping[str, torch.Tensor], layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """Megatron weights under Hugging Face's names (no ``lm_head.weight`` when tied), in
    Hugging Face's order; ``ValueError`` naming any tensor missing or left over. Tensors
    that move unchanged are the same tensors (no copy)."""
    shapes = layout.megatron_shapes()
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            f"Megatron weights do not fit the {layout.model_type} layout: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    renamed = {hf: weights[mc] for mc, hf in _renames(layout).items()}
    out = {"model.embed_tokens.weight": renamed.pop("model.embed_tokens.weight")}
    ffn = layout.ffn_hidden_size
    for i in range(layout.num_layers):
        layer, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = renamed.pop(f"{hf}.input_layernorm.weight")
        q, k, v = split_qkv(weights[f"{layer}.self_attention.linear_qkv.weight"], layout)
        out.update({f"{hf}.self_attn.q_proj.weight": q, f"{hf}.self_attn.k_proj.weight": k})
        out[f"{hf}.self_attn.v_proj.weight"] = v
        if layout.qkv_bias:
            qb, kb, vb = split_qkv(weights[f"{layer}.self_attention.linear_qkv.bias"], layout)
            out.update({f"{hf}.self_attn.q_proj.bias": qb, f"{hf}.self_attn.k_proj.bias": kb})
            out[f"{hf}.self_attn.v_proj.bias"] = vb
        out[f"{hf}.self_attn.o_proj.weight"] = renamed.pop(f"{hf}.self_attn.o_proj.weight")
        out[f"{hf}.post_attention_layernorm.weight"] = renamed.pop(f"{hf}.post_attention_layernorm.weight")
        gate, up = weights[f"{layer}.mlp.linear_fc1.weight"].split([ffn, ffn])
        out[f"{hf}.mlp.gate_proj.weight"] = gate.contiguous()
        out[f"{hf}.mlp.up_proj.weight"] = up.contiguous()
        out[f"{hf}.mlp.down_proj.weight"] = renamed.pop(f"{hf}.mlp.down_proj.weight")
    out.update(renamed)  # the final norm, and an untied output head
    return out


def optimizer_to_hf(state: Mapping[str, Any], layout: MegatronLayout) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` keyed by Megatron parameter names, keyed by Hugging Face
    names instead: each per-parameter tensor (AdamW's moments) converted as its parameter is,
    which is exact since the state is elementwise; a scalar (the step) given to every Hugging
    Face tensor of its parameter. ``ValueError`` where the tensors do not fit the layout."""
    hf_of: dict[str, list[str]] = {}
    for hf, megatron in hf_to_megatron_names(layout).items():
        hf_of.setdefault(megatron, []).append(hf)
    out: dict[str, dict[str, Any]] = {}
    for field, values in _fields(state.get("state", {})).items():
        if _parameter_shaped(values, layout.megatron_shapes()):
            converted = to_hf(values, layout)
        else:
            converted = {hf: value for megatron, value in values.items() for hf in hf_of[megatron]}
        for hf, value in converted.items():
            out.setdefault(hf, {})[field] = value
    groups = [
        {**group, "params": [hf for megatron in group["params"] for hf in hf_of[megatron]]}
        for group in state.get("param_groups", [])
    ]
    return {"state": out, "param_groups": groups}


def optimizer_to_megatron(state: Mapping[str, Any], layout: MegatronLayout) -> dict[str, Any]:
    """``optimizer_to_hf``'s inverse: keyed by Hugging Face names (as the torch backend saves
    it), keyed by Megatron's; a scalar is taken from the first Hugging Face tensor of its
    parameter."""
    megatron_of = hf_to_megatron_names(layout)
    hf_shapes = layout.hf_shapes()
    out: dict[str, dict[str, Any]] = {}
    for field, values in _fields(state.get("state", {})).items():
        if _parameter_shaped(values, hf_shapes):
            converted = to_megatron(values, layout)
        else:
            converted = {}
            for hf, value in values.items():
                converted.setdefault(megatron_of[hf], value)
        for megatron, value in converted.items():
            out.setdefault(megatron, {})[field] = value
    groups = [
        {**group, "params": list(dict.fromkeys(megatron_of[hf] for hf in group["params"]))}
        for group in state.get("param_groups", [])
    ]
    return {"state": out, "param_groups": groups}


def _fields(per_parameter: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state, field by field: ``{field: {parameter: value}}``."""
    fields: dict[str, dict[str, Any]] = {}
    for name, values in per_parameter.items():
        for field, value in values.items():
            fields.setdefault(field, {})[name] = value
    return fields


def _parameter_shaped(values: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether ``values`` holds one tensor of its parameter's shape for every parameter."""
    return set(values) == set(shapes) and all(
        isinstance(v, torch.Tensor) and tuple(v.shape) == shapes[name] for name, v in values.items()
    )
