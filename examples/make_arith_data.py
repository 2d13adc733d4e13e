"""Write the prompt files of the built-in task: single-digit addition with a single-digit sum.

Each problem is ``"a+b="`` with digits ``a`` and ``b`` and ``a + b <= 9``; the label is the
sum as a string (``{"input": "3+4=", "label": "7"}``). That is 55 problems, every one a
four-token prompt in the built-in character tokenizer and a one-digit answer, so a reply
scored by ``miles_events.rl.rewards.exact_match`` is right only when it is the digit followed
by ``<eos>``.

The sum is capped at 9 so that the answer is one token: from a random init exact match
then succeeds by chance about once in 170 samples (the digit then ``<eos>``, give or take
skipped special tokens), which GRPO climbs from to a mean reward above 0.9 in 20-35
rollouts. With two-digit sums (all 100 pairs) an answer needs three right tokens, and the
same recipe is still near 0.6 after 45 rollouts.

The task is a lookup table small enough to sample whole, so the eval file holds the same
55 problems as the training file: eval measures how well the table has been learned, not
generalisation. Both files are written in a fixed order (the data loader shuffles per
epoch), so running this script twice writes the same bytes.

Usage: ``python examples/make_arith_data.py [--out-dir DIR] [--max-sum N]``; by default it
writes ``examples/data/arith_train.jsonl`` and ``examples/data/arith_eval.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE = "arith_train.jsonl"
EVAL_FILE = "arith_eval.jsonl"


def addition_problems(max_sum: int = 9) -> list[dict[str, str]]:
    """Every ``a+b=`` with digits ``a``, ``b`` and ``a + b <= max_sum``, in (a, b) order."""
    if not 0 <= max_sum <= 18:
        raise ValueError(f"max_sum must be between 0 and 18, got {max_sum}")
    return [
        {"input": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10) if a + b <= max_sum
    ]


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    """One JSON object per line, keys in a fixed order, ``\\n`` line ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record) + "\n" for record in records)
    path.write_text(text, encoding="utf-8", newline="\n")


def write_task(out_dir: Path = DEFAULT_OUT_DIR, max_sum: int = 9) -> tuple[Path, Path]:
    """Write the training and eval files (the same problems) and return their paths."""
    problems = addition_problems(max_sum)
    train_path, eval_path = out_dir / TRAIN_FILE, out_dir / EVAL_FILE
    write_jsonl(train_path, problems)
    write_jsonl(eval_path, problems)
    return train_path, eval_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--max-sum", type=int, default=9, help="largest sum a+b (default 9)")
    args = parser.parse_args(argv)
    for path in write_task(args.out_dir, args.max_sum):
        print(path)


if __name__ == "__main__":
    main()
