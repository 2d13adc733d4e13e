"""The built-in model's size from its settings, without building it (or importing
transformers): what ``[model.builtin]`` costs before the driver allocates it."""

from __future__ import annotations

from schemas.config import BuiltinModelConfig

BUILTIN_VOCAB_SIZE = 18
"""Tokens of the built-in arith tokenizer (``hf_model``: 3 special, 15 symbols; a test checks)."""

BUILT_BYTES_PER_PARAMETER = 4
"""The built-in model is built in float32, whatever ``model.dtype`` it is later loaded in."""


def builtin_parameter_count(config: BuiltinModelConfig, vocab_size: int = BUILTIN_VOCAB_SIZE) -> int:
    """Parameters of the Qwen2 / Llama model ``hf_model.build_builtin`` makes from ``config``
    (Qwen2 has biases on q, k and v; Llama none)."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.architecture == "qwen2":
        attention += q_width + 2 * kv_width
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    layer = attention + mlp + 2 * hidden  # and its two RMSNorms
    embeddings = vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_hidden_layers * layer + hidden  # and the final norm


def builtin_build_bytes(config: BuiltinModelConfig) -> int:
    """Bytes of the built-in model's parameters as the driver builds them."""
    return BUILT_BYTES_PER_PARAMETER * builtin_parameter_count(config)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
"""Bytes of one value of each floating-point dtype a model is kept in (``model.dtype``, a
Hugging Face config's ``torch_dtype``)."""
