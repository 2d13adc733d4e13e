"""The CLI on bad input, in process: exit 2 with one line on stderr, before anything is
written (``--dry-run`` checks the same input)."""

from __future__ import annotations

import os
import shutil
import signal
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


# --- what used to fail after the run directory was written, or pass unnoticed -------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_events.rl.hf_model import prepare_base_model
    from schemas.config import ModelConfig

    return prepare_base_model(ModelConfig(), tmp_path_factory.mktemp("model"), seed=3)


def truncated_model(model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return target


def main_within(seconds: int, argv: list[str]) -> int:
    """``main(argv)``, failing after ``seconds``: a FIFO opened for reading waits for a writer."""

    def too_long(signum: int, frame: object) -> None:
        raise TimeoutError(f"main did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(seconds)
    try:
        return main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# (an extra prompt line or None, --set overrides with {tmp} and {model} filled in, what the error line says;
# a config file's checks name the file and the --set first)
BAD_INPUT = {
    "a lone surrogate": (
        b'{"input": "1+\\ud800", "label": "2"}\n', [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: 'input' holds a lone surrogate ('\\ud800'), which is not text",
    ),
    "a null input": (b'{"input": null, "label": "2"}\n', [], "data.prompt_data: {tmp}/prompts.jsonl:5: 'input' is null"),
    "a chat-message list": (
        b'{"input": [{"role": "user", "content": "1+1="}], "label": "2"}\n', [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: 'input' is a list: chat-message lists are not supported yet; "
        "give the prompt as a string",
    ),
    "a prompt without tokens": (
        b'{"input": "abc", "label": "2"}\n', [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: the prompt 'abc' has no tokens with the built-in model's tokenizer",
    ),
    "a directory as the prompts": (
        None, ['data.prompt_data="{tmp}"'], "data.prompt_data: {tmp} is a directory, not a file"
    ),
    "a FIFO as the prompts": (
        None, ['data.prompt_data="{tmp}/fifo"'], "data.prompt_data: {tmp}/fifo is not a regular file (a FIFO)"
    ),
    "a missing model.path": (None, ['model.path="{tmp}/absent"'], "model.path: no such directory {tmp}/absent"),
    "truncated weights": (
        None, ['model.path="{model}"'], "model.path: {model}/model.safetensors: 5,000 bytes where its header's tensors end at"
    ),
    "one sample per prompt": (
        None, ["data.n_samples_per_prompt=1", "trainer.global_batch_size=2", "trainer.micro_batch_size=2"],
        "data.n_samples_per_prompt: 1 sample per prompt trains nothing",
    ),
    "more new tokens than positions": (
        None, ["rollout.max_new_tokens=859"],
        "rollout.max_new_tokens: 859 after the longest prompt (4 tokens, data.prompt_data {tmp}/prompts.jsonl:1) make "
        "863 tokens, more than the model's 64 positions (model.builtin.max_position_embeddings)",
    ),
    "a reward of the wrong signature": (
        None, ['rollout.reward_fn="tests.e2e_rewards.two_arguments"'],
        "rollout.reward_fn: tests.e2e_rewards.two_arguments takes (prompt, response), not (prompt, response, label)",
    ),
    "a raising reward": (
        None, ['rollout.reward_fn="tests.e2e_rewards.broken"'],
        "rollout.reward_fn: tests.e2e_rewards.broken raised ValueError: reward service unavailable, on the first prompt",
    ),
    "a reward that is not a number": (
        None, ['rollout.reward_fn="tests.e2e_rewards.text"'],
        "rollout.reward_fn: tests.e2e_rewards.text returned '1.0' (a str), not a number",
    ),
}


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_found_before_the_run_is_exit_2_with_one_line_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_dir: Path, flags: list[str], case: str
) -> None:
    line, overrides, expected = BAD_INPUT[case]
    config = write_run(tmp_path, GOOD.encode())
    if line is not None:
        (tmp_path / "prompts.jsonl").write_bytes((GOOD * 4).encode() + line)
    os.mkfifo(tmp_path / "fifo")
    model = truncated_model(model_dir, tmp_path) if case == "truncated weights" else model_dir
    sets = [arg for o in overrides for arg in ("--set", o.format(tmp=tmp_path, model=model))]
    assert main_within(120, [str(config), *sets, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and expected.format(tmp=tmp_path, model=model) in err, err
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_config_file_with_a_utf8_bom_runs_as_without(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was ``TOML syntax error: Invalid statement (at line 1, column 1)``."""
    config = write_run(tmp_path, GOOD.encode())
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    assert main([str(config), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "[data]" in out and err == ""
