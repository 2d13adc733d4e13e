"""End to end, as a user runs it: ``python -m miles_events.run examples/tiny.toml`` on each
runtime, resume, failures and bad input. Short runs (a few rollouts) of the embedded
default; the full learning run is the README's first command."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engine.worker import engine_worker
from actors.generator import Generator
from miles_events.app.config import load_config
from miles_events.app.run_series import run_series
from miles_events.app.session import Session
from miles_events.bus.event_log import read_events
from miles_events.checkpoint.format import read_checkpoint
from miles_events.checkpoint.resume import latest_checkpoint
from miles_events.rl.lr_schedule import LrSchedule
from miles_events.rl.probe import PROBE_TENSOR
from miles_events.rl.rewards import exact_match
from miles_events.runtime.leftovers import descendants
from schemas.events import (
    ActorFailed,
    CheckpointSaved,
    EvalFinished,
    PublicationMismatch,
    PublicationVerified,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TrainStepFinished,
    WeightsCheckFinished,
    WeightsPublished,
    WeightsStaged,
)
from tests.support import cmdline, not_console
from tests.test_replay_plot import png_size

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"

pytestmark = pytest.mark.slow

# Smaller rollouts than the embedded default: the tests check the loop, not the learning,
# and with 16 of the 55 prompts per rollout an epoch spans 3 rollouts.
SMALL = (
    "data.rollout_batch_size=16",
    "data.n_samples_per_prompt=8",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
)


# ``python -m miles_events.run`` that, as it exits, writes the top-level packages it imported
# to the file its first argument names.
RUN_RECORDING_IMPORTS = """
import atexit, pathlib, runpy, sys
out = pathlib.Path(sys.argv.pop(1))
atexit.register(lambda: out.write_text("\\n".join(sorted({m.partition(".")[0] for m in sys.modules}))))
sys.argv[0] = "miles_events.run"
runpy.run_module("miles_events.run", run_name="__main__", alter_sys=True)
"""


def run_cli(
    run_dir: Path,
    *overrides: str,
    flags: tuple[str, ...] = (),
    timeout: int = 300,
    imports: Path | None = None,
) -> subprocess.CompletedProcess:
    """The run's CLI; ``imports``: a file the driver writes its imported packages to."""
    command = ["-m", "miles_events.run"] if imports is None else ["-c", RUN_RECORDING_IMPORTS, str(imports)]
    args = [
        sys.executable,
        *command,
        str(TINY),
        "--set",
        f'run.dir="{run_dir}"',
        "--set",
        "metrics.port=0",
        *flags,
    ]
    for override in (*SMALL, *overrides):
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def events(run_dir: Path) -> list:
    return list(read_events(run_dir / "events.log"))


def rollouts(log: list) -> list[tuple[int, float, list[str]]]:
    return [(e.rollout_id, e.reward_mean, e.weight_versions) for e in log if isinstance(e, RolloutGenerated)]


def published_versions(log: list) -> list[str]:
    return [e.weight_version for e in log if isinstance(e, WeightsPublished)]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("local")
    result = run_cli(
        run_dir, 'run.runtime="local"', "run.num_rollout=3", "run.save_interval=2", "run.eval_interval=2"
    )
    return run_dir, result


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray")
    result = run_cli(
        run_dir, 'run.runtime="ray"', "run.num_rollout=3", "run.save_interval=2", "run.eval_interval=2",
        imports=run_dir.parent / "ray-driver-imports.txt",
    )  # fmt: skip
    return run_dir, result


@pytest.mark.parametrize("which", ["local_run", "ray_run"])
def test_a_short_run_completes_with_every_publication_verified(which, request):
    run_dir, result = request.getfixturevalue(which)
    assert result.returncode == 0, result.stderr[-2000:]
    log = events(run_dir)
    assert isinstance(log[0], RunStarted) and isinstance(log[-1], RunFinished)
    assert log[-1].status == "completed"
    assert published_versions(log) == ["1", "2", "3", "4"]
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == ["1", "2", "3", "4"]
    assert [r[0] for r in rollouts(log)] == [0, 1, 2]
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert "rollout 2 [3/3]" in result.stdout


def test_both_runtimes_make_the_same_run(local_run, ray_run):
    local_log, ray_log = events(local_run[0]), events(ray_run[0])
    assert rollouts(local_log) == rollouts(ray_log)
    assert published_versions(local_log) == published_versions(ray_log)

    def digests(log: list) -> list[tuple[str, str]]:
        return [(e.weight_version, e.digest) for e in log if isinstance(e, WeightsStaged)]

    assert digests(local_log) == digests(ray_log), "the same weights, bit for bit, on both runtimes"
    assert [type(e).__name__ for e in local_log if e.source == "coordinator"] == [
        type(e).__name__ for e in ray_log if e.source == "coordinator"
    ]


def test_the_ray_drivers_process_never_imports_torch(ray_run):
    """The driver hosts the Coordinator and the light actors, none of which needs torch: the
    built-in base model is built in the trainer's process, the Saver copies the staged file."""
    run_dir, result = ray_run
    assert result.returncode == 0, result.stderr[-2000:]
    imported = (run_dir.parent / "ray-driver-imports.txt").read_text().split()
    assert "ray" in imported and "msgspec" in imported  # what it wrote is the driver's
    assert not {"torch", "transformers", "safetensors"} & set(imported)
    assert (run_dir / "base_model" / "config.json").is_file()


@pytest.mark.parametrize("which", ["local_run", "ray_run"])
def test_the_last_checkpoint_loads_in_transformers_as_it_is(which, request):
    run_dir, _ = request.getfixturevalue(which)
    log = events(run_dir)
    saved = [e for e in log if isinstance(e, CheckpointSaved)]
    assert [e.rollout_id for e in saved] == [1, 2]  # interval, then forced on the last rollout
    path = latest_checkpoint(run_dir)
    assert path is not None and path.name == "rollout_000002"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("1+2=", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tokenizer)
    loaded = read_checkpoint(path)
    assert loaded.trainer_state.weight_version == "3" and loaded.trainer_state.rollout_id == 2


def test_the_recorded_log_redrives_to_the_same_decisions(local_run):
    run_dir, _ = local_run
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_events.replay",
            str(run_dir / "events.log"),
            "--redrive",
            "coordinator,verifier",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("same decisions") == 2


def test_the_log_keeps_a_few_samples_of_each_rollout_and_evaluation(local_run):
    run_dir, result = local_run
    assert result.returncode == 0, result.stderr[-2000:]
    log = events(run_dir)
    generated = [e for e in log if isinstance(e, RolloutGenerated)]
    evaluated = [e for e in log if isinstance(e, EvalFinished)]
    assert len(generated) == 3 and evaluated
    for event in generated:
        # 16 prompts of 8 samples each: the first sample of the first 4 prompts.
        assert [s.group for s in event.samples] == [0, 1, 2, 3]
    for event in (*generated, *evaluated):
        assert len(event.samples) == 4  # rollout.log_samples's default
        for kept in event.samples:
            # Arithmetic prompts are far shorter than rollout.log_sample_chars: kept whole.
            assert (kept.prompt_chars, kept.response_chars) == (len(kept.prompt), len(kept.response))
            assert kept.reward == exact_match(kept.prompt, kept.response, kept.label)
            assert 0 < kept.response_tokens <= 3 and kept.weight_version in event.weight_versions


def test_replay_plots_a_fresh_run_and_prints_its_samples(local_run, tmp_path):
    run_dir, _ = local_run
    log = events(run_dir)
    out = tmp_path / "run.png"
    plotted = subprocess.run(
        [sys.executable, "-m", "miles_events.replay", str(run_dir), "--plot", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
    assert png_size(out) == (1000, 1420), "six panels: the run reports its learning rate"
    [series] = run_series(log)
    assert series.reward_mean == [
        (e.rollout_id, e.reward_mean) for e in log if isinstance(e, RolloutGenerated)
    ]
    evaluated = [e for e in log if isinstance(e, EvalFinished)]
    assert series.eval_scores["eval/accuracy"] == [
        (e.rollout_id, e.metrics["eval/accuracy"]) for e in evaluated
    ]
    assert [step.rollout_id for step in series.step_times] == [0, 1, 2]
    assert all(step.wall >= step.generate + step.train + step.publish > 0 for step in series.step_times)

    printed = subprocess.run(
        [sys.executable, "-m", "miles_events.replay", str(run_dir), "--samples"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert lines[0].startswith("rollout 2: 4 of 128 samples kept, reward mean ")
    evals_at_last = sum(e.rollout_id == 2 for e in evaluated)
    assert sum(line.startswith("  [") for line in lines) == 4 * (1 + evals_at_last)
    assert sum(line.startswith("    response: ") for line in lines) == 4 * (1 + evals_at_last)


def test_resume_continues_with_the_same_rollouts_versions_and_weights(tmp_path):
    """Mid-way through a learning-rate schedule (two optimizer steps a rollout: a warmup of
    three, then a cosine decay over the run's eight): the same rates, the same weights."""
    common = (
        'run.runtime="local"',
        "run.num_rollout=4",
        "run.save_interval=2",
        "trainer.lr_warmup_steps=3",
        'trainer.lr_decay_style="cosine"',
        "trainer.min_lr=0.0001",
    )
    whole = run_cli(tmp_path / "whole", *common)
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = run_cli(tmp_path / "split", *common, "run.debug_exit_after_rollout=2")
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_cli(tmp_path / "split", *common, "run.resume=true")
    assert second.returncode == 0, second.stderr[-2000:]

    whole_log, split_log = events(tmp_path / "whole"), events(tmp_path / "split")
    starts = [e for e in split_log if isinstance(e, RunStarted)]
    assert [(s.start_rollout_id, s.resumed, s.weight_version) for s in starts] == [
        (0, False, "default"),
        (2, True, "2"),
    ]
    assert rollouts(split_log) == rollouts(whole_log)
    assert published_versions(split_log) == [
        "1",
        "2",
        "3",
        "3",
        "4",
        "5",
    ]  # "3" again: the resume republishes it
    assert published_versions(whole_log) == ["1", "2", "3", "4", "5"]
    a = read_checkpoint(latest_checkpoint(tmp_path / "whole"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "split"))
    # The resumed run saved under its own run id, in the lineage of the run it continued.
    (first, _second) = [e.run_id for e in split_log if isinstance(e, RunStarted)]
    assert b.trainer_state.lineage == first and a.trainer_state.lineage == a.trainer_state.run_id
    assert (
        msgspec.structs.replace(
            b.trainer_state, run_id=a.trainer_state.run_id, lineage=a.trainer_state.lineage
        )
        == a.trainer_state
    )
    for name, tensor in a.weights.items():
        assert torch.equal(tensor, b.weights[name]), name
    lrs = [e.metrics.lr for e in whole_log if isinstance(e, TrainStepFinished)]
    schedule = LrSchedule(
        lr=0.001, min_lr=0.0001, warmup_init=0.0, warmup_steps=3, decay_style="cosine", decay_steps=8
    )
    assert lrs == [schedule.lr_at(step) for step in (1, 3, 5, 7)], "each rollout's last step's rate"
    assert [e.metrics.lr for e in split_log if isinstance(e, TrainStepFinished)] == lrs


def test_a_run_publishes_through_the_disk_transport(tmp_path):
    result = run_cli(
        tmp_path,
        'run.runtime="local"',
        "run.num_rollout=1",
        'publisher.transport="disk"',
        "generator.num_engines=2",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    log = events(tmp_path)
    staged = [e for e in log if isinstance(e, WeightsStaged)]
    assert [e.weights.transport for e in staged] == ["disk", "disk"]
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == ["1", "2"]
    assert not (tmp_path / "transport").exists(), "the run's data-plane files are removed at its end"


def test_a_failing_handler_stops_the_run_with_one_clear_line(tmp_path):
    result = run_cli(
        tmp_path,
        'run.runtime="local"',
        "run.num_rollout=3",
        'rollout.reward_fn="tests.e2e_rewards.broken_after_the_first_call"',
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "actor generator failed" in error_lines[0] and "reward" in error_lines[0]
    log = events(tmp_path)
    assert any(isinstance(e, ActorFailed) and e.actor == "generator" for e in log)
    assert isinstance(log[-1], RunFinished) and log[-1].status == "failed"


# ``python -m miles_events.run`` on a disk that is full where checkpoints are written.
RUN_WITH_A_FULL_DISK = """
import errno, runpy, sys
import actors.saver
def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
actors.saver.write_checkpoint = no_space
sys.argv[0] = "miles_events.run"
runpy.run_module("miles_events.run", run_name="__main__", alter_sys=True)
"""


def test_a_full_disk_is_one_error_line_with_the_detail_in_the_run_log(tmp_path):
    args = [sys.executable, "-c", RUN_WITH_A_FULL_DISK, str(TINY), "--set", f'run.dir="{tmp_path}"']
    for override in (*SMALL, "metrics.port=0", 'run.runtime="local"', "run.num_rollout=3", "run.save_interval=1",
                     'console.mode="plain"'):  # fmt: skip
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    assert not_console(result.stdout) == []
    (error,) = result.stderr.splitlines()
    assert error.startswith(
        "error: run failed: checkpoint of rollout 0 failed: OSError: [Errno 28] No space left on device"
    )
    assert error.endswith(f"(log: {tmp_path / 'run.log'})")
    log = (tmp_path / "run.log").read_text()
    assert re.search(
        r"ERROR \[driver pid \d+\] actors.saver: checkpoint of rollout 0 failed: OSError", log
    ), log


def test_resume_with_every_checkpoint_corrupt_is_one_line_on_the_terminal(tmp_path):
    first = run_cli(tmp_path, 'run.runtime="local"', "run.num_rollout=2", "run.save_interval=1")
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = sorted((tmp_path / "checkpoints").glob("rollout_*"))
    for checkpoint in checkpoints:
        weights = checkpoint / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    result = run_cli(tmp_path, 'run.runtime="local"', "run.num_rollout=4", "run.resume=true")
    assert_one_line_exit_2(result, "run.resume: no checkpoint under")
    assert result.stdout == ""


def test_every_file_a_run_keeps_has_the_one_mode_of_the_rule(local_run):
    from miles_events.util.file_modes import KEPT_FILE_MODE

    run_dir, _ = local_run
    modes = {
        path.relative_to(run_dir): stat.S_IMODE(path.stat().st_mode)
        for path in run_dir.rglob("*")
        if path.is_file()
    }
    assert modes and {mode for mode in modes.values()} == {KEPT_FILE_MODE}, modes


def test_sigterm_while_ray_starts_aborts_with_exit_130(tmp_path):
    args = [
        sys.executable,
        "-m",
        "miles_events.run",
        str(TINY),
        "--set",
        f'run.dir="{tmp_path}"',
        "--set",
        "metrics.port=0",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    # As soon as Ray's raylet is up: the actors' processes have yet to import torch and
    # start, so the run's loop has not taken the signals over (a fixed sleep raced a
    # cluster that comes up in under a second).
    deadline = time.monotonic() + 60
    while not any(b"raylet" in cmdline(pid) for pid, _ in descendants(process.pid)):
        assert process.poll() is None and time.monotonic() < deadline, "Ray never started"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "error: aborted"


def test_a_nan_reward_stops_the_run_with_one_line_naming_the_rollout(tmp_path):
    result = run_cli(
        tmp_path,
        'run.runtime="local"',
        "run.num_rollout=3",
        'rollout.reward_fn="tests.e2e_rewards.nan_when_wrong"',
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "rollout 0: non-finite reward in" in line and "(nan)" in line
    log = events(tmp_path)
    assert not [e for e in log if isinstance(e, TrainStepFinished)]
    assert [e.weight_version for e in log if isinstance(e, WeightsPublished)] == ["1"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("run.num_rolout=3", "run.num_rolout"),
        ('run.num_rollout="many"', "run.num_rollout"),
        ('data.prompt_data="missing.jsonl"', "missing.jsonl"),
        ('rollout.reward_fn="no.such.module.fn"', "no.such.module"),
        ('run.dir="/dev/null/run"', "run.dir /dev/null/run"),
        (
            'generator.engine="no_such_engine"',
            "generator.engine: unknown engine 'no_such_engine'; known: sglang, torch, vllm",
        ),
        (
            'trainer.backend="no_such_backend"',
            "trainer.backend: unknown trainer backend 'no_such_backend'; known: megatron, torch",
        ),
        (
            "model.builtin.hidden_size=100000000",
            "model.builtin: 30,000,080,900,000,000 parameters (hidden_size 100000000",
        ),
        (
            "model.builtin.num_attention_heads=3",
            "model.builtin.num_attention_heads: 3 must divide model.builtin.hidden_size (128)",
        ),
        ("model.builtin.num_key_value_heads=3", "model.builtin.num_key_value_heads: 3 must divide"),
        ("run.seed=-1", "run.seed: must be 0 to 2**63 - 1, got -1"),
        ("run.seed=9223372036854775808", "run.seed: must be 0 to 2**63 - 1, got 9223372036854775808"),
        ("trainer.lr=inf", "trainer.lr: must be a finite number, got inf"),
        ("trainer.entropy_coef=nan", "trainer.entropy_coef: must be a finite number, got nan"),
        ('rollout.reward_fn=".relative.fn"', "rollout.reward_fn: '.relative.fn' is not a dotted path"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, override, expected):
    result = run_cli(tmp_path / "run", override)  # a later --set wins
    assert_one_line_exit_2(result, expected)
    assert not (tmp_path / "run").exists()


def assert_one_line_exit_2(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.stderr


GOOD_LINE = b'{"input": "1+1=", "label": "2"}\n'


@pytest.mark.parametrize(
    ("key", "content", "expected"),
    [
        (
            "data.eval_data",
            GOOD_LINE + b'{"input": "\xff"}\n',
            "data.eval_data: {path}:2: not UTF-8 text (byte 0xff",
        ),
        ("data.eval_data", b"", "data.eval_data: {path}: no prompts"),
        ("data.eval_data", b"{oops\n", "data.eval_data: {path}:1: not valid JSON"),
        (
            "data.eval_data",
            b'{"question": "1+1="}\n',
            "data.eval_data: {path}:1: needs the keys 'input' and 'label'",
        ),
        (
            "data.prompt_data",
            GOOD_LINE + b"\xc3\x28\n",
            "data.prompt_data: {path}:2: not UTF-8 text (byte 0xc3",
        ),
        (
            "data.prompt_data",
            b"[" * 100_000 + b"\n",
            "data.prompt_data: {path}:1: not usable JSON (nested too deeply)",
        ),
    ],
)
@pytest.mark.parametrize("flags", [(), ("--dry-run",)])
def test_bad_input_data_files_are_one_line_exit_2_and_write_nothing(tmp_path, key, content, expected, flags):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    result = run_cli(tmp_path / "run", f'{key}="{path}"', flags=flags)
    assert_one_line_exit_2(result, expected.format(path=path))
    assert result.stdout == ""
    assert not (tmp_path / "run").exists()


def test_bad_input_leaves_an_existing_run_dir_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "kept.txt").write_text("a previous run's file\n")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_bytes(b"\xff\xfe")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = run_cli(run_dir, f'data.eval_data="{eval_file}"', "run.resume=true")
    assert_one_line_exit_2(result, "data.eval_data")
    assert sorted(run_dir.rglob("*")) == [run_dir / "checkpoints", run_dir / "checkpoints" / "kept.txt"]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_dry_run_prints_the_resolved_config_and_runs_nothing(tmp_path):
    result = run_cli(tmp_path / "run", "run.num_rollout=7", flags=("--dry-run",))
    assert result.returncode == 0
    assert "num_rollout = 7" in result.stdout and "[trainer]" in result.stdout
    assert not (tmp_path / "run").exists()


def faulty_at_version_3(damage):  # type: ignore[no-untyped-def]
    """An engine-worker factory whose last engine applies ``damage(norm weight)`` right
    after loading version 3, as a faulty transport or loader would."""

    def build(config, transport, place):  # type: ignore[no-untyped-def]
        worker = engine_worker(config, transport, place)
        if place.rank == config.generator.num_engines - 1:
            faulty = worker.engine
            real_load = faulty.load_weights

            def load_weights(weights, weight_version):  # type: ignore[no-untyped-def]
                loaded = real_load(weights, weight_version)
                if weight_version == "3":
                    with torch.no_grad():
                        damage(faulty.model.get_parameter("model.norm.weight"))
                return loaded

            faulty.load_weights = load_weights  # type: ignore[method-assign]
        return worker

    return build


def nudge_one_element(weight: torch.Tensor) -> None:
    weight[0] += 1e-3


def halve(weight: torch.Tensor) -> None:
    weight.mul_(0.5)


class CorruptingGenerator(Generator):
    build_worker = staticmethod(faulty_at_version_3(nudge_one_element))


@pytest.mark.parametrize("continue_on_mismatch", [False, True])
def test_an_engine_serving_different_weights_is_caught(tmp_path, continue_on_mismatch):
    from actors.coordinator import Coordinator
    from actors.publisher import Publisher
    from actors.saver import Saver
    from actors.trainer import Trainer
    from actors.verifier import Verifier

    config = load_config(
        TINY,
        [
            *SMALL,
            f'run.dir="{tmp_path}"',
            "metrics.port=0",
            'run.runtime="local"',
            "run.num_rollout=4",
            "generator.num_engines=2",
            f"verifier.continue_on_mismatch={str(continue_on_mismatch).lower()}",
        ],
    )
    session = Session(config, [CorruptingGenerator, Trainer, Publisher, Verifier, Saver, Coordinator])
    result = asyncio.run(session.run())
    log = events(tmp_path)
    mismatches = [e for e in log if isinstance(e, PublicationMismatch)]
    assert [m.weight_version for m in mismatches][:1] == ["3"]
    assert [(m.engine, m.tensor) for m in mismatches[0].mismatches] == [("engine-1", "model.norm.weight")]
    if continue_on_mismatch:
        assert result.finished.status == "completed"
    else:
        assert result.finished.status == "failed"
        assert "engine-1 model.norm.weight" in result.finished.reason
        assert not [e for e in log if isinstance(e, RolloutGenerated) and e.rollout_id >= 2]


class HalvingGenerator(Generator):
    """Its last engine halves the final norm while loading version 3 (a loader that scales
    a tensor it should have copied)."""

    build_worker = staticmethod(faulty_at_version_3(halve))


def test_the_probe_catches_a_corruption_the_digests_leave_out(tmp_path):
    """The engine's digests skip the tensor it corrupts (as vLLM's leave out the linears it
    cannot read back): only the behavioural probe can see it, and does."""
    from actors.coordinator import Coordinator
    from actors.publisher import Publisher
    from actors.saver import Saver
    from actors.trainer import Trainer
    from actors.verifier import Verifier

    config = load_config(TINY, [
        *SMALL, f'run.dir="{tmp_path}"', "metrics.port=0", 'run.runtime="local"', "run.num_rollout=4",
        "generator.num_engines=2", 'verifier.probe="on"', 'verifier.skip_tensor_list=["model.norm"]',
    ])  # fmt: skip
    session = Session(config, [HalvingGenerator, Trainer, Publisher, Verifier, Saver, Coordinator])
    result = asyncio.run(session.run())
    log = events(tmp_path)
    verified = [e for e in log if isinstance(e, PublicationVerified)]
    assert [e.weight_version for e in verified] == ["1", "2"]
    assert all(e.probe_max_diff is not None and e.probe_max_diff < 1e-5 for e in verified)
    (mismatch,) = [e for e in log if isinstance(e, PublicationMismatch)]
    assert mismatch.weight_version == "3"
    assert len(set(mismatch.engine_digests.values())) == 1, "the digests agree"
    assert [(m.engine, m.tensor) for m in mismatch.mismatches] == [("engine-1", PROBE_TENSOR)]
    assert "differ by up to" in mismatch.mismatches[0].reason
    assert result.finished.status == "failed"


def rank_repeating_engine(config, transport, place):  # type: ignore[no-untyped-def]
    """Its last engine answers the checksum action after loading version 2 with its rank 0
    reported twice (a reply whose second copy could hide what the first says)."""
    worker = engine_worker(config, transport, place)
    if place.rank == config.generator.num_engines - 1:
        engine = worker.engine
        real = engine.checksums

        def checksums(skip_tensor_list=(), selector="all"):  # type: ignore[no-untyped-def]
            report = real(skip_tensor_list, selector)
            if engine.weight_version != "2":
                return report
            return msgspec.structs.replace(report, ranks=[*report.ranks, *report.ranks])

        engine.checksums = checksums  # type: ignore[method-assign]
    return worker


class RankRepeatingGenerator(Generator):
    build_worker = staticmethod(rank_repeating_engine)


def test_a_checksum_reply_that_repeats_a_rank_fails_the_publication_as_a_mismatch(tmp_path):
    from actors.coordinator import Coordinator
    from actors.publisher import Publisher
    from actors.saver import Saver
    from actors.trainer import Trainer
    from actors.verifier import Verifier

    config = load_config(TINY, [
        *SMALL, f'run.dir="{tmp_path}"', "metrics.port=0", 'run.runtime="local"', "run.num_rollout=3",
        "generator.num_engines=2",
    ])  # fmt: skip
    session = Session(config, [RankRepeatingGenerator, Trainer, Publisher, Verifier, Saver, Coordinator])
    result = asyncio.run(session.run())
    log = events(tmp_path)
    assert not [e for e in log if isinstance(e, ActorFailed)]
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == ["1"]
    (mismatch,) = [e for e in log if isinstance(e, PublicationMismatch)]
    assert mismatch.weight_version == "2"
    why = "engine-1: the checksum reply reports rank 0 twice"
    assert [(m.engine, m.tensor, m.reason) for m in mismatch.mismatches] == [("engine-1", "*", why)]
    assert result.finished.status == "failed" and why in result.finished.reason


def no_op_load_engine(config, transport, place):  # type: ignore[no-untyped-def]
    """An engine whose load bumps the version and writes nothing (the bug class of a
    version bump without a transfer)."""
    worker = engine_worker(config, transport, place)
    engine = worker.engine

    def load_weights(weights, weight_version):  # type: ignore[no-untyped-def]
        engine._weight_version = str(weight_version)
        return weights.num_bytes

    engine.load_weights = load_weights  # type: ignore[method-assign]
    return worker


class NoOpLoadGenerator(Generator):
    build_worker = staticmethod(no_op_load_engine)


def no_op_run(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    from actors.coordinator import Coordinator
    from actors.publisher import Publisher
    from actors.saver import Saver
    from actors.trainer import Trainer
    from actors.verifier import Verifier

    config = load_config(
        TINY,
        [
            *SMALL,
            f'run.dir="{tmp_path}"',
            "metrics.port=0",
            'run.runtime="local"',
            "run.num_rollout=3",
            *overrides,
        ],
    )
    session = Session(config, [NoOpLoadGenerator, Trainer, Publisher, Verifier, Saver, Coordinator])
    return asyncio.run(session.run()), events(tmp_path)


def test_a_load_that_writes_nothing_fails_the_first_publication_without_any_check(tmp_path):
    """Trainer and engine start from the same base model, so the first publication's digests
    agree whether or not the engine wrote anything: the publication's canary, which only a
    load that applies the payload holds, fails it (no snapshot or reset needed)."""
    result, log = no_op_run(tmp_path)
    assert not [e for e in log if isinstance(e, PublicationVerified)]
    (mismatch,) = [e for e in log if isinstance(e, PublicationMismatch)]
    assert mismatch.weight_version == "1"
    assert mismatch.engine_digests["engine-0"] == mismatch.expected_digest  # the digests agree
    assert [m.tensor for m in mismatch.mismatches] == ["miles_events.publication_canary"]
    assert result.finished.status == "failed" and not [e for e in log if isinstance(e, RolloutGenerated)]


def test_every_publication_of_a_real_run_proves_its_write(local_run):
    run_dir, _ = local_run
    verified = [e for e in events(run_dir) if isinstance(e, PublicationVerified)]
    assert verified and {e.write_proof for e in verified} == {"canary"}


def test_with_check_weight_update_equal_a_load_that_writes_nothing_fails_the_first_publication(tmp_path):
    result, log = no_op_run(tmp_path, "verifier.check_weight_update_equal=true")
    checks = [(e.action, e.success) for e in log if isinstance(e, WeightsCheckFinished)]
    assert checks[:2] == [("snapshot", True), ("reset_tensors", True)]
    assert [e.weight_version for e in log if isinstance(e, PublicationMismatch)] == ["1"]
    assert result.finished.status == "failed" and not [e for e in log if isinstance(e, RolloutGenerated)]


def test_check_weight_update_equal_passes_a_real_run(tmp_path):
    config = load_config(
        TINY,
        [
            *SMALL,
            f'run.dir="{tmp_path}"',
            "metrics.port=0",
            'run.runtime="local"',
            "run.num_rollout=1",
            "verifier.check_weight_update_equal=true",
        ],
    )
    from miles_events.app.roster import ACTORS

    result = asyncio.run(Session(config, list(ACTORS)).run())
    log = events(tmp_path)
    checks = [(e.action, e.success) for e in log if isinstance(e, WeightsCheckFinished)]
    assert checks == [("snapshot", True), ("reset_tensors", True), ("compare", True)]
    assert result.finished.status == "completed"


def test_sigint_stops_after_the_current_steps_save_and_publication(tmp_path):
    """As the seed's ``should_stop`` break: the step in flight is trained and published; no
    rollout after it starts; the run ends stopped, exit 0. The stop saves that step (no
    interval save is due), so the resumed run redoes nothing."""
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{tmp_path}"']
    for override in (
        *SMALL,
        "metrics.port=0",
        'run.runtime="local"',
        "run.num_rollout=50",
        "run.save_interval=100",
        "run.eval_interval=100",
        'console.mode="plain"',
        "tracking.tensorboard=true",
    ):
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("rollout 0 [1/50]"):
                process.send_signal(signal.SIGINT)
                break
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err
    log = events(tmp_path)
    [finished] = [e for e in log if isinstance(e, RunFinished)]
    assert finished.status == "stopped" and finished.reason == "interrupted by signal"
    trained = [e.rollout_id for e in log if isinstance(e, TrainStepFinished)]
    last = trained[-1]
    assert [e.rollout_id for e in log if isinstance(e, RolloutGenerated)] == trained, (
        "no rollout after the stop"
    )
    assert last in [e.rollout_id for e in log if isinstance(e, WeightsPublished)]
    assert [(e.rollout_id, e.reason) for e in log if isinstance(e, SaveRequested)] == [(last, "stop")]
    assert last in [e.rollout_id for e in log if isinstance(e, CheckpointSaved)]
    assert finished.last_rollout_id == last and finished.weight_version == str(last + 2)
    assert f"run stopped after rollout {last} [{last + 1}/50]" in out
    resumed = run_cli(
        tmp_path,
        'run.runtime="local"',
        "run.num_rollout=" + str(last + 3),
        "run.save_interval=100",
        "run.eval_interval=100",
        "run.resume=true",
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    second = [e for e in events(tmp_path) if e.run_id != finished.run_id]
    assert [e.rollout_id for e in second if isinstance(e, TrainStepFinished)] == [last + 1, last + 2]
    (started,) = [e for e in second if isinstance(e, RunStarted)]
    assert started.weight_version == str(last + 1)  # republishes the stopped run's last weights as "last + 2"
    # Tracking is finished on this exit path too: the event files hold the last rollout.
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_a_second_signal_cuts_a_long_step_at_its_next_cancellation_point(tmp_path, runtime):
    """A rollout generated one sequence at a time takes minutes; the first SIGINT waits for
    it, the second cuts it at the next decode step: nothing of it is kept, exit 0."""
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{tmp_path}"']
    for override in (
        "metrics.port=0",
        f'run.runtime="{runtime}"',
        "rollout.max_batch_size=1",
        'console.mode="plain"',
    ):
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("eval at rollout 0"):
                break
        time.sleep(1.0)  # rollout 0 (4096 sequences, one at a time) is being generated
        process.send_signal(signal.SIGINT)
        time.sleep(1.0)
        cut_at = time.monotonic()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
        took = time.monotonic() - cut_at
    finally:
        process.kill()
    assert process.returncode == 0, err[-2000:]
    log = events(tmp_path)
    (cancelled,) = [e for e in log if isinstance(e, StepCancelled)]
    assert (cancelled.rollout_id, cancelled.phase) == (0, "generate")
    assert not [e for e in log if isinstance(e, RolloutGenerated | TrainStepFinished)]
    (finished,) = [e for e in log if isinstance(e, RunFinished)]
    assert finished.status == "stopped" and finished.last_rollout_id == -1
    assert took < 30, f"the cut took {took:.1f}s"


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_a_step_cut_after_the_grace_period_ends_the_process_at_once(tmp_path, runtime):
    """``run.stop_grace_seconds = 2``: one SIGINT in a long step; 2 s later the step is cut
    (``StopRequested(now=True)``), the run stops, and the process is gone right after the
    cut: nothing after the run's own shutdown (the actors', Ray's, the sinks') holds it."""
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{tmp_path}"']
    for override in ("metrics.port=0", f'run.runtime="{runtime}"', "rollout.max_batch_size=1", 'console.mode="plain"',
                     "run.stop_grace_seconds=2"):  # fmt: skip
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("eval at rollout 0"):
                break
        time.sleep(0.5)  # rollout 0 (4096 sequences, one at a time) is being generated
        signalled = time.time()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
        exited = time.time()
    finally:
        process.kill()
    assert process.returncode == 0, err[-2000:]
    log = events(tmp_path)
    (cut,) = [e for e in log if isinstance(e, StopRequested) and e.now]
    (cancelled,) = [e for e in log if isinstance(e, StepCancelled)]
    (finished,) = [e for e in log if isinstance(e, RunFinished)]
    assert finished.status == "stopped" and cut.reason.endswith("(the step was cut after 2s)")
    assert signalled + 2 <= cut.time <= cancelled.time <= finished.time <= exited
    took = exited - cut.time
    assert took < EXIT_AFTER_CUT[runtime], f"the process exited {took:.1f}s after the cut"


EXIT_AFTER_CUT = {"local": 2.0, "ray": 4.0}
"""Seconds from a step's cut to the process's exit, at most, on a busy host: measured on an
idle one, 0.2 s on the local runtime and 0.7 s on ray (0.6 of it Ray's own shutdown); the
interpreter's teardown, a full garbage collection of the start-up heap, added 1.5-2 s."""


def test_py_spy_dumps_the_driver_and_every_actor_process_periodically(tmp_path):
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{tmp_path}"']
    # The loop must outlast one interval plus a round of dumps (about 0.3 s a rollout here).
    # The saver in a process of its own too: every process is dumped, the light actors on the
    # driver with it.
    overrides = (*SMALL, "metrics.port=0", 'run.runtime="ray"', "run.num_rollout=30", 'console.mode="quiet"',
                 'ray.own_process=["saver"]')  # fmt: skip
    for override in overrides:
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MILES_DEBUG_PYSPY_DUMP_INTERVAL="0.5")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    dumped = {path.name.split("-")[1] for path in (tmp_path / "pyspy").glob("*.txt")}
    assert dumped == {"driver", "generator", "trainer", "saver"}, dumped


def test_a_bad_py_spy_interval_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MILES_DEBUG_PYSPY_DUMP_INTERVAL="soon")
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{tmp_path / "run"}"']
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: MILES_DEBUG_PYSPY_DUMP_INTERVAL='soon' is not a number of seconds"
    ]
