"""The CLI on bad input, in process: exit 2 with one line on stderr, before anything is
written (``--dry-run`` checks the same input)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_events.app.config import ConfigError
from miles_events.app.run import error_line, main

GOOD = '{"input": "1+1=", "label": "2"}\n'


@pytest.fixture(autouse=True)
def own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` sets defaults in the environment (logging, Hugging Face): keep them here."""
    monkeypatch.setattr(os, "environ", os.environ.copy())


def write_run(tmp_path: Path, eval_data: bytes) -> Path:
    (tmp_path / "prompts.jsonl").write_text(GOOD * 4)
    (tmp_path / "eval.jsonl").write_bytes(eval_data)
    config = tmp_path / "run.toml"
    config.write_text(
        '[run]\ndir = "run"\nruntime = "local"\nnum_rollout = 1\n'
        '[data]\nprompt_data = "prompts.jsonl"\neval_data = "eval.jsonl"\nrollout_batch_size = 2\n'
        "n_samples_per_prompt = 2\n[trainer]\nglobal_batch_size = 4\nmicro_batch_size = 4\n"
    )
    return config


def test_an_error_line_escapes_the_line_breaks_the_input_brings() -> None:
    error = ConfigError("run.toml: run.a\nb: unknown key, path /x\r\ny\u2028z\x0c")
    assert error_line(error) == "error: run.toml: run.a\\nb: unknown key, path /x\\r\\ny\\u2028z\\x0c"
    assert len(error_line(error).splitlines()) == 1


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
@pytest.mark.parametrize(
    ("eval_data", "expected"),
    [(b"\xff\n", ":1: not UTF-8 text (byte 0xff at offset 0)"), (b"", ": no prompts"), (b"[1]\n", ":1: needs the keys")],
)
def test_bad_eval_data_is_exit_2_with_one_line_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], eval_data: bytes, expected: str
) -> None:
    config = write_run(tmp_path, eval_data)
    assert main([str(config), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: data.eval_data: {tmp_path / 'eval.jsonl'}{expected}") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_dry_run_of_good_input_prints_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(write_run(tmp_path, GOOD.encode())), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "[data]" in out and err == ""
    assert not (tmp_path / "run").exists()


def test_a_dry_run_refuses_a_run_dir_holding_another_runs_checkpoints_as_the_run_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_run(tmp_path, GOOD.encode())
    checkpoint = tmp_path / "run" / "checkpoints" / "rollout_000004"
    checkpoint.mkdir(parents=True)
    assert main([str(config), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: run.dir {tmp_path / 'run'} holds another run's checkpoints (rollout_000004)")
    assert main([str(config), "--dry-run", "--set", "run.overwrite=true"]) == 0
    assert checkpoint.is_dir(), "a dry run moves nothing"


def test_an_unknown_log_level_is_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ.pop("MILES_LOG_LEVEL", None)
    assert main([str(write_run(tmp_path, GOOD.encode())), "--log-level", "loud"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", "error: --log-level: unknown level 'loud'; known: DEBUG, INFO, WARNING, ERROR, CRITICAL\n")
