"""One checkpoint on disk: Hugging Face weights plus the trainer's state, written atomically.

Layout under a run directory::

    checkpoints/
      latest                      text file: the name of the checkpoint saved last
      latest_checkpointed_iteration.txt   its rollout id (Megatron's marker, read by miles)
      rollout_000012/
        model.safetensors         HF tensor names, {"format": "pt"} metadata
        config.json, generation_config.json, tokenizer files   (copied from the base model)
        optimizer.pt, rng.pt      torch.save files of the trainer's optimizer and RNG state
        trainer_state.json        schemas.checkpoint.TrainerState
        critic/                   PPO's value model (``trainer.use_critic``), a Hugging Face
                                  directory too (``*ForTokenClassification``, one label):
          model.safetensors, config.json, optimizer.pt, rng.pt, critic_state.json
        manifest.json             sha256 and size of every other file (``critic/`` ones
                                  included); written last

``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
load a checkpoint directory as it is. A checkpoint is complete exactly when its manifest
verifies: it is assembled under a hidden ``.rollout_XXXXXX.partial-<pid>`` name and renamed
into place only after every byte (manifest included) is on disk, so a crash at any moment
leaves either the previous checkpoint or the new one, never a torn one under the final name.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import hashlib
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from miles_events.rl.weights import split_tied
from miles_events.util.durable import fsync_path
from miles_events.util.file_modes import keep
from schemas.checkpoint import Manifest, ManifestEntry, TrainerState

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
ITERATION_FILE = "latest_checkpointed_iteration.txt"
"""Megatron's convention, which miles reads: the rollout id of the checkpoint saved last."""
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
TRAINER_STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
CRITIC_DIR = "critic"
CRITIC_STATE_FILE = "critic_state.json"
REQUIRED_FILES = (MODEL_FILE, "config.json", OPTIMIZER_FILE, RNG_FILE, TRAINER_STATE_FILE)

FINAL_NAME = re.compile(r"^rollout_(\d+)$")
# Hidden work dirs: being written (partial), swapped out (old), being removed (deleting).
WORK_NAME = re.compile(
    r"^\.(?:rollout_\d+\.(?:partial|old|deleting)|latest\.tmp|latest_checkpointed_iteration\.txt\.tmp)-(\d+)$"
)
# The base model's own weights are replaced by ours; everything else at its top level
# (config, generation config, tokenizer files, remote code) is copied so that the
# checkpoint loads exactly like the base did.
_BASE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_OWN_FILES = frozenset((MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, TRAINER_STATE_FILE, MANIFEST_FILE))

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class CheckpointError(ValueError):
    """A checkpoint is incomplete or does not match its manifest."""


@dataclass
class LoadedCheckpoint:
    """Everything a verified checkpoint holds, loaded into memory."""

    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    trainer_state: TrainerState
    manifest: Manifest


@dataclass
class CriticParts:
    """The critic's part of a checkpoint: as ``write_checkpoint``'s weights, optimizer and
    RNG state, and its optimizer step count."""

    weights: dict[str, torch.Tensor] | Path
    optimizer: Path | Any
    rng: Path | Any
    num_optimizer_steps: int


@dataclass
class LoadedCritic:
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    num_optimizer_steps: int


def checkpoint_name(rollout_id: int) -> str:
    """The directory name of the checkpoint taken after ``rollout_id``."""
    return f"rollout_{rollout_id:06d}"


def checkpoint_rollout_id(path: Path) -> int | None:
    """The rollout id encoded in a checkpoint directory's name, or None for other names."""
    match = FINAL_NAME.match(path.name)
    return int(match.group(1)) if match else None


# --- writing ---------------------------------------------------------------------------


def _write_file(path: Path, data: bytes, fsync: bool) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _write_weights(path: Path, weights: dict[str, torch.Tensor] | Path) -> None:
    """A safetensors file of ``weights``, or the file ``weights`` copied."""
    if isinstance(weights, Path):
        shutil.copyfile(weights, path)
    else:
        from safetensors.torch import save_file

        save_file(_safetensors_ready(weights), str(path), metadata={"format": "pt"})
    keep(path)  # safetensors creates 0600; kept files follow one rule


def save_state(state: Any, path: Path) -> None:
    """A state (an optimizer's or the RNG's: tensors, numbers, strings in dicts and lists)
    ``torch.save``d into the file ``path``: how a checkpoint and a transport keep one."""
    import torch

    torch.save(state, path)


def load_state(path: Path) -> Any:
    """A state written by ``save_state``: tensors, numbers, strings and containers only
    (``weights_only``: loading runs no code), on the CPU."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _write_state(path: Path, state: Path | Any) -> None:
    """A ``save_state`` file of ``state``, or the file ``state`` copied."""
    if isinstance(state, bytes | bytearray):
        raise TypeError(f"{path.name}: a state or the path of its torch.save file, not bytes")
    if isinstance(state, Path):
        shutil.copyfile(state, path)
    else:
        save_state(state, path)
    keep(path)


def _write_hashed(path: Path, write: Callable[[Path], None], fsync: bool) -> ManifestEntry:
    """``write`` the file ``path``, sync it, and its manifest entry."""
    write(path)
    if fsync:
        fsync_path(path)
    return ManifestEntry(path=path.name, sha256=_sha256(path), num_bytes=path.stat().st_size)


def _pretty_json(value: object) -> bytes:
    return msgspec.json.format(msgspec.json.encode(value), indent=2)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _safetensors_ready(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors of which no two share storage (safetensors refuses aliases).

    A tied duplicate (``miles_events.rl.weights.split_tied``) keeps its name with its own
    bytes, so the checkpoint loads under either name; so does any other view of a buffer
    already written (fused projections sliced from one tensor).
    """
    import torch

    _unique, tied = split_tied(weights)
    seen: set[int] = set()
    ready: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        ptr = t.untyped_storage().data_ptr()
        if name in tied or (ptr != 0 and ptr in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        elif not t.is_contiguous():
            t = t.contiguous()
        seen.add(t.untyped_storage().data_ptr())
        ready[name] = t
    return ready


def _copy_base_files(base_model_dir: Path, target: Path, fsync: bool) -> None:
    if not (base_model_dir / "config.json").is_file():
        raise CheckpointError(f"base model {base_model_dir} has no config.json")
    for source in sorted(base_model_dir.iterdir()):
        name = source.name
        if not source.is_file() or name.startswith(".") or name in _OWN_FILES:
            continue
        if name.endswith(_BASE_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        shutil.copyfile(source, target / name)
        if fsync:
            fsync_path(target / name)


def _manifest_for(
    directory: Path, rollout_id: int, weight_version: str, hashed: dict[str, ManifestEntry] | None = None
) -> Manifest:
    """Every file of ``directory`` (and of its ``critic/``) but the manifest, hashed here
    unless in ``hashed`` (by its path in the checkpoint)."""
    hashed = hashed or {}
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST_FILE]
    if (directory / CRITIC_DIR).is_dir():
        paths += [p for p in sorted((directory / CRITIC_DIR).iterdir()) if p.is_file()]
    files = []
    for p in paths:
        name = p.relative_to(directory).as_posix()
        files.append(
            hashed.get(name) or ManifestEntry(path=name, sha256=_sha256(p), num_bytes=p.stat().st_size)
        )
    return Manifest(rollout_id=rollout_id, weight_version=weight_version, files=files)


def value_model_config(base_config: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the policy's value model: its architecture as a
    ``*ForTokenClassification`` of one label."""
    config = dict(base_config)
    config["architectures"] = [
        name.replace("ForCausalLM", "ForTokenClassification")
        for name in base_config.get("architectures") or []
    ]
    config["id2label"] = {"0": "LABEL_0"}
    config["label2id"] = {"LABEL_0": 0}
    return config


def _write_critic(
    target: Path, base_model_dir: Path, critic: CriticParts, fsync: bool
) -> list[ManifestEntry]:
    """The critic's files under ``target`` (a checkpoint's ``critic/``); their manifest entries."""
    import json

    target.mkdir()
    entries = [
        _write_hashed(target / MODEL_FILE, lambda p: _write_weights(p, critic.weights), fsync),
        _write_hashed(target / OPTIMIZER_FILE, lambda p: _write_state(p, critic.optimizer), fsync),
        _write_hashed(target / RNG_FILE, lambda p: _write_state(p, critic.rng), fsync),
    ]
    base = json.loads((base_model_dir / "config.json").read_text(encoding="utf-8"))
    _write_file(target / "config.json", _pretty_json(value_model_config(base)), fsync)
    _write_file(
        target / CRITIC_STATE_FILE, _pretty_json({"num_optimizer_steps": critic.num_optimizer_steps}), fsync
    )
    if fsync:
        fsync_path(target)
    return [msgspec.structs.replace(e, path=f"{CRITIC_DIR}/{e.path}") for e in entries]


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _install(partial: Path, final: Path, fsync: bool) -> None:
    """Move the finished ``partial`` dir to ``final``, replacing an existing one safely."""
    root = final.parent
    if not final.exists():
        os.rename(partial, final)
        return
    # After an exchange, ``partial`` holds the previous checkpoint until it is removed.
    if _exchange(partial, final):
        if fsync:
            fsync_path(root)
        shutil.rmtree(partial, ignore_errors=True)
        return
    aside = root / f".{final.name}.old-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    try:
        os.rename(partial, final)
    except BaseException:
        os.rename(aside, final)
        raise
    if fsync:
        fsync_path(root)
    shutil.rmtree(aside, ignore_errors=True)


def _replace_file(root: Path, file_name: str, text: str, fsync: bool) -> None:
    tmp = root / f".{file_name}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    _write_file(tmp, text.encode(), fsync)
    os.replace(tmp, root / file_name)


def _point_latest(root: Path, name: str, rollout_id: int, fsync: bool) -> None:
    _replace_file(root, LATEST_FILE, name + "\n", fsync)
    _replace_file(root, ITERATION_FILE, f"{rollout_id}\n", fsync)
    if fsync:
        fsync_path(root)


def write_checkpoint(
    run_dir: Path,
    base_model_dir: Path,
    rollout_id: int,
    weights: dict[str, torch.Tensor] | Path,
    optimizer: Path | Any,
    rng: Path | Any,
    trainer_state: TrainerState,
    fsync: bool = True,
    critic: CriticParts | None = None,
) -> Path:
    """Write the checkpoint of ``rollout_id`` atomically and point ``latest`` at it (with
    ``critic``, PPO's value model in its ``critic/``).

    ``weights`` are tensors, or a safetensors file of them, copied as it is (a transport's
    staged file: the copy needs no torch). ``optimizer`` and ``rng`` are states (dicts of
    tensors and plain data), written with ``torch.save``, or ``torch.save`` files of them,
    copied as they are. An existing checkpoint of the same rollout is replaced only
    once the new one is complete. On failure the partial directory is removed and every
    older checkpoint is untouched.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(rollout_id)
    final = root / name
    partial = root / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        # The weights and the optimizer state, the bulk, are written, synced and hashed side
        # by side (each while its pages are still cached): the work is in the kernel and in
        # hashlib, which release the interpreter.
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="checkpoint") as pool:
            bulk = [
                pool.submit(_write_hashed, partial / MODEL_FILE, lambda p: _write_weights(p, weights), fsync),
                pool.submit(
                    _write_hashed, partial / OPTIMIZER_FILE, lambda p: _write_state(p, optimizer), fsync
                ),
            ]
            rng_entry = _write_hashed(partial / RNG_FILE, lambda p: _write_state(p, rng), fsync)
            _write_file(partial / TRAINER_STATE_FILE, _pretty_json(trainer_state), fsync)
            _copy_base_files(Path(base_model_dir), partial, fsync)
            hashed = {entry.path: entry for entry in (rng_entry, *(future.result() for future in bulk))}
            if critic is not None:
                hashed |= {
                    e.path: e
                    for e in _write_critic(partial / CRITIC_DIR, Path(base_model_dir), critic, fsync)
                }
        manifest = _manifest_for(partial, rollout_id, trainer_state.weight_version, hashed)
        _write_file(partial / MANIFEST_FILE, _pretty_json(manifest), fsync)
        if fsync:
            fsync_path(partial)
        _install(partial, final, fsync)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if fsync:
        fsync_path(root)
    _point_latest(root, name, rollout_id, fsync)
    return final


# --- reading ---------------------------------------------------------------------------


def _read_manifest(path: Path) -> Manifest:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} incomplete: no manifest")
    try:
        return msgspec.json.decode(manifest_path.read_bytes(), type=Manifest)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest: {exc}") from exc


def verify_checkpoint(path: Path) -> Manifest:
    """Recompute every file's size and sha256 against the manifest; return the manifest.

    Raises ``CheckpointError`` naming the first missing or mismatching file.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    listed = {entry.path for entry in manifest.files}
    for required in REQUIRED_FILES:
        if required not in listed:
            raise CheckpointError(f"checkpoint {path}: manifest does not list {required}")
    for entry in manifest.files:
        # Manifest entries are plain names inside the checkpoint (or its critic/), never
        # paths out of it.
        name = entry.path.removeprefix(f"{CRITIC_DIR}/")
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {path}: bad manifest entry {entry.path!r}")
        file = path / entry.path
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: missing file {entry.path}")
        size = file.stat().st_size
        if size != entry.num_bytes:
            raise CheckpointError(
                f"checkpoint {path}: {entry.path} has {size} bytes, manifest says {entry.num_bytes}"
            )
        if _sha256(file) != entry.sha256:
            raise CheckpointError(f"checkpoint {path}: {entry.path} does not match its sha256")
    return manifest


def _torch_load(path: Path) -> Any:
    """A checkpoint's optimizer or RNG state: tensors, numbers, strings and containers only.

    ``weights_only=True`` always: whoever can write a checkpoint can also rewrite its
    manifest, so the hashes prove integrity, not trust, and nothing loaded may run code. A
    file that needs more than that is refused, naming it.
    """
    try:
        return load_state(path)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} holds objects other than tensors and plain data "
            f"(refused: loading it could run code): {first}"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path.parent}: cannot load {path.name}: {exc}") from exc


def read_checkpoint(path: Path, verify: bool = True) -> LoadedCheckpoint:
    """Verify ``path`` against its manifest, then load weights, optimizer, RNG and state.

    ``verify=False`` is for a checkpoint this run has verified already (the run plan does,
    once): the manifest is read but the files are not hashed again.
    """
    from safetensors.torch import load_file

    path = Path(path)
    manifest = verify_checkpoint(path) if verify else _read_manifest(path)
    return LoadedCheckpoint(
        path=path,
        weights=load_file(str(path / MODEL_FILE)),
        optimizer=_torch_load(path / OPTIMIZER_FILE),
        rng=_torch_load(path / RNG_FILE),
        trainer_state=msgspec.json.decode((path / TRAINER_STATE_FILE).read_bytes(), type=TrainerState),
        manifest=manifest,
    )


def has_critic(path: Path) -> bool:
    """Whether the checkpoint ``path`` holds a critic (its manifest lists one)."""
    return f"{CRITIC_DIR}/{MODEL_FILE}" in {entry.path for entry in _read_manifest(Path(path)).files}


def read_critic(path: Path) -> LoadedCritic:
    """The critic of the checkpoint ``path`` (verified already, as the run plan does);
    ``CheckpointError`` when it holds none."""
    from safetensors.torch import load_file

    path = Path(path)
    if not has_critic(path):
        raise CheckpointError(f"checkpoint {path} holds no critic ({CRITIC_DIR}/ is not in its manifest)")
    critic = path / CRITIC_DIR
    state = msgspec.json.decode((critic / CRITIC_STATE_FILE).read_bytes())
    return LoadedCritic(
        weights=load_file(str(critic / MODEL_FILE)),
        optimizer=_torch_load(critic / OPTIMIZER_FILE),
        rng=_torch_load(critic / RNG_FILE),
        num_optimizer_steps=int(state["num_optimizer_steps"]),
    )


def latest_pointer(root: Path) -> str | None:
    """The checkpoint name the ``latest`` file under a checkpoints root holds, if valid."""
    try:
        name = (root / LATEST_FILE).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return name if FINAL_NAME.match(name) else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint dirs with a manifest, newest rollout first."""
    found = [p for p in root.iterdir() if FINAL_NAME.match(p.name) and (p / MANIFEST_FILE).is_file()]
    return sorted(found, key=lambda p: checkpoint_rollout_id(p) or 0, reverse=True)
