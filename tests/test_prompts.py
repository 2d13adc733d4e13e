"""Prompt files: what cannot be used is one ``DataError`` line naming the file and line;
the data order is a pure function of the seed, for any seed the config takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_events.rl.prompts import DataError, epoch_order, load_prompts, whole_batches_per_epoch

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
    assert error_of(tmp_path, GOOD + b"{oops\n") == ":2: not valid JSON (Expecting property name enclosed in double quotes)"


def test_json_nested_too_deeply_is_a_data_error(tmp_path: Path) -> None:
    assert error_of(tmp_path, b"[" * 100_000) == ":1: not usable JSON (nested too deeply)"


def test_an_integer_python_will_not_convert_is_a_data_error(tmp_path: Path) -> None:
    message = error_of(tmp_path, b'{"input": "1", "label": ' + b"1" * 5000 + b"}\n")
    assert message.startswith(":1: not usable JSON (Exceeds the limit") and "set_int_max_str_digits" not in message


@pytest.mark.parametrize("content", [b'{"input": "1"}\n', b"[1, 2]\n", b'"input"\n'])
def test_a_line_without_both_keys_is_named(tmp_path: Path, content: bytes) -> None:
    assert error_of(tmp_path, content) == ":1: needs the keys 'input' and 'label'"


@pytest.mark.parametrize("content", [b"", b"\n  \n\t\n"])
def test_a_file_without_prompts_is_an_error(tmp_path: Path, content: bytes) -> None:
    assert error_of(tmp_path, content) == ": no prompts"


def test_a_directory_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r": cannot read: Is a directory$"):
        load_prompts(tmp_path, "input", "label")


def test_fewer_prompts_than_a_batch_is_an_error_naming_the_keys() -> None:
    assert whole_batches_per_epoch(9, 4) == 2
    with pytest.raises(DataError, match=r"run.num_rollout is unset .* 3 prompts, .*data.rollout_batch_size = 4"):
        whole_batches_per_epoch(3, 4)


def test_the_data_order_is_unchanged_for_the_seeds_it_always_took() -> None:
    for seed, epoch in ((0, 0), (1234, 3), (2**40, 1)):
        expected = torch.randperm(50, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        assert epoch_order(50, seed, epoch, shuffle=True) == expected


def test_any_seed_the_config_takes_orders_the_data() -> None:
    order = epoch_order(50, 2**63 - 1, 7, shuffle=True)
    assert sorted(order) == list(range(50))
    assert order == epoch_order(50, 2**63 - 1, 7, shuffle=True) != epoch_order(50, 2**63 - 1, 8, shuffle=True)
