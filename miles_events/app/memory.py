"""A rollout's memory, estimated before anything starts, against what this machine has.

The estimate is deliberately coarse (within a small factor) and errs high; it exists to
refuse, with one line, sizes that cannot fit (``data.n_samples_per_prompt = 1e9``), not to
plan memory. Its parts, for ``n`` samples of at most ``S`` tokens on a model with ``L``
layers, hidden size ``H``, ``Hkv`` key/value heads of size ``D`` and a vocabulary of ``V``:

- the rollout batch in host memory, held by the Generator, in the data plane and by the
  Trainer: ``3 n (SAMPLE_OVERHEAD + 16 S)`` bytes;
- the engine's decode batch (``B = min(n, rollout.max_batch_size)`` rows): its KV cache
  ``2 L B Hkv D S`` values and its logits ``4 B V`` float32 values;
- the trainer's micro-batch (``m = trainer.micro_batch_size`` rows): logits and their
  gradient ``4 m S V`` float32 values, activations ``16 L m S H`` bytes.

On CUDA the engine and trainer parts live on the GPU and only the batch is counted
against host memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from miles_events.rl.model_size import BUILTIN_VOCAB_SIZE
from schemas.config import BuiltinModelConfig

MEMINFO = Path("/proc/meminfo")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
NVIDIA_CONTROL = Path("/dev/nvidiactl")
AMD_KFD = Path("/dev/kfd")
SAMPLE_OVERHEAD = 1024
"""Bytes of one sample's Python and msgpack overhead besides its token arrays."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype_bytes: int

    @classmethod
    def from_builtin(cls, config: BuiltinModelConfig, dtype_bytes: int) -> ModelShape:
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            vocab_size=BUILTIN_VOCAB_SIZE,
            max_positions=config.max_position_embeddings,
            dtype_bytes=dtype_bytes,
        )

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str], dtype_bytes: int) -> ModelShape:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        heads = int(config.get("num_attention_heads", 1))
        hidden = int(config.get("hidden_size", 1))
        return cls(
            num_layers=int(config.get("num_hidden_layers", 1)),
            hidden_size=hidden,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // max(heads, 1)),
            vocab_size=int(config.get("vocab_size", 1)),
            max_positions=int(config.get("max_position_embeddings", 4096)),
            dtype_bytes=dtype_bytes,
        )


@dataclass(frozen=True)
class RolloutMemory:
    samples: int
    batch_bytes: int
    engine_bytes: int
    trainer_bytes: int

    def host_bytes(self, on_gpu: bool) -> int:
        return self.batch_bytes + (0 if on_gpu else self.engine_bytes + self.trainer_bytes)


def rollout_memory(
    shape: ModelShape,
    *,
    samples: int,
    prompt_tokens: int,
    max_new_tokens: int,
    engine_batch: int,
    micro_batch: int,
) -> RolloutMemory:
    """``prompt_tokens``: the longest prompt's tokens, or a bound on them (its UTF-8 bytes
    bound them for byte-level tokenizers)."""
    tokens = min(shape.max_positions, prompt_tokens + max_new_tokens)
    rows = min(samples, engine_batch)
    kv = 2 * shape.num_layers * rows * shape.num_kv_heads * shape.head_dim * tokens * shape.dtype_bytes
    engine = kv + 4 * rows * shape.vocab_size * 4
    micro = min(samples, micro_batch)
    trainer = (
        4 * micro * tokens * shape.vocab_size * 4 + 16 * shape.num_layers * micro * tokens * shape.hidden_size
    )
    return RolloutMemory(
        samples=samples,
        batch_bytes=3 * samples * (SAMPLE_OVERHEAD + 16 * tokens),
        engine_bytes=engine,
        trainer_bytes=trainer,
    )


def available_memory() -> int | None:
    """Bytes the host can give a new allocation without swapping: Linux's ``MemAvailable``
    (``/proc/meminfo``), else the free physical pages (``os.sysconf``); None when neither is
    known. A container's own memory limit is not read."""
    try:
        for line in MEMINFO.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def cuda_present() -> bool:
    """Whether this process would see a GPU, asked without importing torch (the driver does
    not import it): an NVIDIA GPU listed by its driver (``/proc/driver/nvidia/gpus``) with
    its device nodes in this container (``/dev/nvidiactl``), or an AMD GPU's (``/dev/kfd``,
    which ROCm's torch counts as CUDA); and none hidden by ``CUDA_VISIBLE_DEVICES`` (read as
    CUDA reads it: up to its first invalid entry) or ``NVIDIA_VISIBLE_DEVICES`` (``void``,
    ``none``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = []
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            listed.append(entry)
        if not listed:
            return False
    if os.environ.get("NVIDIA_VISIBLE_DEVICES", "").strip().lower() in ("void", "none"):
        return False
    if AMD_KFD.exists():
        return True
    try:
        return NVIDIA_CONTROL.exists() and any(NVIDIA_GPUS.iterdir())
    except OSError:
        return False


def gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**28 else f"{num_bytes / 2**20:.0f} MiB"
