"""Prompt data: JSONL files with configurable input/label keys, and the data order.

The order is a pure function of (seed, epoch): rollout ``k`` always gets the same prompts,
so a resumed run sees exactly the data an uninterrupted run would have seen, and the data
cursor saved in a checkpoint is derived from the next rollout id.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from schemas.checkpoint import DataCursor

Message = Mapping[str, str]
"""One chat message: ``{"role": "user", "content": "..."}``."""

ChatTemplate = Callable[[Sequence[Message]], str]
"""Renders a chat as the prompt text the engines get (the generation prompt added)."""

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Prompt:
    index: int
    prompt: str
    """The text the engines get: the chat template applied, where it is."""
    label: str
    line: int = 0
    """The line of its file (from 1; 0: not from a file)."""
    messages: tuple[Message, ...] | None = None
    """The chat the prompt was rendered from (a string prompt is one user message), where
    the chat template is applied."""
    row: Mapping[str, Any] = field(default_factory=dict)
    """The whole row of the data file, every column, for a reward function that takes it."""
    ids: tuple[int, ...] | None = None
    """The token ids the engines get, where the chat template rendered the prompt: its text
    tokenized without adding special tokens (the template writes its own; adding a BOS
    again would double it). None: the engines tokenize ``prompt`` as text."""


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a regular file to read (``no such file``, ``is a directory``, ``is
    not a regular file (a FIFO)``, ...), or None when it is one. Asks ``stat`` only: a FIFO
    is never opened, which would wait for a writer."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a path holding a NUL byte
        return "no such file"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    for test, kind in _NOT_REGULAR:
        if test(mode):
            return f"is not a regular file ({kind})"
    return None if stat.S_ISREG(mode) else "is not a regular file"


def _read_text(path: Path) -> str:
    problem = not_a_file(path)
    if problem is not None:
        raise DataError(f"{path}: {problem}")
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


def _messages(value: list[object], key: str) -> tuple[Message, ...]:
    """``value`` as chat messages, or a ``DataError`` naming the first that is not one."""
    if not value:
        raise DataError(f"{key!r} is an empty list of chat messages")
    messages: list[Message] = []
    for number, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataError(f'{key!r}: message {number} is not {{"role": ..., "content": ...}} with strings')
        if message["role"] not in CHAT_ROLES:
            raise DataError(
                f"{key!r}: message {number} has the role {message['role']!r}, not one of {', '.join(CHAT_ROLES)}"
            )
        _check_text(message["content"], key)
        messages.append({"role": message["role"], "content": message["content"]})
    return tuple(messages)


def _check_text(text: str, key: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # JSON escapes half of a UTF-16 pair on its own: "\ud800"
        raise DataError(
            f"{key!r} holds a lone surrogate ({text[error.start]!r}), which is not text"
        ) from None


def _prompt(record: dict[str, object], key: str, chat: bool) -> tuple[str, tuple[Message, ...] | None]:
    """The prompt's text and, where ``chat`` (the chat template is applied), its messages (a
    string is one user message); the text of a chat is its messages' contents, one a line,
    until the template renders it."""
    value = record[key]
    if isinstance(value, list):
        if not chat:
            raise DataError(
                f"{key!r} is a list of chat messages; set data.apply_chat_template = true to render it "
                "with the tokenizer's chat template"
            )
        messages = _messages(value, key)
        return "\n".join(m["content"] for m in messages), messages
    text = _text(record, key, prompt=True)
    return text, (({"role": "user", "content": text},) if chat else None)


def _text(record: dict[str, object], key: str, *, prompt: bool) -> str:
    """``record[key]`` as the text the engines and the reward function get: a string as it
    is, a number as it reads (a label ``7`` is ``"7"``); a ``DataError`` (less the place, which
    the caller adds) for what would be read as something else."""
    value = record[key]
    if value is None:
        raise DataError(f"{key!r} is null; give a string")
    if prompt and isinstance(value, dict):
        raise DataError(f"{key!r} is an object; give the prompt as a string or a list of chat messages")
    text = str(value)
    _check_text(text, key)
    return text


def _parse_record(
    path: Path,
    number: int,
    line: str,
    input_key: str,
    label_key: str,
    chat: bool,
    template: ChatTemplate | None,
) -> tuple[str, str, tuple[Message, ...] | None, dict[str, Any]]:
    """(prompt text, label, chat messages, the whole row) of one JSONL line."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or input_key not in record or label_key not in record:
            raise DataError(f"needs the keys {input_key!r} and {label_key!r}")
        text, messages = _prompt(record, input_key, chat)
        label = _text(record, label_key, prompt=False)
        if messages is not None and template is not None:
            try:
                text = template(messages)
            except Exception as error:  # the user's template on the user's chat
                raise DataError(
                    f"the chat template cannot render it ({type(error).__name__}: {error})"
                ) from None
        return text, label, messages, record
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise DataError(f"{path}:{number}: not usable JSON (nested too deeply)") from None
    except DataError as error:
        raise DataError(f"{path}:{number}: {error}") from None
    except ValueError as error:  # e.g. an integer of more digits than Python converts
        reason = " ".join(str(error).split(";")[0].split())  # less its advice on raising the limit
        raise DataError(f"{path}:{number}: not usable JSON ({reason})") from None


def load_prompts(
    path: str | Path,
    input_key: str,
    label_key: str,
    *,
    chat: bool = False,
    template: ChatTemplate | None = None,
) -> list[Prompt]:
    """The prompts of a JSONL file. With ``chat`` (``data.apply_chat_template``) a prompt may
    be a list of chat messages, and ``template`` (the tokenizer's, where the caller has it)
    renders each prompt's chat into the text the engines get."""
    prompts: list[Prompt] = []
    path = Path(path)
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if line.strip():
            prompt, label, messages, row = _parse_record(
                path, number, line, input_key, label_key, chat, template
            )
            prompts.append(Prompt(len(prompts), prompt, label, number, messages, row))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def with_template_ids(prompts: list[Prompt], encode: Callable[[list[str]], list[list[int]]]) -> list[Prompt]:
    """``prompts`` with the ids ``encode`` (the tokenizer, adding no special tokens) gives
    their rendered text."""
    encoded = encode([p.prompt for p in prompts])
    return [replace(p, ids=tuple(ids)) for p, ids in zip(prompts, encoded, strict=True)]


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
