"""Write the prompt files of the math task: arithmetic word problems in two difficulty levels.

Each row is a chat (one user message) with the answer as its label, its level, and the
operations it takes::

    {"prompt": [{"role": "user", "content": "Sara has 7 pencils. She buys 5 more pencils.
      How many pencils does Sara have now?"}], "label": "12", "level": 1, "ops": "+"}

- Level 1 takes one operation: adding, taking away, or multiplying (boxes of equal
  contents), with small numbers.
- Level 2 takes two: a change and then another (``a - b + c``, ``a + b - c``), or equal
  boxes and then some more or fewer (``a * b + c``, ``a * b - c``).

The held-out eval file holds problems none of whose texts is in the training file, half of
each level. Both files are drawn from fixed seeds, so running this script twice writes the
same bytes. The reward is ``miles_events.rl.rewards.math_answer``: the answer in the
reply's last ``\\boxed{}``, else its last number.

Usage: ``python examples/make_math_data.py [--out-dir DIR] [--train N] [--eval N]``; by
default it writes ``examples/data/math_train.jsonl`` and ``examples/data/math_eval.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE = "math_train.jsonl"
EVAL_FILE = "math_eval.jsonl"
TRAIN_SEED = 2026
EVAL_SEED = 7

NAMES = ("Tom", "Sara", "Ben", "Lily", "Sam", "Anna", "Max", "Mia", "Leo", "Emma", "Noah", "Zoe")
ITEMS = (
    "apples",
    "pencils",
    "books",
    "stickers",
    "marbles",
    "cookies",
    "cards",
    "shells",
    "balloons",
    "stamps",
)


Problem = tuple[str, int, str]
"""The question, its answer, and the operations it takes (``"+"``, ``"-+"``...)."""


def _one_step(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    kind = r.choice("+-*")
    if kind == "+":
        a, b = r.randint(2, 15), r.randint(2, 15)
        return (
            f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
            a + b,
            "+",
        )
    if kind == "-":
        a = r.randint(6, 20)
        b = r.randint(1, a - 1)
        return (
            f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?",
            a - b,
            "-",
        )
    a, b = r.randint(2, 9), r.randint(2, 9)
    return f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?", a * b, "*"


def _two_steps(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    kind = r.choice(("-+", "+-", "*+", "*-"))
    if kind == "-+":
        a = r.randint(6, 20)
        b, c = r.randint(1, a - 1), r.randint(2, 12)
        text = f"{name} has {a} {item}. {name} gives away {b} {item} and then buys {c} more. How many {item} does {name} have now?"
        return text, a - b + c, kind
    if kind == "+-":
        a, b = r.randint(2, 15), r.randint(2, 15)
        c = r.randint(1, a + b - 1)
        text = f"{name} has {a} {item}. {name} gets {b} more {item} and then loses {c}. How many {item} does {name} have now?"
        return text, a + b - c, kind
    a, b = r.randint(2, 6), r.randint(2, 6)
    if kind == "*+":
        c = r.randint(1, 9)
        text = f"There are {a} boxes with {b} {item} in each box, and {c} more {item} outside the boxes. How many {item} are there in total?"
        return text, a * b + c, kind
    c = r.randint(1, a * b - 1)
    text = f"There are {a} boxes with {b} {item} in each box. {c} {item} are taken out. How many {item} are left?"
    return text, a * b - c, kind


MAX_MISSES = 10_000
"""Draws in a row that repeat a problem after which there are taken to be no new ones."""

LEVELS: dict[int, Callable[[random.Random], Problem]] = {1: _one_step, 2: _two_steps}


def problems(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``count`` distinct problems (half of each level, alternating), none of whose texts
    is in ``exclude``."""
    r = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    misses = 0  # draws in a row that gave a problem already drawn
    while len(rows) < count:
        level = 1 + len(rows) % 2
        text, answer, ops = LEVELS[level](r)
        if text in seen:
            misses += 1
            if misses > MAX_MISSES:
                raise ValueError(f"cannot draw {count} distinct problems: ask for fewer")
            continue
        misses = 0
        seen.add(text)
        rows.append(
            {"prompt": [{"role": "user", "content": text}], "label": str(answer), "level": level, "ops": ops}
        )
    return rows


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """One JSON object per line, keys in a fixed order, ``\\n`` line ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record) + "\n" for record in records)
    path.write_text(text, encoding="utf-8", newline="\n")


def write_task(
    out_dir: Path = DEFAULT_OUT_DIR, train: int = 4000, eval_count: int = 200
) -> tuple[Path, Path]:
    """Write the training and held-out eval files and return their paths."""
    train_rows = problems(train, TRAIN_SEED)
    texts = frozenset(row["prompt"][0]["content"] for row in train_rows)
    eval_rows = problems(eval_count, EVAL_SEED, exclude=texts)
    train_path, eval_path = out_dir / TRAIN_FILE, out_dir / EVAL_FILE
    write_jsonl(train_path, train_rows)
    write_jsonl(eval_path, eval_rows)
    return train_path, eval_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--train", type=int, default=4000, help="training problems (default 4000)")
    parser.add_argument("--eval", type=int, default=200, help="held-out eval problems (default 200)")
    args = parser.parse_args(argv)
    for path in write_task(args.out_dir, args.train, args.eval):
        print(path)


if __name__ == "__main__":
    main()
