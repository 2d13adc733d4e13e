"""Prompt data: JSONL files with configurable input/label keys, and the data order.

The order is a pure function of (seed, epoch): rollout ``k`` always gets the same prompts,
so a resumed run sees exactly the data an uninterrupted run would have seen, and the data
cursor saved in a checkpoint is derived from the next rollout id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from schemas.checkpoint import DataCursor


@dataclass(frozen=True)
class Prompt:
    index: int
    prompt: str
    label: str


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


def load_prompts(path: str | Path, input_key: str, label_key: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise DataError(f"cannot read prompt data {path}: {error.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or input_key not in record or label_key not in record:
            raise DataError(f"{path}:{number}: needs the keys {input_key!r} and {label_key!r}")
        prompts.append(Prompt(len(prompts), str(record[input_key]), str(record[label_key])))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def num_rollout_per_epoch(num_prompts: int, rollout_batch_size: int) -> int:
    return max(1, num_prompts // rollout_batch_size)


def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(num_prompts))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
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
