"""Runs whose trainer is the Megatron backend, through the CLI as a user starts them.

On the CPU (Megatron-core's layers run there too): every publication verified on both
runtimes, the same training as the torch backend's (the same model, converted), the
checkpoint a Hugging Face directory transformers loads with Megatron's optimizer state
beside it, resume bitwise exact, two data-parallel ranks training as one. On a GPU (skipped
without CUDA): the embedded default learns, every publication verified, and resumes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_events.checkpoint.format import read_checkpoint
from miles_events.checkpoint.resume import latest_checkpoint
from schemas.events import (
    CriticStepFinished,
    EvalFinished,
    MemoryOffloaded,
    MemoryOnloaded,
    PublicationVerified,
    RunStarted,
    TrainStepFinished,
    WeightsStaged,
)
from tests.test_e2e import SMALL, events, published_versions, rollouts, run_cli
from tests.test_trainer_ranks_run import assert_two_ranks_train_what_one_trains, digests

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

MEGATRON = ('trainer.backend="megatron"',)
COMMON = (*SMALL, "run.num_rollout=3", "run.save_interval=2", "trainer.num_threads=1", 'run.runtime="local"')
"""Three rollouts, checkpoints after the second and the last."""
KL = ("trainer.use_kl_loss=true", "trainer.kl_loss_coef=0.1", "run.debug_exit_after_rollout=2")
PPO = ("trainer.use_critic=true", "run.debug_exit_after_rollout=2")
"""PPO: the critic is the torch backend's value model whichever backend trains the policy."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    made = {}
    for name, overrides in {
        "megatron": MEGATRON,
        "megatron-ray": (*MEGATRON, 'run.runtime="ray"'),
        "torch": (),
        "megatron-first-2": (*MEGATRON, "run.debug_exit_after_rollout=2"),
        "megatron-2-ranks": (*MEGATRON, "trainer.num_ranks=2", "run.debug_exit_after_rollout=2"),
        "megatron-kl": (*MEGATRON, *KL),
        "torch-kl": KL,
        "megatron-ppo": (*MEGATRON, *PPO),
        "torch-ppo": PPO,
    }.items():
        run_dir = tmp_path_factory.mktemp(name)
        made[name] = (run_dir, run_cli(run_dir, *COMMON, *overrides))
    return made


def ok(runs, name: str) -> Path:
    run_dir, result = runs[name]
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("name", ["megatron", "megatron-ray"])
def test_a_megatron_run_verifies_every_publication(runs, name):
    log = events(ok(runs, name))
    (started,) = [e for e in log if isinstance(e, RunStarted)]
    assert (started.trainer_ranks, started.trainer_sharding) == (1, "ddp")
    published = published_versions(log)
    assert published == ["1", "2", "3", "4"]
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == published


def test_the_megatron_backend_trains_what_the_torch_backend_trains(runs):
    megatron, torch_run = events(ok(runs, "megatron")), events(ok(runs, "torch"))
    # The first rollout is the same: the same base weights, converted, serve the same samples.
    assert rollouts(megatron)[0] == rollouts(torch_run)[0]
    assert digests(megatron)["1"] == digests(torch_run)["1"], (
        "the initial publication is the base model's bytes"
    )
    first = next(e.metrics for e in megatron if isinstance(e, TrainStepFinished))
    reference = next(e.metrics for e in torch_run if isinstance(e, TrainStepFinished))
    assert first.train_tokens == reference.train_tokens
    assert first.loss == pytest.approx(reference.loss, abs=1e-6)
    assert first.grad_norm == pytest.approx(reference.grad_norm, rel=1e-5)


def test_with_a_kl_loss_the_megatron_backend_trains_what_the_torch_backend_trains(runs):
    """The KL reference is Megatron's model too (built again: its modules hold process groups)."""
    megatron, torch_run = events(ok(runs, "megatron-kl")), events(ok(runs, "torch-kl"))
    steps = [e.metrics for e in megatron if isinstance(e, TrainStepFinished)]
    reference = [e.metrics for e in torch_run if isinstance(e, TrainStepFinished)]
    assert len(steps) == len(reference) == 2 and reference[1].kl > 0
    for got, expected in zip(steps, reference, strict=True):
        assert got.kl == pytest.approx(expected.kl, rel=1e-4, abs=1e-7)
        assert got.loss == pytest.approx(expected.loss, abs=1e-6)


def test_with_a_critic_the_megatron_policy_trains_on_its_advantages_as_the_torch_one(runs):
    megatron, torch_run = events(ok(runs, "megatron-ppo")), events(ok(runs, "torch-ppo"))
    assert [e.metrics for e in megatron if isinstance(e, CriticStepFinished)] == [
        e.metrics for e in torch_run if isinstance(e, CriticStepFinished)
    ], "the same critic on the same rollouts"
    steps = [e.metrics for e in megatron if isinstance(e, TrainStepFinished)]
    reference = [e.metrics for e in torch_run if isinstance(e, TrainStepFinished)]
    assert len(steps) == 2
    assert steps[0].loss == pytest.approx(reference[0].loss, abs=1e-6)
    assert steps[0].grad_norm == pytest.approx(reference[0].grad_norm, rel=1e-5)
    published = published_versions(megatron)
    assert published == [e.weight_version for e in megatron if isinstance(e, PublicationVerified)]


def test_a_megatron_checkpoint_is_what_the_torch_backend_saves(runs):
    """A Hugging Face directory transformers loads, and the optimizer state keyed by Hugging
    Face names (Megatron's fused parameters' moments split as the weights are)."""
    checkpoint = latest_checkpoint(ok(runs, "megatron"))
    assert checkpoint is not None
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    saved = read_checkpoint(checkpoint)
    for name, tensor in model.state_dict().items():
        if name in saved.weights:
            assert torch.equal(tensor, saved.weights[name]), name
    torch_saved = read_checkpoint(latest_checkpoint(ok(runs, "torch")))
    assert set(saved.optimizer["state"]) == set(torch_saved.optimizer["state"])
    for name, state in saved.optimizer["state"].items():
        assert state["exp_avg"].shape == saved.weights[name].shape, name


def test_a_megatron_checkpoint_resumes_on_the_torch_backend(runs, tmp_path):
    into = tmp_path / "run"
    shutil.copytree(ok(runs, "megatron-first-2"), into)
    before = events(into)
    result = run_cli(into, *COMMON, "run.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    second = events(into)[len(before) :]
    (started,) = [e for e in second if isinstance(e, RunStarted)]
    assert started.resumed and started.trainer_sharding == "none"
    assert [e.weight_version for e in second if isinstance(e, PublicationVerified)] == ["3", "4"]
    # The weights republished at the resume are the bytes the Megatron run published.
    assert next(e for e in second if isinstance(e, WeightsStaged)).digest == digests(before)["3"]


def test_a_resumed_megatron_run_ends_with_bitwise_the_weights_of_an_uninterrupted_one(runs, tmp_path):
    source = ok(runs, "megatron-first-2")
    into = tmp_path / "run"
    shutil.copytree(source, into)
    before = events(into)
    result = run_cli(into, *COMMON, *MEGATRON, "run.resume=true")
    assert result.returncode == 0, result.stderr[-3000:]
    second = events(into)[len(before) :]
    whole = events(ok(runs, "megatron"))
    assert rollouts(events(into)) == rollouts(whole)
    assert digests(events(into)) == digests(whole)
    assert [e.weight_version for e in second if isinstance(e, PublicationVerified)] == ["3", "4"]
    a = read_checkpoint(latest_checkpoint(ok(runs, "megatron")))
    b = read_checkpoint(latest_checkpoint(into))
    assert a.trainer_state.rollout_id == b.trainer_state.rollout_id == 2
    for name, tensor in a.weights.items():
        assert torch.equal(tensor, b.weights[name]), name
    for name, state in a.optimizer["state"].items():
        assert torch.equal(state["exp_avg"], b.optimizer["state"][name]["exp_avg"]), name


def test_rollout_only_from_a_megatron_checkpoint_proves_the_engines_serve_it(runs, tmp_path):
    checkpoints = ok(runs, "megatron") / "checkpoints"
    evidence = tmp_path / "evidence.json"
    result = run_cli(
        tmp_path / "run",
        *COMMON,
        *MEGATRON,
        "run.rollout_only_from_checkpoint=true",
        f'run.load="{checkpoints}"',
        f'run.rollout_only_publication_evidence="{evidence}"',
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the engines serve the checkpoint exactly" in result.stdout
    assert evidence.is_file()


def test_two_data_parallel_megatron_ranks_train_what_one_rank_trains(runs):
    two_dir, one_dir = ok(runs, "megatron-2-ranks"), ok(runs, "megatron-first-2")
    two_log = events(two_dir)
    (started,) = [e for e in two_log if isinstance(e, RunStarted)]
    assert started.trainer_ranks == 2
    assert_two_ranks_train_what_one_trains(two_dir, one_dir)


# --- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_embedded_default_learns_with_megatron_verified_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # The embedded default's batches (run_cli's are smaller), which learn in 20 to 30 rollouts.
    default = (
        "data.rollout_batch_size=64",
        "data.n_samples_per_prompt=64",
        "trainer.global_batch_size=1024",
        "trainer.micro_batch_size=1024",
    )
    on_gpu = (*default, *MEGATRON, 'run.runtime="local"', "run.save_interval=10", "run.eval_interval=10")
    result = run_cli(run_dir, *on_gpu, "run.num_rollout=40", "run.debug_exit_after_rollout=30", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    first = events(run_dir)
    result = run_cli(run_dir, *on_gpu, "run.num_rollout=40", "run.resume=true", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(run_dir)
    second = log[len(first) :]
    (started,) = [e for e in second if isinstance(e, RunStarted)]
    assert started.resumed
    trained = [e.rollout_id for e in log if isinstance(e, TrainStepFinished)]
    assert sorted(set(trained)) == list(range(40))
    published = published_versions(log)
    verified = [e.weight_version for e in log if isinstance(e, PublicationVerified)]
    assert published and sorted(set(verified), key=int) == sorted(set(published), key=int)
    evals = [e for e in log if isinstance(e, EvalFinished)]
    accuracy = [e.metrics["eval/accuracy"] for e in evals]
    assert accuracy[0] < 0.2 and accuracy[-1] >= 0.8, accuracy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_megatron_offloads_and_trains_as_in_place(tmp_path):
    """The seed's offload branch with the Megatron trainer: its state leaves the GPU while the
    engines generate and comes back, every publication verified, the first step the same as
    training in place (GPU kernels are not bitwise reproducible run to run)."""
    first_steps = {}
    for name, extra in {"plain": (), "offload": ("run.offload_train=true",)}.items():
        run_dir = tmp_path / name
        result = run_cli(run_dir, *COMMON, *MEGATRON, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        log = events(run_dir)
        published = published_versions(log)
        assert published == [e.weight_version for e in log if isinstance(e, PublicationVerified)]
        assert len(published) == 4
        first_steps[name] = next(e.metrics for e in log if isinstance(e, TrainStepFinished))
        if name == "offload":
            moved = [
                e for e in log if isinstance(e, MemoryOffloaded | MemoryOnloaded) and e.target == "actor"
            ]
            assert moved and all(p.bytes > 0 and p.device.startswith("cuda") for e in moved for p in e.parts)
    assert first_steps["offload"].loss == pytest.approx(first_steps["plain"].loss, abs=1e-4)
    assert first_steps["offload"].grad_norm == pytest.approx(first_steps["plain"].grad_norm, rel=1e-2)
