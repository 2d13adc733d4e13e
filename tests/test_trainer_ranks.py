"""The PyTorch backend as N ranks of a process group (FSDP2, DDP) against one process.

Each rank is a process spawned here, meeting the others at a TCP store this process holds,
and trains a ``TorchTrainerBackend`` over a ``ProcessGroup``, as the Trainer's ranks do.
Tolerance: the ranks add the same per-token terms in another order (each rank's part, then
the reduction across ranks), so float32 gradients differ in their last bits (the gradient
norms agree to 1e-6 relative). Adam's first steps divide each gradient element by its own
magnitude: an element whose gradient is rounding noise (near 0) moves by up to ``lr`` either
way, so no element-wise bound holds. What is compared is the whole update, the weights'
change from the base model: the two updates differ by at most ``UPDATE_TOLERANCE`` of its
L2 norm (measured: 3e-6 to 3e-5 over two rollouts of two steps each at lr 1e-2).
"""

from __future__ import annotations

import datetime
import math
import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from actors.trainer import Trainer
from actors.trainer_backend.grpo import expand_advantages, policy_loss
from actors.trainer_backend.parallel import ProcessGroup, by_index, by_name, share
from actors.trainer_backend.torch_backend import TorchTrainerBackend
from miles_events.bus.actor import RankFailed
from miles_events.bus.testing import RecordingContext
from miles_events.rl.finite import NonFiniteError
from schemas.config import Config, DataConfig, ModelConfig, RunConfig, TrainerConfig
from schemas.events import RolloutGenerated, StepCancelled, StopRequested, TrainStepFinished
from schemas.rollout import RolloutBatch, Sample

SEED = 11
UPDATE_TOLERANCE = 1e-4
"""The L2 norm of the difference of two runs' updates, relative to the update's."""
TIMEOUT = 120.0


def make_config(model: Path, **trainer: Any) -> Config:
    trainer.setdefault("lr", 1e-2)
    trainer.setdefault("shared_prompts", False)
    return Config(
        run=RunConfig(dir="unused", seed=SEED, runtime="local"),
        model=ModelConfig(path=str(model)),
        data=DataConfig(rollout_batch_size=4, n_samples_per_prompt=2),
        trainer=TrainerConfig(**trainer),
    )


def rollout(rollout_id: int, count: int) -> RolloutBatch:
    """``count`` samples in groups of two, responses of differing lengths, rewards that differ
    within each group (every sample has an advantage)."""
    generator = torch.Generator().manual_seed(rollout_id)
    samples = []
    for i in range(count):
        length = 2 + (i * 3 + rollout_id) % 5
        response = torch.randint(4, 16, (length,), generator=generator).tolist()
        samples.append(
            Sample(
                index=i // 2,
                group=i // 2,
                prompt="",
                label="",
                prompt_ids=[4, 13 + i % 3, 5, 16],
                response_ids=response,
                response_logprobs=[-1.0] * length,
                response="",
                reward=float((i * 7 + rollout_id) % 3),
                weight_version="default",
                engine="test",
                finish_reason="stop",
            )
        )
    return RolloutBatch(rollout_id=rollout_id, samples=samples)


def train_rank(
    rank: int,
    world_size: int,
    port: int,
    config_json: bytes,
    batches: list[RolloutBatch],
    results: Path,
    load: dict[str, Any] | None,
    device: str = "cpu",
) -> None:
    try:
        config = msgspec.json.decode(config_json, type=Config)
        torch.set_num_threads(1)
        parallel = ProcessGroup(
            "ddp" if config.trainer.sharding == "ddp" else "fsdp2",
            rank,
            world_size,
            ("127.0.0.1", port),
            TIMEOUT,
            torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
        )
        backend = TorchTrainerBackend(config, parallel)
        if load is not None:
            backend.load_state(
                load["weights"] if rank == 0 else {},
                load["optimizer"] if rank == 0 else {},
                load["rng"],
                load["steps"],
            )
        metrics = [backend.train(batch) for batch in batches]
        weights = backend.named_weights()
        optimizer = backend.optimizer_state_dict()
        state_bytes = backend.state_bytes()
        parallel.close()
        torch.save((rank, metrics, weights, optimizer, state_bytes, None), results / f"{rank}.pt")
    except BaseException:
        torch.save((rank, None, None, None, None, traceback.format_exc()), results / f"{rank}.pt")


def train_ranks(
    config: Config,
    world_size: int,
    batches: list[RolloutBatch],
    load: dict[str, Any] | None = None,
    device: str = "cpu",
) -> list[tuple[Any, ...]]:
    """Each rank's (rank, metrics, weights, optimizer state, state bytes), in rank order."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=TIMEOUT),
        wait_for_workers=False,
    )
    context = multiprocessing.get_context("spawn")
    results = Path(tempfile.mkdtemp(prefix="ranks-"))
    config_json = msgspec.json.encode(config)
    processes = [
        context.Process(
            target=train_rank,
            args=(rank, world_size, store.port, config_json, batches, results, load, device),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(TIMEOUT)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    got = [torch.load(results / f"{rank}.pt", weights_only=False) for rank in range(world_size)]
    shutil.rmtree(results)
    for rank, *_rest, error in got:
        assert error is None, f"rank {rank} failed:\n{error}"
    return [tuple(r[:-1]) for r in got]


def train_one_process(
    config: Config, batches: list[RolloutBatch], load: dict[str, Any] | None = None
) -> tuple[list[Any], dict[str, torch.Tensor], dict[str, Any], int]:
    backend = TorchTrainerBackend(config)
    if load is not None:
        backend.load_state(load["weights"], load["optimizer"], load["rng"], load["steps"])
    metrics = [backend.train(batch) for batch in batches]
    weights = {name: t.cpu().clone() for name, t in backend.named_weights().items()}
    return metrics, weights, backend.optimizer_state_dict(), backend.state_bytes()


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[name].float() - b[name].float()).abs().max()) for name in a)


def update_difference(
    base: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> float:
    """``|a - b| / |a - base|`` over every tensor (L2): how far two trainings' updates differ."""
    assert set(a) == set(b) == set(base)
    apart = sum(float(((a[n].double() - b[n].double()) ** 2).sum()) for n in a) ** 0.5
    update = sum(float(((a[n].double() - base[n].double()) ** 2).sum()) for n in a) ** 0.5
    assert update > 0, "nothing was trained"
    return apart / update


@pytest.fixture(scope="module")
def base_weights(model: Path) -> dict[str, torch.Tensor]:
    return {
        name: t.cpu().clone() for name, t in TorchTrainerBackend(make_config(model)).named_weights().items()
    }


@pytest.fixture(scope="module")
def model(built_in_model: Callable[[int], Path]) -> Path:
    return built_in_model(SEED)


# --- pure pieces -----------------------------------------------------------------------------


def test_a_step_is_shared_in_contiguous_parts_that_differ_by_at_most_one():
    step = list(range(10, 17))
    parts = [share(step, rank, 3) for rank in range(3)]
    assert parts == [[10, 11], [12, 13], [14, 15, 16]]
    assert [share([1], rank, 2) for rank in range(2)] == [[], [1]]


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_the_ranks_losses_over_the_steps_tokens_add_up_to_the_undivided_steps_loss(world_size: int):
    """The GRPO loss of each rank's part, each divided by the whole step's token count, sums
    to the loss of the step on one rank: gradients summed over the ranks are the step's."""
    generator = torch.Generator().manual_seed(world_size)
    rows, width = 7, 5
    logp = torch.randn(rows, width, generator=generator).clamp(max=0) - 0.1
    old_logp = logp + 0.3 * torch.randn(rows, width, generator=generator)
    ref_logp = logp + 0.2 * torch.randn(rows, width, generator=generator)
    entropy = torch.rand(rows, width, generator=generator)
    lengths = torch.tensor([5, 1, 3, 5, 2, 4, 1])
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    advantages = expand_advantages(torch.randn(rows, generator=generator), mask)
    settings = dict(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_coef=0.1, kl_type="k3")
    whole = policy_loss(logp, old_logp, advantages, mask, entropy=entropy, ref_logp=ref_logp, **settings)
    tokens = int(mask.sum())
    parts = [share(list(range(rows)), rank, world_size) for rank in range(world_size)]
    summed = [
        policy_loss(
            logp[part], old_logp[part], advantages[part], mask[part],
            entropy=entropy[part], ref_logp=ref_logp[part], num_tokens=tokens, **settings,
        )
        for part in parts
        if part
    ]  # fmt: skip
    for term in ("loss", "pg_loss", "kl", "entropy", "clipfrac"):
        total = sum(float(getattr(terms, term)) for terms in summed)
        assert total == pytest.approx(float(getattr(whole, term)), abs=1e-6), term


def test_an_optimizer_state_keyed_by_index_is_keyed_by_name_and_back():
    state = {"state": {1: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    named = by_name(state, ["a", "b"])
    assert named["state"].keys() == {"b"} and named["param_groups"][0]["params"] == ["a", "b"]
    assert by_name(named, ["a", "b"]) is named
    assert by_index(named, ["a", "b"])["param_groups"][0]["params"] == [0, 1]
    with pytest.raises(ValueError, match="parameters the model does not have: \\['b'\\]"):
        by_index(named, ["a"])


def test_a_state_listing_its_parameters_in_another_order_loads_each_moment_onto_its_own_parameter():
    """A state converted from another backend (the Megatron one's) lists them in its order."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([a, b])
    moments = {name: {"step": torch.tensor(1.0), "exp_avg": torch.full(shape, 5.0), "exp_avg_sq": torch.ones(shape)}
               for name, shape in (("a", (2,)), ("b", (3,)))}  # fmt: skip
    named = {"state": moments, "param_groups": [{**optimizer.param_groups[0], "params": ["b", "a"]}]}
    optimizer.load_state_dict(by_index(named, ["a", "b"]))
    assert optimizer.state[a]["exp_avg"].shape == (2,) and optimizer.state[b]["exp_avg"].shape == (3,)


def test_the_single_process_optimizer_state_is_keyed_by_parameter_name(model: Path):
    config = make_config(model)
    _metrics, _weights, optimizer, _bytes = train_one_process(config, [rollout(0, 8)])
    names = [name for name, p in TorchTrainerBackend(config).model.named_parameters()]
    assert set(optimizer["state"]) == set(names)
    assert optimizer["param_groups"][0]["params"] == names


def test_a_state_saved_before_any_step_leaves_the_optimizer_fresh(model: Path):
    config = make_config(model)
    untrained = TorchTrainerBackend(config)
    saved = untrained.optimizer_state_dict()
    assert saved["state"] == {}, "reading the state must not create it"
    fresh, restored = TorchTrainerBackend(config), TorchTrainerBackend(config)
    restored.load_state(dict(untrained.named_weights()), saved, untrained.rng_state(), 0)
    batch = rollout(1, 8)
    fresh.train(batch)
    restored.train(batch)
    assert max_difference(fresh.named_weights(), restored.named_weights()) == 0.0


# --- N ranks against one process ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp2", "ddp"])
def test_two_ranks_train_the_weights_one_process_trains(
    model: Path, base_weights: dict[str, torch.Tensor], sharding: str
):
    # Two rollouts of 8 samples, steps of 4, micro-batches of 1: each rank's half of a step
    # is two micro-batches, accumulated.
    batches = [rollout(0, 8), rollout(1, 8)]
    one = make_config(model, global_batch_size=4, micro_batch_size=1)
    metrics, weights, _optimizer, single_bytes = train_one_process(one, batches)
    ranks = train_ranks(
        make_config(model, global_batch_size=4, micro_batch_size=1, sharding=sharding), 2, batches
    )
    assert ranks[1][2] == {}, "only rank 0 holds the gathered weights"
    assert update_difference(base_weights, weights, ranks[0][2]) <= UPDATE_TOLERANCE
    for single, sharded in zip(metrics, ranks[0][1], strict=True):
        assert sharded.num_optimizer_steps == single.num_optimizer_steps == 2
        assert sharded.train_tokens == single.train_tokens
        assert sharded.loss == pytest.approx(single.loss, abs=1e-6)
        assert sharded.grad_norm == pytest.approx(single.grad_norm, rel=1e-5)
        assert sharded.entropy == pytest.approx(single.entropy, rel=1e-5)
    # Every rank reports the same global metrics.
    assert ranks[1][1] == ranks[0][1]
    if sharding == "fsdp2":
        # Each rank holds about half the parameters, gradients and optimizer state.
        for rank in ranks:
            assert rank[4] == pytest.approx(single_bytes / 2, rel=0.1)


@pytest.mark.slow
def test_two_ranks_with_a_kl_loss_train_what_one_process_trains(
    model: Path, base_weights: dict[str, torch.Tensor]
):
    # The reference is sharded as the policy is; its log-probabilities enter every step's loss.
    batches = [rollout(5, 8), rollout(6, 8)]
    kl = {"use_kl_loss": True, "kl_loss_coef": 0.5, "global_batch_size": 4}
    metrics, weights, _optimizer, _bytes = train_one_process(make_config(model, **kl), batches)
    ranks = train_ranks(make_config(model, sharding="fsdp2", **kl), 2, batches)
    assert metrics[1].kl > 0
    assert ranks[0][1][1].kl == pytest.approx(metrics[1].kl, rel=1e-4)
    assert update_difference(base_weights, weights, ranks[0][2]) <= UPDATE_TOLERANCE


@pytest.mark.slow
def test_fsdp2_on_one_rank_trains_what_one_process_trains(model: Path, base_weights: dict[str, torch.Tensor]):
    # One rank keeps its parameters gathered and reduces gradients once per step (four
    # micro-batches accumulated unreduced).
    batches = [rollout(0, 8), rollout(1, 8)]
    _metrics, weights, _optimizer, _bytes = train_one_process(make_config(model, micro_batch_size=2), batches)
    ranks = train_ranks(make_config(model, micro_batch_size=2, sharding="fsdp2"), 1, batches)
    assert update_difference(base_weights, weights, ranks[0][2]) <= UPDATE_TOLERANCE


@pytest.mark.slow
def test_ranks_with_unequal_parts_train_what_one_process_trains(
    model: Path, base_weights: dict[str, torch.Tensor]
):
    # Steps of 3 samples over 2 ranks: parts of 1 and 2, so one rank runs an empty micro-batch.
    batches = [rollout(2, 6)]
    single = make_config(model, global_batch_size=3, micro_batch_size=1)
    _metrics, weights, _optimizer, _bytes = train_one_process(single, batches)
    ranks = train_ranks(
        make_config(model, global_batch_size=3, micro_batch_size=1, sharding="fsdp2"), 2, batches
    )
    assert update_difference(base_weights, weights, ranks[0][2]) <= UPDATE_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp2", "ddp"])
def test_a_two_rank_state_resumes_in_one_process_and_the_other_way(
    model: Path, base_weights: dict[str, torch.Tensor], sharding: str
):
    first, second = [rollout(3, 8)], [rollout(4, 8)]
    config = make_config(model, global_batch_size=4, micro_batch_size=2)
    sharded = make_config(model, global_batch_size=4, micro_batch_size=2, sharding=sharding)
    _metrics, uninterrupted, _optimizer, _bytes = train_one_process(config, first + second)

    # Two ranks, then one process.
    (rank0, _rank1) = train_ranks(sharded, 2, first)
    load = {"weights": rank0[2], "optimizer": rank0[3], "rng": _rng(), "steps": 2}
    assert set(rank0[3]["state"]) == set(rank0[2]), "the optimizer state is keyed by parameter name"
    _metrics, resumed, _optimizer, _bytes = train_one_process(config, second, load)
    assert update_difference(base_weights, uninterrupted, resumed) <= UPDATE_TOLERANCE

    # One process, then two ranks.
    _metrics, weights, optimizer, _bytes = train_one_process(config, first)
    load = {"weights": weights, "optimizer": optimizer, "rng": _rng(), "steps": 2}
    (rank0, _rank1) = train_ranks(sharded, 2, second, load)
    assert update_difference(base_weights, uninterrupted, rank0[2]) <= UPDATE_TOLERANCE


def _rng() -> dict[str, Any]:
    from actors.trainer_backend.base import capture_rng_state

    return capture_rng_state()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_fsdp2_rank_on_a_gpu_trains_what_one_process_trains(
    model: Path, base_weights: dict[str, torch.Tensor]
):
    batches = [rollout(0, 8), rollout(1, 8)]
    _metrics, weights, _optimizer, _bytes = train_one_process(
        make_config(model, global_batch_size=4), batches
    )
    ranks = train_ranks(make_config(model, global_batch_size=4, sharding="fsdp2"), 1, batches, device="cuda")
    cpu = {name: t.cpu() for name, t in ranks[0][2].items()}
    assert update_difference(base_weights, {n: t.cpu() for n, t in weights.items()}, cpu) <= UPDATE_TOLERANCE


# --- the Trainer actor over two ranks --------------------------------------------------------


async def two_rank_trainer(model: Path, run_dir: Path, **trainer: Any) -> tuple[Trainer, RecordingContext]:
    config = msgspec.structs.replace(
        make_config(model, num_ranks=2, num_threads=1, **trainer), run=RunConfig(dir=str(run_dir), seed=SEED)
    )
    context = RecordingContext(config, name="trainer", run_dir=run_dir)
    actor = Trainer(config, context)
    await actor.start()
    return actor, context


def staged_rollout(context: RecordingContext, batch: RolloutBatch) -> RolloutGenerated:
    ref = context.transport.stager.put_bytes(
        f"rollout-{batch.rollout_id}", msgspec.msgpack.encode(batch), owner="generator"
    )
    return RolloutGenerated(
        rollout_id=batch.rollout_id, batch=ref, num_samples=len(batch.samples), reward_mean=0.0,
        weight_versions=["default"],
    )  # fmt: skip


@pytest.mark.slow
async def test_a_cut_step_of_two_ranks_is_cancelled_on_both_and_keeps_nothing(model: Path, tmp_path: Path):
    trainer, context = await two_rank_trainer(model, tmp_path)
    try:
        before = await anyio.to_thread.run_sync(trainer.backend.named_weights)
        trainer.interrupt(StopRequested(reason="cut", now=True))
        await trainer.handle(staged_rollout(context, rollout(0, 8)))
        (cancelled,) = [e for e in context.published if isinstance(e, StepCancelled)]
        assert (cancelled.phase, cancelled.reason) == ("train", "cut")
        after = await anyio.to_thread.run_sync(trainer.backend.named_weights)
        assert all(torch.equal(t, before[n]) for n, t in after.items())
        assert trainer.backend.num_optimizer_steps == 0
    finally:
        await trainer.stop()


@pytest.mark.slow
async def test_a_step_of_two_ranks_reports_each_rank_rank_0_in_the_actors_process(
    model: Path, tmp_path: Path
):
    trainer, context = await two_rank_trainer(model, tmp_path)
    try:
        await trainer.handle(staged_rollout(context, rollout(1, 8)))
        (finished,) = [e for e in context.published if isinstance(e, TrainStepFinished)]
        assert [r.rank for r in finished.ranks] == [0, 1]
        assert finished.ranks[0].pid == os.getpid() != finished.ranks[1].pid
        assert finished.metrics.num_optimizer_steps == 1 == trainer.backend.num_optimizer_steps
    finally:
        await trainer.stop()


@pytest.mark.slow
async def test_a_non_finite_loss_on_two_ranks_fails_as_it_does_on_one(model: Path, tmp_path: Path):
    # NaN old log-probabilities (the engine's, with use_rollout_logprobs) make the loss NaN
    # on both ranks: the error is the trainer's own, not a rank failure.
    trainer, context = await two_rank_trainer(model, tmp_path, use_rollout_logprobs=True)
    try:
        batch = rollout(0, 8)
        nan = [
            msgspec.structs.replace(s, response_logprobs=[math.nan] * len(s.response_ids))
            for s in batch.samples
        ]
        with pytest.raises(NonFiniteError, match="rollout 0, optimizer step 1 of 1: non-finite loss"):
            await trainer.handle(staged_rollout(context, msgspec.structs.replace(batch, samples=nan)))
        assert trainer.backend.num_optimizer_steps == 0
    finally:
        await trainer.stop()


@pytest.mark.slow
async def test_a_reference_that_does_not_fit_two_ranks_is_refused_naming_the_tensors(
    model: Path, tmp_path: Path
):
    trainer, _context = await two_rank_trainer(model, tmp_path, use_kl_loss=True, kl_loss_coef=0.1)
    try:
        weights = await anyio.to_thread.run_sync(trainer.backend.named_weights)
        del weights["model.norm.weight"]
        with pytest.raises(
            RankFailed,
            match=r"rank 0 .*checkpoint weights do not fit the model: missing \['model.norm.weight'\]",
        ):
            await anyio.to_thread.run_sync(trainer.backend.load_reference, weights)
    finally:
        await trainer.stop()
