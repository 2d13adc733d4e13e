"""The built-in task's prompt files: content, determinism, and that they load and tokenize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_events.rl.hf_model import build_arith_tokenizer
from miles_events.rl.prompts import load_prompts
from tests.support import EXAMPLES, example_script

make_arith_data = example_script("make_arith_data")


def _read(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_every_label_is_the_sum_of_the_prompt_digits() -> None:
    for problem in make_arith_data.addition_problems():
        a, b = int(problem["input"][0]), int(problem["input"][2])
        assert problem["input"] == f"{a}+{b}="
        assert problem["label"] == str(a + b)


def test_default_task_is_every_digit_pair_with_a_single_digit_sum() -> None:
    inputs = {p["input"] for p in make_arith_data.addition_problems()}
    expected = {f"{a}+{b}=" for a in range(10) for b in range(10) if a + b <= 9}
    assert inputs == expected
    assert len(make_arith_data.addition_problems()) == 55


def test_max_sum_bounds_the_labels() -> None:
    problems = make_arith_data.addition_problems(max_sum=4)
    assert max(int(p["label"]) for p in problems) == 4
    assert len(problems) == 15


def test_max_sum_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_sum"):
        make_arith_data.addition_problems(max_sum=19)


def test_writing_twice_gives_identical_bytes(tmp_path: Path) -> None:
    first = [p.read_bytes() for p in make_arith_data.write_task(tmp_path / "a")]
    second = [p.read_bytes() for p in make_arith_data.write_task(tmp_path / "b")]
    assert first == second


def test_eval_file_holds_the_training_problems(tmp_path: Path) -> None:
    train_path, eval_path = make_arith_data.write_task(tmp_path)
    assert _read(train_path) == _read(eval_path)


def test_written_files_load_as_prompts_with_default_keys(tmp_path: Path) -> None:
    train_path, _ = make_arith_data.write_task(tmp_path)
    prompts = load_prompts(train_path, "input", "label")
    assert [(p.prompt, p.label) for p in prompts[:2]] == [("0+0=", "0"), ("0+1=", "1")]


def test_prompts_are_four_known_tokens_and_labels_one() -> None:
    tokenizer = build_arith_tokenizer()
    for problem in make_arith_data.addition_problems():
        prompt_ids = tokenizer(problem["input"])["input_ids"]
        label_ids = tokenizer(problem["label"])["input_ids"]
        assert len(prompt_ids) == 4 and len(label_ids) == 1
        assert tokenizer.unk_token_id not in prompt_ids + label_ids


def test_checked_in_files_match_the_script(tmp_path: Path) -> None:
    generated = make_arith_data.write_task(tmp_path)
    for path in generated:
        assert (EXAMPLES / "data" / path.name).read_bytes() == path.read_bytes()
