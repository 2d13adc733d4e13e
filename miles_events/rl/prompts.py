"""Prompt data: JSONL files with configurable input/label keys, and the data order.

The order is a pure function of (seed, epoch): rollout ``k`` always gets the same prompts,
so a resumed run sees exactly the data an uninterrupted run would have seen, and the data
cursor saved in a checkpoint is derived from the next rollout id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.checkpoint import DataCursor

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Prompt:
    index: int
    prompt: str
    label: str


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start})"
        ) from None


def _parse_record(path: Path, number: int, line: str, input_key: str, label_key: str) -> tuple[str, str]:
    """(input, label) of one JSONL line."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or input_key not in record or label_key not in record:
            raise DataError(f"{path}:{number}: needs the keys {input_key!r} and {label_key!r}")
        return str(record[input_key]), str(record[label_key])
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise DataError(f"{path}:{number}: not usable JSON (nested too deeply)") from None
    except DataError:
        raise
    except ValueError as error:  # e.g. an integer of more digits than Python converts
        reason = " ".join(str(error).split(";")[0].split())  # less its advice on raising the limit
        raise DataError(f"{path}:{number}: not usable JSON ({reason})") from None


def load_prompts(path: str | Path, input_key: str, label_key: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    path = Path(path)
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if line.strip():
            prompt, label = _parse_record(path, number, line, input_key, label_key)
            prompts.append(Prompt(len(prompts), prompt, label))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def num_rollout_per_epoch(num_prompts: int, rollout_batch_size: int) -> int:
    return max(1, num_prompts // rollout_batch_size)


def whole_batches_per_epoch(num_prompts: int, rollout_batch_size: int) -> int:
    """The rollouts of an epoch when ``run.num_rollout`` is unset: the whole batches of the
    prompts (as miles derives them); a ``DataError`` when there is not even one."""
    per_epoch = num_prompts // rollout_batch_size
    if per_epoch <= 0:
        raise DataError(
            f"run.num_rollout is unset and data.prompt_data has {num_prompts} prompts, fewer than one "
            f"rollout batch (data.rollout_batch_size = {rollout_batch_size}): set run.num_rollout "
            "or a smaller batch"
        )
    return per_epoch


def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    import torch

    if not shuffle:
        return list(range(num_prompts))
    # torch takes seeds in [-2**63, 2**64) and reads a negative one modulo 2**64: the same
    # reduction here keeps every order as it was and lets any run.seed be combined.
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**64)
    return torch.randperm(num_prompts, generator=generator).tolist()


def data_cursor(rollout_id: int, rollout_batch_size: int, num_prompts: int) -> DataCursor:
    """Where the data stands before rollout ``rollout_id``."""
    per_epoch = num_rollout_per_epoch(num_prompts, rollout_batch_size)
    return DataCursor(
        next_rollout_id=rollout_id,
        epoch=rollout_id // per_epoch,
        offset=(rollout_id % per_epoch) * rollout_batch_size,
    )


def rollout_prompts(
    prompts: list[Prompt], rollout_id: int, rollout_batch_size: int, seed: int, shuffle: bool
) -> list[Prompt]:
    """The prompts of rollout ``rollout_id``: consecutive slices of each epoch's order,
    dropping the remainder of an epoch that does not fill a batch (as miles does)."""
    cursor = data_cursor(rollout_id, rollout_batch_size, len(prompts))
    order = epoch_order(len(prompts), seed, cursor.epoch, shuffle)
    if len(prompts) < rollout_batch_size:
        # Fewer prompts than a batch: cycle through the epoch's order.
        return [prompts[order[i % len(order)]] for i in range(rollout_batch_size)]
    return [prompts[i] for i in order[cursor.offset : cursor.offset + rollout_batch_size]]
