"""Prompt files: what cannot be used is one ``DataError`` line naming the file and line;
the data order is a pure function of the seed, for any seed the config takes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from miles_events.rl.prompts import (
    DataError,
    epoch_order,
    load_prompts,
    whole_batches_per_epoch,
    with_template_ids,
)

GOOD = b'{"input": "1+1=", "label": "2"}\n'


def error_of(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as caught:
        load_prompts(path, "input", "label")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path))
    return message.removeprefix(str(path))


def test_a_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD + b"\n" + b'{"input": 3, "label": [4], "extra": null}\r\n')
    prompts = load_prompts(path, "input", "label")
    assert [(p.index, p.prompt, p.label) for p in prompts] == [(0, "1+1=", "2"), (1, "3", "[4]")]


def test_invalid_utf8_names_the_line_and_byte(tmp_path: Path) -> None:
    assert error_of(tmp_path, GOOD + b'{"input": "\xff"}\n') == ":2: not UTF-8 text (byte 0xff at offset 43)"


def test_a_truncated_utf8_sequence_at_the_end_is_named(tmp_path: Path) -> None:
    assert error_of(tmp_path, GOOD + GOOD + b"\xe2\x82") == ":3: not UTF-8 text (byte 0xe2 at offset 64)"


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    assert (
        error_of(tmp_path, GOOD + b"{oops\n")
        == ":2: not valid JSON (Expecting property name enclosed in double quotes)"
    )


def test_json_nested_too_deeply_is_a_data_error(tmp_path: Path) -> None:
    assert error_of(tmp_path, b"[" * 100_000) == ":1: not usable JSON (nested too deeply)"


def test_an_integer_python_will_not_convert_is_a_data_error(tmp_path: Path) -> None:
    message = error_of(tmp_path, b'{"input": "1", "label": ' + b"1" * 5000 + b"}\n")
    assert (
        message.startswith(":1: not usable JSON (Exceeds the limit")
        and "set_int_max_str_digits" not in message
    )


@pytest.mark.parametrize("content", [b'{"input": "1"}\n', b"[1, 2]\n", b'"input"\n'])
def test_a_line_without_both_keys_is_named(tmp_path: Path, content: bytes) -> None:
    assert error_of(tmp_path, content) == ":1: needs the keys 'input' and 'label'"


@pytest.mark.parametrize("content", [b"", b"\n  \n\t\n"])
def test_a_file_without_prompts_is_an_error(tmp_path: Path, content: bytes) -> None:
    assert error_of(tmp_path, content) == ": no prompts"


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r": is a directory, not a file$"):
        load_prompts(tmp_path, "input", "label")


def test_a_fifo_is_named_as_one_and_never_opened(tmp_path: Path) -> None:
    """Opening a FIFO for reading blocks until something writes to it: it is never opened."""
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as caught:
        load_prompts(fifo, "input", "label")
    assert str(caught.value) == f"{fifo}: is not a regular file (a FIFO)"


def test_a_device_is_named_as_one() -> None:
    with pytest.raises(DataError) as caught:
        load_prompts("/dev/null", "input", "label")
    assert str(caught.value) == "/dev/null: is not a regular file (a character device)"


@pytest.mark.parametrize("key", ["input", "label"])
def test_a_lone_surrogate_is_refused_naming_the_line_and_key(tmp_path: Path, key: str) -> None:
    """JSON may escape half of a UTF-16 pair on its own (``"\\ud800"``): that is no text."""
    record = {"input": '"1+1="', "label": '"2"'} | {key: '"a\\ud800"'}
    line = f'{{"input": {record["input"]}, "label": {record["label"]}}}\n'.encode()
    assert (
        error_of(tmp_path, GOOD + line)
        == f":2: {key!r} holds a lone surrogate ('\\ud800'), which is not text"
    )


@pytest.mark.parametrize("key", ["input", "label"])
def test_a_null_input_or_label_is_refused(tmp_path: Path, key: str) -> None:
    """It was read as the text ``'None'``."""
    line = (
        b'{"input": "1+1=", "label": "2"}'.replace(b'"2"' if key == "label" else b'"1+1="', b"null") + b"\n"
    )
    assert error_of(tmp_path, GOOD + line) == f":2: {key!r} is null; give a string"


def test_a_chat_message_list_without_the_chat_template_names_the_setting(tmp_path: Path) -> None:
    """It was turned into the text of a Python list."""
    line = b'{"input": [{"role": "user", "content": "1+1="}], "label": "2"}\n'
    assert error_of(tmp_path, line) == (
        ":1: 'input' is a list of chat messages; set data.apply_chat_template = true to render it with the "
        "tokenizer's chat template"
    )


def test_an_object_as_the_input_is_refused(tmp_path: Path) -> None:
    line = b'{"input": {"text": "1+1="}, "label": "2"}\n'
    assert error_of(tmp_path, line) == (
        ":1: 'input' is an object; give the prompt as a string or a list of chat messages"
    )


def render(messages) -> str:
    """A chat template of the usual shape: each message on its turn, the assistant's turn opened."""
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def test_with_the_chat_template_a_chat_and_a_string_are_rendered_and_the_row_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}], '
        '"label": "2", "level": 1}\n'
        '{"input": "2+2=", "label": "4", "level": 2}\n'
    )
    chat, text = load_prompts(path, "input", "label", chat=True, template=render)
    assert chat.prompt == "<system>Be brief.</system><user>1+1=</user><assistant>"
    assert text.prompt == "<user>2+2=</user><assistant>"
    assert chat.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="})
    assert text.messages == ({"role": "user", "content": "2+2="},)
    assert (chat.row["level"], text.row["level"]) == (1, 2)
    assert chat.row["input"][1]["content"] == "1+1=", "the row is the file's, whole"
    unrendered = load_prompts(path, "input", "label", chat=True)
    assert [p.prompt for p in unrendered] == ["Be brief.\n1+1=", "2+2="], "without a template: the contents"


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ("[]", "'input' is an empty list of chat messages"),
        (
            '[{"role": "user", "content": 3}]',
            '\'input\': message 0 is not {"role": ..., "content": ...} with strings',
        ),
        ('["hi"]', '\'input\': message 0 is not {"role": ..., "content": ...} with strings'),
        (
            '[{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]',
            "'input': message 1 has the role 'robot', not one of system, user, assistant, tool",
        ),
    ],
)
def test_a_chat_that_is_not_one_is_named(tmp_path: Path, messages: str, expected: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"input": {messages}, "label": "2"}}\n')
    with pytest.raises(DataError) as raised:
        load_prompts(path, "input", "label", chat=True, template=render)
    assert str(raised.value) == f"{path}:1: {expected}"


def test_a_template_that_cannot_render_a_chat_names_the_line(tmp_path: Path) -> None:
    def failing(messages) -> str:
        raise ValueError("Conversation roles must alternate user/assistant")

    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "1+1=", "label": "2"}\n')
    with pytest.raises(DataError) as raised:
        load_prompts(path, "input", "label", chat=True, template=failing)
    assert str(raised.value) == (
        f"{path}:1: the chat template cannot render it (ValueError: Conversation roles must alternate user/assistant)"
    )


def test_each_prompt_knows_its_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n" + GOOD + b"  \n" + GOOD)
    assert [(p.index, p.line) for p in load_prompts(path, "input", "label")] == [(0, 2), (1, 4)]


def test_fewer_prompts_than_a_batch_is_an_error_naming_the_keys() -> None:
    assert whole_batches_per_epoch(9, 4) == 2
    with pytest.raises(
        DataError, match=r"run.num_rollout is unset .* 3 prompts, .*data.rollout_batch_size = 4"
    ):
        whole_batches_per_epoch(3, 4)


def test_the_data_order_is_unchanged_for_the_seeds_it_always_took() -> None:
    for seed, epoch in ((0, 0), (1234, 3), (2**40, 1)):
        expected = torch.randperm(
            50, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        ).tolist()
        assert epoch_order(50, seed, epoch, shuffle=True) == expected


def test_any_seed_the_config_takes_orders_the_data() -> None:
    order = epoch_order(50, 2**63 - 1, 7, shuffle=True)
    assert sorted(order) == list(range(50))
    assert order == epoch_order(50, 2**63 - 1, 7, shuffle=True) != epoch_order(50, 2**63 - 1, 8, shuffle=True)


def test_rendered_chats_carry_the_ids_of_their_text_without_added_special_tokens(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": "4"}\n')
    seen: list[list[str]] = []

    def encode(texts: list[str]) -> list[list[int]]:
        seen.append(texts)
        return [[len(t), 7] for t in texts]

    prompts = with_template_ids(load_prompts(path, "input", "label", chat=True, template=render), encode)
    assert seen == [["<user>1+1=</user><assistant>", "<user>2+2=</user><assistant>"]]
    assert [p.ids for p in prompts] == [(28, 7), (28, 7)]
    assert load_prompts(path, "input", "label")[0].ids is None, "text prompts are tokenized by the engines"
