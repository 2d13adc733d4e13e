"""The math task's prompt files (examples/make_math_data.py) and its reward
(``rewards.math_answer``): answers right, levels balanced, eval held out, files reproducible."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from miles_events.rl.rewards import final_answer, math_answer
from tests.support import EXAMPLES, example_script

make_math_data = example_script("make_math_data")


def solve(text: str) -> int:
    """The answer of a problem, worked out from its text alone."""
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if "boxes with" in text:
        total = numbers[0] * numbers[1]
        if "more" in text:
            return total + numbers[2]
        if "taken out" in text:
            return total - numbers[2]
        return total
    total = numbers[0]
    for word, number in zip(re.findall(r"gets|gives away|buys|loses", text), numbers[1:], strict=True):
        total += number if word in ("gets", "buys") else -number
    return total


def test_every_label_is_the_problems_answer_and_never_negative() -> None:
    for row in make_math_data.problems(2000, seed=3):
        (message,) = row["prompt"]
        assert message["role"] == "user"
        assert row["label"] == str(solve(message["content"])), row
        assert int(row["label"]) >= 0


def test_the_two_levels_alternate_and_level_two_takes_two_operations() -> None:
    rows = make_math_data.problems(400, seed=5)
    assert [row["level"] for row in rows[:4]] == [1, 2, 1, 2]
    assert {len(row["ops"]) for row in rows if row["level"] == 1} == {1}
    assert {len(row["ops"]) for row in rows if row["level"] == 2} == {2}
    assert {row["ops"] for row in rows} == {"+", "-", "*", "-+", "+-", "*+", "*-"}


def test_the_eval_file_is_held_out_and_the_files_are_reproducible(tmp_path: Path) -> None:
    train, held_out = make_math_data.write_task(tmp_path / "a", train=600, eval_count=100)
    again = make_math_data.write_task(tmp_path / "b", train=600, eval_count=100)
    assert [train.read_bytes(), held_out.read_bytes()] == [again[0].read_bytes(), again[1].read_bytes()]
    texts = [json.loads(line)["prompt"][0]["content"] for line in train.read_text().splitlines()]
    held = [json.loads(line)["prompt"][0]["content"] for line in held_out.read_text().splitlines()]
    assert len(set(texts)) == 600 and len(set(held)) == 100
    assert not set(texts) & set(held)


def test_the_checked_in_files_match_the_script(tmp_path: Path) -> None:
    train, held_out = make_math_data.write_task(tmp_path)
    assert train.read_bytes() == (EXAMPLES / "data" / make_math_data.TRAIN_FILE).read_bytes()
    assert held_out.read_bytes() == (EXAMPLES / "data" / make_math_data.EVAL_FILE).read_bytes()


def test_asking_for_more_distinct_problems_than_exist_is_refused() -> None:
    with pytest.raises(ValueError, match="ask for fewer"):
        make_math_data.problems(10**6, seed=1)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("3 + 4 = 7 books.\n#### 7\nThe answer is: 7", "7"),
        ("So the answer is \\boxed{12}. Then 5 more.", "12"),
        ("\\boxed{3} first, \\boxed{x = 9}", "9"),
        ("She has 1,200 stamps", "1200"),
        ("It is -3 degrees", "-3"),
        ("about 2.5 apples", "2.5"),
        ("no number here", None),
        ("", None),
    ],
)
def test_the_final_answer_is_the_last_boxed_number_else_the_last_number(
    response: str, answer: str | None
) -> None:
    assert final_answer(response) == answer


def test_math_answer_compares_numbers_not_strings() -> None:
    assert math_answer("", "The total is 12.0", "12") == 1.0
    assert math_answer("", "The total is 12", " 12 ") == 1.0
    assert math_answer("", "3 + 4 = 7, so 8", "7") == 0.0
    assert math_answer("", "none", "7") == 0.0
    assert math_answer("", "7", "seven") == 0.0
