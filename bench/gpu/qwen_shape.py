"""The model the GPU benchmarks share: the built-in one shaped like Qwen2-0.5B, in bf16."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from miles_events.rl.hf_model import prepare_base_model
from schemas.config import BuiltinModelConfig, ModelConfig


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--hidden --layers --intermediate --heads --kv-heads``, Qwen2-0.5B's by default."""
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)


def prepare_model(args: argparse.Namespace, max_position_embeddings: int = 2048) -> Path:
    """The built-in model of that shape written as a bf16 Hugging Face directory (seed 1)."""
    builtin = BuiltinModelConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_position_embeddings,
    )
    return prepare_base_model(
        ModelConfig(builtin=builtin, dtype="bfloat16"), Path(tempfile.mkdtemp()), seed=1
    )
