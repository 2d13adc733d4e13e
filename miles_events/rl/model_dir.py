"""Whether a Hugging Face model directory (``model.path``) can be loaded as the actors load
it, found by reading it, never by loading its weights.

``inspect_model_dir(path)`` checks, in order: the directory exists; ``config.json`` parses
and names a ``model_type`` transformers knows, with a causal language model, and
``architectures`` transformers has; tokenizer files are there and the tokenizer loads
(``AutoTokenizer``, local files only); there are safetensors weights, every file a
``model.safetensors.index.json`` names is there, and every safetensors file's header
parses with its tensors covering the file exactly (``safetensors.safe_open``). The first
problem raises ``ModelDirError`` with one line naming the file; on success it returns what
the other checks need: the tokenizer and the model's longest sequence.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Files one of which holds a tokenizer's vocabulary: without any, transformers builds an
empty tokenizer of the model's class instead of failing (every prompt then has no tokens)."""

SAFETENSORS_INDEX = "model.safetensors.index.json"


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; the message is one line naming the file."""


@dataclass(frozen=True)
class ModelDir:
    tokenizer: PreTrainedTokenizerBase
    max_positions: int | None
    """The model's ``max_position_embeddings`` (its text model's), None where it has none."""


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirError(f"{path} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ModelDirError(f"{config_file}: cannot read ({_first_line(error)})") from None
    except json.JSONDecodeError as error:
        raise ModelDirError(f"{config_file}: not valid JSON ({error.msg} at line {error.lineno})") from None
    except (ValueError, RecursionError):
        raise ModelDirError(f"{config_file}: not usable JSON") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_file}: not a JSON object")
    return config


def _check_architecture(path: Path, config: dict[str, Any]) -> Any:
    """The transformers config of ``path`` (``AutoConfig``), its model type known to hold a
    causal LM (``AutoModelForCausalLM``, what the actors load)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_file = path / "config.json"
    model_type = config.get("model_type")
    known = f"transformers {transformers.__version__}"
    if not isinstance(model_type, str) or not model_type:
        raise ModelDirError(f"{config_file}: no model_type (the architecture it is)")
    if model_type not in CONFIG_MAPPING:
        raise ModelDirError(f"{config_file}: model_type {model_type!r} is not an architecture {known} knows")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelDirError(
            f"{config_file}: model_type {model_type!r} has no causal language model in {known}"
        )
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ModelDirError(f"{config_file}: architectures is not a list of class names")
    for name in architectures:
        if not isinstance(name, str) or not name.isidentifier() or not hasattr(transformers, name):
            raise ModelDirError(f"{config_file}: architectures names {name!r}, a class {known} does not have")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # any way transformers refuses it is the user's file
        raise ModelDirError(f"{config_file}: transformers cannot read it ({_first_line(error)})") from None


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # any way transformers refuses it is the user's file
        raise ModelDirError(f"{path}: the tokenizer does not load ({_first_line(error)})") from None


def _header_end(file: Path) -> int | None:
    """Where a safetensors file's header says its tensors end (its size when whole), None
    where the header cannot say: only to describe a file ``safe_open`` refused."""
    try:
        with file.open("rb") as stream:
            length: int = struct.unpack("<Q", stream.read(8))[0]
            header = json.loads(stream.read(length))
        ends: list[int] = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        return 8 + length + max(ends, default=0)
    except Exception:  # a header too damaged to say
        return None


def _check_weights(path: Path) -> None:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            named = sorted(set(weight_map.values()))
        except Exception as error:  # a damaged index
            raise ModelDirError(f"{index}: not a safetensors index ({_first_line(error)})") from None
        missing = [name for name in named if not (path / str(name)).is_file()]
        if missing:
            raise ModelDirError(
                f"{index} names {len(missing)} missing file(s): {', '.join(map(str, missing[:3]))}"
            )
    if not files:
        raise ModelDirError(f"{path} has no *.safetensors weights (the only weights that are loaded)")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as opened:
                opened.keys()
        except Exception as error:  # the library's own refusal, whatever its type
            size, end = file.stat().st_size, _header_end(file)
            if end is not None and end != size:
                raise ModelDirError(
                    f"{file}: {size:,} bytes where its header's tensors end at {end:,} "
                    f"({'truncated' if size < end else 'bytes after them'})"
                ) from None
            raise ModelDirError(f"{file}: not a readable safetensors file ({_first_line(error)})") from None


def inspect_model_dir(path: str | Path) -> ModelDir:
    """Whether ``path`` loads as the actors load it (see the module docstring); writes nothing."""
    path = Path(path)
    if not path.exists():
        raise ModelDirError(f"no such directory {path}")
    if not path.is_dir():
        raise ModelDirError(f"{path} is not a directory")
    hf_config = _check_architecture(path, _read_config(path))
    tokenizer = _load_tokenizer(path)
    _check_weights(path)
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    positions = getattr(text_config, "max_position_embeddings", None)
    return ModelDir(tokenizer=tokenizer, max_positions=positions if isinstance(positions, int) else None)
