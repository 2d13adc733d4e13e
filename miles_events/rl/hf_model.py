"""Hugging Face causal LMs: the built-in tiny model and tokenizer, and loading by path.

Every actor loads the model from one Hugging Face directory. For the built-in model that
directory is written once, under ``<run.dir>/base_model``, before any actor starts (by the
runtime: ``miles_events.runtime.base.Preparation``), so that the Generator and the Trainer
(possibly in other processes) start from the same bytes and the Saver can copy the config
and tokenizer next to every checkpoint.
"""

from __future__ import annotations

import functools
import importlib.machinery
import inspect
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from miles_events.util.file_modes import keep
from schemas.config import BuiltinModelConfig, ModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import (
        PretrainedConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

ARITH_SPECIAL = ["<pad>", "<eos>", "<unk>"]
ARITH_SYMBOLS = list("0123456789+-*=?")

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The ``model.dtype`` values."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype ``model.dtype`` names."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_NAMES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def build_arith_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of arithmetic text, plus pad / eos / unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(ARITH_SPECIAL + ARITH_SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def builtin_hf_config(config: BuiltinModelConfig, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The Hugging Face config of the built-in model (its ``config.json``)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2Config(**common) if config.architecture == "qwen2" else LlamaConfig(**common)


def build_builtin(config: BuiltinModelConfig, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_arith_tokenizer()
    hf_config = builtin_hf_config(config, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model, tokenizer


def builtin_tokenizer(config: BuiltinModelConfig) -> PreTrainedTokenizerBase:
    """The built-in model's tokenizer as the actors load it from its directory, without
    writing that directory: ``AutoTokenizer`` picks the class of the architecture that
    ``config.json`` names, which reads the saved vocabulary its own way (Qwen2's byte-level
    one finds no token in ``abc``), so the tokenizer and the config are saved together into
    a temporary directory, loaded from there as the actors load theirs, and removed."""
    return _builtin_tokenizer(msgspec.json.encode(config))


@functools.lru_cache(maxsize=4)
def _builtin_tokenizer(encoded: bytes) -> PreTrainedTokenizerBase:
    config = msgspec.json.decode(encoded, type=BuiltinModelConfig)
    tokenizer = build_arith_tokenizer()
    with tempfile.TemporaryDirectory(prefix="miles-builtin-tokenizer-") as directory:
        builtin_hf_config(config, tokenizer).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return load_tokenizer(directory)


BUILTIN_RECIPE = "miles_builtin.json"
"""Beside a built-in base model: the settings and seed it was built from."""


class BaseModelMismatch(ValueError):
    """The run directory's built-in model was built from other settings."""


def base_model_dir(config: ModelConfig, run_dir: Path) -> Path:
    """The Hugging Face directory every actor loads: ``model.path`` or the built-in one's."""
    return Path(config.path) if config.path is not None else run_dir / "base_model"


def modeling_module(config: ModelConfig) -> str | None:
    """The transformers module of the model's architecture (``transformers.models.qwen2.
    modeling_qwen2``), where this transformers has it; None where it is not known. Asked of
    the files (the ``model_type`` of ``config.json``, the module's file) without importing
    transformers."""
    if config.path is None:
        model_type = config.builtin.architecture
    else:
        try:
            model_type = msgspec.json.decode((Path(config.path) / "config.json").read_bytes())["model_type"]
        except (OSError, msgspec.DecodeError, KeyError, TypeError):
            return None
    if not isinstance(model_type, str) or not model_type.isidentifier():
        return None
    spec = importlib.machinery.PathFinder.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        if (Path(root) / "models" / model_type / f"modeling_{model_type}.py").is_file():
            return f"transformers.models.{model_type}.modeling_{model_type}"
    return None


def _recipe(config: ModelConfig, seed: int) -> bytes:
    return msgspec.json.encode({"builtin": config.builtin, "seed": seed})


def base_model_built(config: ModelConfig, run_dir: Path, seed: int) -> bool:
    """Whether the base model's directory is there to load (``model.path`` is taken as it
    is); raises ``BaseModelMismatch`` for a built-in one built from other settings. Reads
    two small files: no torch."""
    if config.path is not None:
        return True
    target = base_model_dir(config, run_dir)
    if not (target / "config.json").exists():
        return False
    built_from = (target / BUILTIN_RECIPE).read_bytes() if (target / BUILTIN_RECIPE).exists() else b""
    if built_from != _recipe(config, seed):
        raise BaseModelMismatch(
            f"{target} was built from other [model.builtin] settings or run.seed "
            f"({built_from.decode() or 'unknown'}); use a new run.dir, or the settings it was built with"
        )
    return True


def prepare_base_model(config: ModelConfig, run_dir: Path, seed: int) -> Path:
    """The Hugging Face directory every actor loads, the built-in model written there first
    when it is not yet."""
    target = base_model_dir(config, run_dir)
    if base_model_built(config, run_dir, seed):
        return target
    recipe = _recipe(config, seed)
    model, tokenizer = build_builtin(config.builtin, seed)
    partial = run_dir / ".base_model.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    for written in partial.iterdir():
        if written.is_file():
            keep(written)
    (partial / BUILTIN_RECIPE).write_bytes(recipe)
    partial.rename(target)
    return target


def load_model(
    path: str | Path, dtype: str = "float32", device: torch.device | None = None
) -> PreTrainedModel:
    """The causal LM of a Hugging Face directory, moved to ``device`` when one is given."""
    # safetensors only: a pickled weights file (pytorch_model.bin) is never loaded.
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch_dtype(dtype), use_safetensors=True
    )
    if device is not None:
        # transformers wraps PreTrainedModel.to with functools.wraps(torch.nn.Module.to), which
        # types it as a plain function (``device`` taken for ``self``); it returns the model.
        model = model.to(device)  # type: ignore[arg-type]
    return model


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name ``module.forward`` takes its KV cache by: transformers 5 renamed
    ``past_key_values`` to ``cache``; either spelling is accepted."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class NoChatTemplate(ValueError):
    """``data.apply_chat_template`` with a tokenizer that has no chat template."""


def chat_template(tokenizer: PreTrainedTokenizerBase) -> Callable[[Sequence[Mapping[str, str]]], str]:
    """The tokenizer's chat template as a ``ChatTemplate`` (``miles_events.rl.prompts``): a
    chat rendered as text with the generation prompt added, which the engines tokenize as
    they tokenize any prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("its tokenizer has no chat template")

    def render(messages: Sequence[Mapping[str, str]]) -> str:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        assert isinstance(text, str)
        return text

    return render


def generation_eos_ids(path: str | Path) -> list[int]:
    """The end-of-sequence ids of the model's ``generation_config.json`` (an id or a list;
    none without the file), where engines stop besides at the tokenizer's EOS."""
    import json

    file = Path(path) / "generation_config.json"
    try:
        configured = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = configured if isinstance(configured, list) else [configured]
    return sorted({int(i) for i in ids if isinstance(i, int)})
