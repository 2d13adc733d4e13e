"""The Trainer actor and its PyTorch backend, driven through a fake context."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from actors.engine.torch_engine import TorchEngine
from actors.trainer import Trainer, staleness_max
from actors.trainer_backend.save_staging import SaveStaging
from actors.trainer_backend.torch_backend import (
    TorchTrainerBackend,
    pack_samples,
    pack_shared_prompts,
    shares_prompts,
)
from miles_events.bus.actor import WorkerGroup
from miles_events.bus.clock import SYSTEM_CLOCK, Clock
from miles_events.device.fingerprint import fingerprints, tensor_fingerprint
from miles_events.device.threads import available_cpus
from miles_events.rl.canary import CANARY_TENSOR, publication_canary, split_canary
from miles_events.rl.checksum import per_gpu_checksum
from miles_events.rl.checksum_manifest import read_manifest
from miles_events.rl.finite import NonFiniteError
from miles_events.rl.hf_model import load_model, prepare_base_model
from miles_events.transport.base import Transport
from miles_events.transport.inprocess import InProcessTransport
from schemas.checkpoint import TrainerState
from schemas.config import (
    BuiltinModelConfig,
    Config,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainerConfig,
    VerifierConfig,
)
from schemas.events import (
    DataReleased,
    Event,
    PublicationVerified,
    PublishRequested,
    RolloutGenerated,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TrainStateStaged,
    TrainStepFinished,
    WeightsStaged,
)
from schemas.plan import RunPlan
from schemas.rollout import RolloutBatch, Sample

SEED = 7
PROMPT = [4, 13, 5, 16]  # "1+2=" in the arithmetic tokenizer


@dataclass
class FakeContext:
    config: Config
    run_dir: Path
    run_id: str = "test-run"
    name: str = "trainer"
    transport: Transport = field(default_factory=lambda: InProcessTransport("test-run"))
    plan: RunPlan = field(
        default_factory=lambda: RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1)
    )
    clock: Clock = SYSTEM_CLOCK
    events: list[Event] = field(default_factory=list)

    async def publish(self, event: Event) -> None:
        self.events.append(event)

    def of_type(self, event_type: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, event_type)]


async def staged_train_state(context: FakeContext, rollout_id: int, seconds: float = 5.0) -> TrainStateStaged:
    """The ``TrainStateStaged`` of ``rollout_id``, once a save staged in the background has
    published it (an AssertionError after ``seconds``)."""
    for _ in range(int(seconds / 0.01)):
        done = [e for e in context.of_type(TrainStateStaged) if e.rollout_id == rollout_id]
        if done:
            return done[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"the train state of rollout {rollout_id} was not staged within {seconds}s")


@pytest.fixture(scope="module")
def base_model(built_in_model: Callable[[int], Path]) -> Path:
    return built_in_model(SEED)


def make_config(model_path: Path, run_dir: Path, **trainer: Any) -> Config:
    trainer.setdefault("lr", 1e-2)
    return Config(
        run=RunConfig(dir=str(run_dir), seed=SEED, runtime="local"),
        model=ModelConfig(path=str(model_path)),
        data=DataConfig(rollout_batch_size=2),
        trainer=TrainerConfig(**trainer),
    )


async def started_trainer(
    config: Config,
    run_dir: Path,
    run_id: str = "test-run",
    load_checkpoint: Path | None = None,
    weight_version: str = "default",
) -> tuple[Trainer, FakeContext]:
    plan = RunPlan(
        start_rollout_id=0,
        num_rollout=1,
        num_rollout_per_epoch=1,
        load_checkpoint=str(load_checkpoint) if load_checkpoint is not None else None,
        resumed=load_checkpoint is not None,
        weight_version=weight_version,
    )
    context = FakeContext(
        config=config, run_dir=run_dir, run_id=run_id, transport=InProcessTransport(run_id), plan=plan
    )
    trainer = Trainer(config, context)
    await trainer.start()
    return trainer, context


def sample(
    group: int, response: list[int], reward: float, version: str = "default", index: int = 0
) -> Sample:
    return Sample(
        index=index, group=group, prompt="1+2=", label="3", prompt_ids=PROMPT, response_ids=response,
        response_logprobs=[-1.0] * len(response), response="", reward=reward, weight_version=version,
        engine="engine-0", finish_reason="stop",
    )  # fmt: skip


GOOD, BAD = [7, 1], [9, 10, 1]  # "3<eos>" and "56<eos>"


def two_group_samples(version: str = "default") -> list[Sample]:
    return [
        sample(0, GOOD, 1.0, version),
        sample(0, BAD, 0.0, version),
        sample(1, [8, 1], 0.0, version, index=1),
        sample(1, [6, 6, 6, 1], 1.0, version, index=1),
    ]


def rollout_event(context: FakeContext, rollout_id: int, samples: list[Sample]) -> RolloutGenerated:
    batch = RolloutBatch(rollout_id=rollout_id, samples=samples)
    ref = context.transport.stager.put_bytes(
        f"rollout-{rollout_id}", msgspec.msgpack.encode(batch), owner="generator"
    )
    return RolloutGenerated(
        rollout_id=rollout_id, batch=ref, num_samples=len(samples), reward_mean=0.0,
        weight_versions=sorted({s.weight_version for s in samples}),
    )  # fmt: skip


def weights_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.backend.named_weights().items()}


# --- training ----------------------------------------------------------------------------------


async def test_training_moves_the_weights(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    before = weights_of(trainer)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    after = weights_of(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)


async def test_training_raises_the_logprob_of_positively_advantaged_responses(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    backend = trainer.backend
    assert isinstance(backend, TorchTrainerBackend)
    good, bad = sample(0, GOOD, 1.0), sample(0, BAD, 0.0)
    before = [float(lp.sum()) for lp in backend.response_logprobs([good, bad])]
    for rollout_id in range(3):
        await trainer.handle(rollout_event(context, rollout_id, [good, bad]))
    after = [float(lp.sum()) for lp in backend.response_logprobs([good, bad])]
    assert after[0] > before[0]
    assert after[1] < before[1]


async def test_a_rollout_is_released_then_reported_as_a_train_step(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    event = rollout_event(context, 3, two_group_samples())
    await trainer.handle(event)
    released, finished = context.events
    assert isinstance(released, DataReleased) and released.ref == event.batch
    assert isinstance(finished, TrainStepFinished)
    assert finished.rollout_id == 3
    assert finished.weight_version == "default"
    assert finished.metrics.train_tokens == 2 + 3 + 2 + 4
    assert finished.metrics.num_optimizer_steps == 1
    assert finished.metrics.grad_norm > 0


async def test_a_one_process_train_step_reports_its_one_rank(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    (finished,) = context.of_type(TrainStepFinished)
    (rank,) = finished.ranks
    assert (rank.rank, rank.pid) == (0, os.getpid())
    assert 0 < rank.step_seconds <= finished.train_seconds
    assert rank.peak_memory_bytes > 0
    tensors = list(trainer.backend.model.parameters())
    parameters = sum(p.numel() * p.element_size() for p in tensors)
    # Parameters, Adam's two moments and its step count per tensor (gradients are freed).
    assert rank.state_bytes == 3 * parameters + 4 * len(tensors)


async def test_global_batch_size_sets_the_optimizer_steps_per_rollout(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path, global_batch_size=2), tmp_path)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(rollout_event(context, 1, two_group_samples()))
    assert [e.metrics.num_optimizer_steps for e in context.of_type(TrainStepFinished)] == [2, 2]
    assert trainer.backend.num_optimizer_steps == 4


async def test_micro_batching_gives_the_same_update_as_one_batch(base_model: Path, tmp_path: Path) -> None:
    # A large adam_eps makes the first AdamW update ~ lr * gradient instead of ~ lr * sign(gradient),
    # so the comparison measures the accumulated gradient, not the sign of its round-off.
    updates = []
    for micro_batch_size in (4, 1, 3):
        config = make_config(
            base_model, tmp_path, micro_batch_size=micro_batch_size, lr=1.0, adam_eps=1.0, clip_grad=0.0
        )
        trainer, context = await started_trainer(config, tmp_path)
        before = weights_of(trainer)
        await trainer.handle(rollout_event(context, 0, two_group_samples()))
        updates.append({name: t - before[name] for name, t in weights_of(trainer).items()})
    whole = updates[0]
    assert max(float(t.abs().max()) for t in whole.values()) > 1e-4
    for split in updates[1:]:
        assert max(float((split[name] - whole[name]).abs().max()) for name in whole) < 1e-5


async def test_recomputed_old_logprobs_make_the_first_step_unclipped(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    assert context.of_type(TrainStepFinished)[0].metrics.clipfrac == 0.0


async def test_rollout_logprobs_serve_as_old_logprobs_when_configured(
    base_model: Path, tmp_path: Path
) -> None:
    # The samples claim logprob -1 per token; the model's are near -log(18): ratios far above 1 + eps.
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, use_rollout_logprobs=True), tmp_path
    )
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    assert context.of_type(TrainStepFinished)[0].metrics.clipfrac > 0.0


def test_a_packed_sequence_leaves_out_the_last_token_which_predicts_nothing() -> None:
    micro = pack_samples([sample(0, GOOD, 1.0), sample(0, BAD, 0.0)], [0, 1])
    # "1+2=" + "56<eos>" less "<eos>": 6 positions; the shorter row is padded.
    assert micro.input_ids.tolist() == [[*PROMPT, 7, 0], [*PROMPT, 9, 10]]
    assert micro.attention_mask.tolist() == [[1] * 5 + [0], [1] * 6]
    assert micro.logit_index.tolist() == [[3, 4, 0], [3, 4, 5]]
    assert micro.targets.tolist() == [[7, 1, 0], [9, 10, 1]]
    assert micro.mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_response_logprobs_equal_a_full_forward_pass_of_each_sample(base_model: Path, tmp_path: Path) -> None:
    backend = TorchTrainerBackend(make_config(base_model, tmp_path))
    samples = two_group_samples()
    reference = load_model(base_model)
    for got, s in zip(backend.response_logprobs(samples), samples, strict=True):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
        positions = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) + len(s.response_ids) - 1)
        expected = logprobs[positions, torch.tensor(s.response_ids)]
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)


def varied_samples() -> list[Sample]:
    """Groups of prompts of several lengths (one of a single token), responses of 0-4 tokens."""
    prompts = [PROMPT, [5, 14, 6, 7, 16], [8, 16], [3]]
    lengths = [[2, 0, 4, 1], [3, 3, 1, 2], [1, 4, 0, 2], [2, 2, 3, 1]]
    return [
        msgspec.structs.replace(
            sample(group, [3 + (group + k + j) % 14 for j in range(n)], 0.0, index=group), prompt_ids=prompt
        )
        for group, (prompt, ns) in enumerate(zip(prompts, lengths, strict=True))
        for k, n in enumerate(ns)
    ]


def test_each_distinct_prompt_runs_once_with_the_same_logprobs_and_gradients(
    base_model: Path, tmp_path: Path
) -> None:
    backend = TorchTrainerBackend(make_config(base_model, tmp_path))
    samples = varied_samples()
    assert shares_prompts(samples) and not shares_prompts(samples[::4])
    indices = list(range(len(samples)))
    rows = count_forwards(backend)
    results = []
    for micro in (pack_samples(samples, indices), pack_shared_prompts(samples, indices)):
        backend.model.zero_grad()
        logp, entropy = backend._forward(micro, with_entropy=True)
        assert entropy is not None
        weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
        ((logp + entropy) * weights * micro.mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in backend.model.named_parameters() if p.grad is not None}
        results.append((logp * micro.mask, entropy * micro.mask, grads))
    # Whole sequences: one pass of 16 rows; shared: the 4 prompts, then the 16 responses.
    assert rows == [16, 4, 16]
    (logp, entropy, grads), (shared_logp, shared_entropy, shared_grads) = results
    assert torch.allclose(logp, shared_logp, atol=1e-5) and torch.allclose(entropy, shared_entropy, atol=1e-5)
    assert grads.keys() == shared_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, shared_grads[name], atol=1e-5, rtol=1e-4), name


def test_a_micro_batch_of_empty_responses_has_no_positions_on_either_path(
    base_model: Path, tmp_path: Path
) -> None:
    backend = TorchTrainerBackend(make_config(base_model, tmp_path))
    samples = [sample(0, [], 0.0), sample(0, [], 0.0)]
    for micro in (pack_samples(samples, [0, 1]), pack_shared_prompts(samples, [0, 1])):
        logp, entropy = backend._forward(micro, with_entropy=True)
        assert logp.shape == (2, 0) and entropy is not None and entropy.shape == (2, 0)


def count_forwards(backend: TorchTrainerBackend) -> list[int]:
    """Rows of every forward pass through the policy's decoder, in order."""
    rows: list[int] = []
    body = getattr(backend.model, backend.model.base_model_prefix)
    body.register_forward_pre_hook(
        lambda _module, _args, kwargs: rows.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    return rows


@pytest.mark.parametrize("use_rollout_logprobs", [False, True])
async def test_old_logprobs_cost_one_pass_over_the_later_steps_only(
    base_model: Path, tmp_path: Path, use_rollout_logprobs: bool
) -> None:
    # Two steps of two samples: the first step's old logprobs are its own training forward.
    config = make_config(
        base_model,
        tmp_path,
        global_batch_size=2,
        micro_batch_size=2,
        use_rollout_logprobs=use_rollout_logprobs,
        shared_prompts=False,  # one decoder call per pass
    )
    trainer, context = await started_trainer(config, tmp_path)
    assert isinstance(trainer.backend, TorchTrainerBackend)
    rows = count_forwards(trainer.backend)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    # Without rollout logprobs: step 2's old logprobs (2 rows), then the two training passes.
    assert rows == ([2, 2] if use_rollout_logprobs else [2, 2, 2])
    assert context.of_type(TrainStepFinished)[0].metrics.num_optimizer_steps == 2


async def test_a_rollout_trains_on_every_core_unless_configured(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    seen: list[int] = []
    train = trainer.backend.train

    def recording(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return train(*args)

    monkeypatch.setattr(trainer.backend, "train", recording)
    torch.set_num_threads(1)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    assert seen == [available_cpus()]
    config = make_config(base_model, tmp_path, num_threads=1)
    trainer.config = config
    await trainer.handle(rollout_event(context, 1, two_group_samples()))
    assert seen == [available_cpus(), 1]


async def test_kl_to_the_reference_is_zero_until_the_policy_moves(base_model: Path, tmp_path: Path) -> None:
    config = make_config(base_model, tmp_path, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    trainer, context = await started_trainer(config, tmp_path)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(rollout_event(context, 1, two_group_samples()))
    first, second = context.of_type(TrainStepFinished)
    assert first.metrics.kl == 0.0
    assert second.metrics.kl > 0.0


async def test_a_loaded_reference_is_what_the_kl_is_measured_against(
    base_model: Path, tmp_path: Path
) -> None:
    """``run.ref_load``: the KL reference is the reference checkpoint's weights, not the
    policy's starting point, so the first step already has a KL; the policy is untouched."""
    config = make_config(base_model, tmp_path, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    trainer, context = await started_trainer(config, tmp_path)
    policy = weights_of(trainer)
    reference = {name: tensor + 0.05 for name, tensor in policy.items()}
    trainer.backend.load_reference(reference)
    assert all(torch.equal(t, policy[n]) for n, t in weights_of(trainer).items())
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    (first,) = context.of_type(TrainStepFinished)
    assert first.metrics.kl > 0.0
    with pytest.raises(ValueError, match="missing"):
        trainer.backend.load_reference({n: t for n, t in reference.items() if "norm" not in n})


def test_staleness_counts_publications_since_the_oldest_sample_version() -> None:
    assert staleness_max("3", ["2", "1", "3"]) == 2
    assert staleness_max("2", ["default"]) == 2
    assert staleness_max("default", []) == 0


async def test_train_step_reports_the_trainer_version_and_staleness(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    await trainer.handle(PublishRequested(rollout_id=0))
    await trainer.handle(rollout_event(context, 1, two_group_samples("default")))
    finished = context.of_type(TrainStepFinished)[0]
    assert finished.weight_version == "2"
    assert finished.staleness_max == 2


def asynchronous(config: Config, max_staleness: int) -> Config:
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, max_staleness=max_staleness)
    )


async def test_asynchronously_rollouts_train_in_order_each_once_the_step_before_is_published(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(asynchronous(make_config(base_model, tmp_path), 2), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    await trainer.handle(rollout_event(context, 1, two_group_samples("1")))  # ahead of its turn
    await trainer.handle(rollout_event(context, 0, two_group_samples("1")))
    assert [e.rollout_id for e in context.of_type(TrainStepFinished)] == [0]  # 1 waits for 0's publication
    await trainer.handle(PublishRequested(rollout_id=0))
    finished = context.of_type(TrainStepFinished)
    assert [e.rollout_id for e in finished] == [0, 1]
    # Rollout 1 was sampled on version 1 and trained by version 2: one publication behind.
    assert finished[1].weight_version == "2" and finished[1].token_staleness[1] > 0
    assert sorted(finished[1].trained_prompts) == [0, 0, 1, 1]


async def test_asynchronously_a_sample_past_the_bound_is_left_out_and_counted(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(asynchronous(make_config(base_model, tmp_path), 1), tmp_path)
    for version in (None, 0):  # the trainer is at version 2
        await trainer.handle(PublishRequested(rollout_id=version))
    samples = two_group_samples("2")[:2] + two_group_samples("default")[2:]  # group 1 two versions behind
    await trainer.handle(rollout_event(context, 0, samples))
    (finished,) = context.of_type(TrainStepFinished)
    assert (finished.stale_samples, finished.stale_tokens) == (2, 6)
    assert finished.trained_prompts == [0, 0] and finished.token_staleness == [5]


# --- publication -------------------------------------------------------------------------------


async def test_publications_stage_version_one_then_two(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(PublishRequested(rollout_id=0))
    staged = context.of_type(WeightsStaged)
    assert [e.weight_version for e in staged] == ["1", "2"]
    assert [e.rollout_id for e in staged] == [None, 0]
    assert trainer.weight_version == "2"


async def test_staged_checksums_fingerprint_the_staged_tensors(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    event = context.of_type(WeightsStaged)[0]
    payload = context.transport.reader.get_tensors(event.weights)
    tensors, canary = split_canary(payload)
    # The payload carries this publication's canary, in no digest.
    assert canary is not None and torch.equal(canary, publication_canary(context.run_id, "1"))
    assert event.canary == tensor_fingerprint(canary)
    assert read_manifest(tmp_path, event.checksums_manifest, event.digest) == fingerprints(tensors)
    assert event.digest == per_gpu_checksum(fingerprints(tensors))
    assert event.checksums_manifest == f"checksums/{event.digest}.msgpack"
    assert event.num_tensors == len(tensors)
    assert event.num_bytes == sum(t.numel() * t.element_size() for t in payload.values())
    assert event.weights.owner == "trainer"


async def test_the_backend_trains_in_its_buckets_and_a_publication_copies_them_whole(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    own = trainer.backend.weight_buckets()
    assert own is not None
    views = own.tensors()
    for name, tensor in trainer.backend.named_weights().items():
        assert tensor.data_ptr() == views[name].data_ptr(), name  # the parameters are bucket views
    await trainer.handle(PublishRequested(rollout_id=None))
    staged = context.transport.reader.get_buckets(context.of_type(WeightsStaged)[0].weights)
    assert staged is not None
    # The weights' buckets as the backend lays them out (one copy each), then the canary's.
    assert staged.layouts[:-1] == own.layouts
    assert [slot.name for slot in staged.layouts[-1].slots] == [CANARY_TENSOR]
    assert all(
        torch.equal(a, b) and a.data_ptr() != b.data_ptr()
        for a, b in zip(staged.buffers[:-1], own.buffers, strict=True)
    )
    # An engine of the same model loads them bucket by bucket.
    assert TorchEngine.from_pretrained(base_model)._load_buckets(staged, "1")
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    assert not torch.equal(staged.buffers[0], own.buffers[0])  # training moved the buckets in place


async def test_the_staged_digest_leaves_out_the_verifier_skip_list(base_model: Path, tmp_path: Path) -> None:
    config = msgspec.structs.replace(
        make_config(base_model, tmp_path), verifier=VerifierConfig(skip_tensor_list=["norm"])
    )
    trainer, context = await started_trainer(config, tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    event = context.of_type(WeightsStaged)[0]
    tensors, _canary = split_canary(context.transport.reader.get_tensors(event.weights))
    assert any("norm" in name for name in tensors), "skipped tensors are still published"
    covered = fingerprints(tensors, ["norm"])
    assert read_manifest(tmp_path, event.checksums_manifest, event.digest) == covered
    assert event.num_tensors == len(covered) < len(tensors)


async def test_staged_weights_do_not_change_when_training_continues(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    event = context.of_type(WeightsStaged)[0]
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    assert (
        per_gpu_checksum(fingerprints(split_canary(context.transport.reader.get_tensors(event.weights))[0]))
        == event.digest
    )
    assert per_gpu_checksum(fingerprints(trainer.backend.named_weights())) != event.digest


async def test_staging_the_next_version_frees_the_previous_one(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    await trainer.handle(PublishRequested(rollout_id=None))
    first, second = context.of_type(WeightsStaged)
    with pytest.raises(KeyError):
        context.transport.reader.get_tensors(first.weights)
    context.transport.reader.get_tensors(second.weights)
    await trainer.stop()
    with pytest.raises(KeyError):
        context.transport.reader.get_tensors(second.weights)


async def test_a_released_publications_buffers_stage_a_later_one_and_an_unreleased_ones_are_not_written_again(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)

    async def publish() -> tuple[WeightsStaged, tuple[torch.Tensor, ...]]:
        await trainer.handle(PublishRequested(rollout_id=None))
        event = context.of_type(WeightsStaged)[-1]
        staged = context.transport.reader.get_buckets(event.weights)
        assert staged is not None
        assert per_gpu_checksum(fingerprints(split_canary(staged.tensors())[0])) == event.digest
        return event, staged.buffers

    first, first_buffers = await publish()
    await trainer.handle(DataReleased(ref=first.weights))  # every engine loaded it
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    second, second_buffers = await publish()
    assert second.digest != first.digest
    assert [b.data_ptr() for b in second_buffers] == [b.data_ptr() for b in first_buffers]
    kept = [b.clone() for b in second_buffers]
    # The next publication is staged before anyone released the second: a reader may still be
    # reading it, so it is left as it is and the third goes into new buffers.
    await trainer.handle(rollout_event(context, 1, two_group_samples()))
    _third, third_buffers = await publish()
    assert not {b.data_ptr() for b in third_buffers} & {b.data_ptr() for b in second_buffers}
    assert all(torch.equal(a, b) for a, b in zip(second_buffers, kept, strict=True))
    assert trainer._staging.num_allocated == 2


async def test_a_released_publications_buffers_wait_for_the_engines_copies_the_transport_says_may_still_run(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines say they are done with their copies queued: the trainer gives the buffers
    back with the reads the transport names (``reads_of``), and stages into them again only
    once those have run."""
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)

    class Read:
        done = False

        def query(self) -> bool:
            return self.done

    read = Read()
    asked = []
    monkeypatch.setattr(context.transport.stager, "reads_of", lambda ref: asked.append(ref) or (read,))

    async def publish() -> tuple[WeightsStaged, set[int]]:
        await trainer.handle(PublishRequested(rollout_id=None))
        event = context.of_type(WeightsStaged)[-1]
        staged = context.transport.reader.get_buckets(event.weights)
        assert staged is not None
        return event, {b.data_ptr() for b in staged.buffers}

    first, first_buffers = await publish()
    await trainer.handle(DataReleased(ref=first.weights))
    assert asked == [first.weights]
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    second, second_buffers = await publish()  # the engine's copy of the first has not run
    assert not second_buffers & first_buffers
    await trainer.handle(DataReleased(ref=second.weights))
    read.done = True
    await trainer.handle(rollout_event(context, 1, two_group_samples()))
    _third, third_buffers = await publish()
    assert third_buffers in (first_buffers, second_buffers) and trainer._staging.num_allocated == 2


async def test_tied_embeddings_are_published_once(tmp_path: Path) -> None:
    tied = prepare_base_model(
        ModelConfig(builtin=BuiltinModelConfig(tie_word_embeddings=True)), tmp_path, SEED
    )
    trainer, context = await started_trainer(make_config(tied, tmp_path), tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    event = context.of_type(WeightsStaged)[0]
    names = set(read_manifest(tmp_path, event.checksums_manifest, event.digest))
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    assert not any("rotary" in name for name in names)


async def test_weights_are_published_in_the_engine_dtype(base_model: Path, tmp_path: Path) -> None:
    config = msgspec.structs.replace(
        make_config(base_model, tmp_path), model=ModelConfig(path=str(base_model), dtype="bfloat16")
    )
    trainer, context = await started_trainer(config, tmp_path)
    await trainer.handle(PublishRequested(rollout_id=None))
    tensors, _canary = split_canary(
        context.transport.reader.get_tensors(context.of_type(WeightsStaged)[0].weights)
    )
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


# --- checkpoints -------------------------------------------------------------------------------


async def test_saved_optimizer_bytes_load_back_into_an_optimizer(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval"))
    staged = context.of_type(TrainStateStaged)[0]
    state = context.transport.reader.get_state(staged.optimizer)
    assert len(state["state"]) > 0
    fresh = TorchTrainerBackend(trainer.config)
    fresh.optimizer.load_state_dict(state)
    assert fresh.optimizer.state_dict()["param_groups"][0]["lr"] == pytest.approx(1e-2)


async def test_saved_train_state_carries_version_steps_and_data_cursor(
    base_model: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(5))
    )
    config = make_config(base_model, tmp_path)
    config = msgspec.structs.replace(config, data=DataConfig(prompt_data=str(prompts), rollout_batch_size=2))
    trainer, context = await started_trainer(config, tmp_path, run_id="run-abc")
    await trainer.handle(PublishRequested(rollout_id=None))
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(SaveRequested(rollout_id=0, reason="last"))
    staged = context.of_type(TrainStateStaged)[0]
    assert staged.reason == "last"
    state = staged.trainer_state
    assert (state.rollout_id, state.weight_version, state.num_optimizer_steps) == (0, "1", 1)
    assert (state.seed, state.run_id) == (SEED, "run-abc")
    # 5 prompts, 2 per rollout: 2 rollouts per epoch; rollout 1 starts at offset 2 of epoch 0.
    assert (state.data.next_rollout_id, state.data.epoch, state.data.offset) == (1, 0, 2)
    weights = context.transport.reader.get_tensors(staged.weights)
    assert all(torch.equal(weights[n], t) for n, t in trainer.backend.named_weights().items())


async def test_a_background_save_stages_the_state_as_it_was_when_asked_while_training_goes_on(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    asked = {n: t.clone() for n, t in trainer.backend.named_weights().items()}
    optimizer_asked = copy.deepcopy(trainer.backend.optimizer_state_dict())
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval"))
    await trainer.handle(rollout_event(context, 1, two_group_samples()))  # the next step, before it is staged
    staged = await staged_train_state(context, 0)
    assert staged.trainer_state.rollout_id == 0 and staged.trainer_state.num_optimizer_steps == 1
    weights = context.transport.reader.get_tensors(staged.weights)
    assert weights.keys() == asked.keys() and all(torch.equal(weights[n], t) for n, t in asked.items())
    now = trainer.backend.named_weights()
    assert any(not torch.equal(now[n], t) for n, t in asked.items())  # training went on
    optimizer = context.transport.reader.get_state(staged.optimizer)
    for key, state in optimizer_asked["state"].items():
        assert all(
            torch.equal(optimizer["state"][key][k], v)
            for k, v in state.items()
            if isinstance(v, torch.Tensor)
        )


async def test_a_background_save_with_a_publication_behind_it_is_staged_once_that_publication_is(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    asked = {n: t.clone() for n, t in trainer.backend.named_weights().items()}
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval", publication_follows=True))
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not context.of_type(TrainStateStaged), "staged before the publication asked for with it"
    await trainer.handle(PublishRequested(rollout_id=0))
    await staged_train_state(context, 0)
    order = [type(e).__name__ for e in context.events if isinstance(e, WeightsStaged | TrainStateStaged)]
    assert order == ["WeightsStaged", "TrainStateStaged"]
    staged = context.of_type(TrainStateStaged)[0]
    weights = context.transport.reader.get_tensors(staged.weights)
    assert all(torch.equal(weights[n], t) for n, t in asked.items())  # the state as it was when asked


async def test_a_background_save_asked_for_after_its_publication_does_not_wait_for_it(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(PublishRequested(rollout_id=0))
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval", publication_follows=True))
    await staged_train_state(context, 0)  # at once: no wait for a publication already staged
    assert trainer.publications.waiting == 0


async def test_a_background_save_waits_for_its_publication_even_when_that_fails_to_stage(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval", publication_follows=True))

    def broken(*args: Any) -> None:
        raise RuntimeError("staging failed")

    monkeypatch.setattr(trainer, "_stage_weights", broken)
    with pytest.raises(RuntimeError, match="staging failed"):
        await trainer.handle(PublishRequested(rollout_id=0))
    await staged_train_state(context, 0)  # once its publication was over, though it failed


async def test_each_background_save_copies_into_the_copies_of_the_last_once_they_are_on_the_host(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU's path on the CPU: the reused copies, and a host copy that copies (as on a GPU).
    from miles_events.device.host_copy import map_tensors

    def copy_to_the_host(obj: Any, after: Any = None, pool: Any = None) -> tuple[Any, Any]:
        return map_tensors(obj, lambda t: t.clone()), pool.take([])

    monkeypatch.setattr("actors.trainer_backend.save_staging.copy_to_host", copy_to_the_host)
    monkeypatch.setattr(SaveStaging, "reuses_copies", lambda self: True)
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    trainer.saves.pinned.pin = False
    for rollout_id in (0, 1):
        await trainer.handle(rollout_event(context, rollout_id, two_group_samples()))
        asked = {n: t.clone() for n, t in trainer.backend.named_weights().items()}
        moments = {
            k: v["exp_avg"].clone() for k, v in trainer.backend.optimizer_state_dict()["state"].items()
        }
        await trainer.handle(SaveRequested(rollout_id=rollout_id, reason="interval"))
        staged = await staged_train_state(context, rollout_id)
        weights = context.transport.reader.get_tensors(staged.weights)
        assert all(torch.equal(weights[n], t) for n, t in asked.items())
        optimizer = context.transport.reader.get_state(staged.optimizer)
        assert all(torch.equal(optimizer["state"][k]["exp_avg"], v) for k, v in moments.items())
    assert trainer.saves.lent == {}, "every save's copies given back once on the host"
    assert trainer.saves.device_arenas is not None and trainer.saves.device_arenas.num_pinned == 1
    assert trainer.saves.device_buckets.num_allocated == 1
    await trainer.stop()
    assert trainer.saves.device_arenas is None


def with_save_interval(config: Config, save_interval: int) -> Config:
    return msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, save_interval=save_interval)
    )


async def prepared_arenas(trainer: Trainer, count: int, seconds: float = 10.0) -> None:
    """Wait until the trainer's pinned pool holds ``count`` idle arenas."""
    for _ in range(int(seconds / 0.01)):
        if len(trainer.saves.pinned._idle) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(trainer.saves.pinned._idle)} idle arenas after {seconds}s, expected {count}")


@pytest.fixture
def save_memory_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's path of a background save on the CPU: its copies reused, every tensor of
    the state taken as one it copies to the host, and a host copy that copies into an arena
    of the trainer's pool (as on a GPU)."""
    from miles_events.device.host_copy import map_tensors, tensors_of

    def copy_to_the_host(obj: Any, after: Any = None, pool: Any = None) -> tuple[Any, Any]:
        return map_tensors(obj, lambda t: t.clone()), pool.take(tensors_of(obj))

    def every_tensor(self: SaveStaging) -> list[torch.Tensor] | None:
        optimizer = tensors_of(self.backend.optimizer_state_dict())
        return tensors_of(self.backend.weight_buckets()) + optimizer if optimizer else None

    monkeypatch.setattr("actors.trainer_backend.save_staging.copy_to_host", copy_to_the_host)
    monkeypatch.setattr(SaveStaging, "reuses_copies", lambda self: True)
    monkeypatch.setattr(SaveStaging, "copies_to_host", every_tensor)


@pytest.mark.usefixtures("save_memory_on_the_cpu")
async def test_the_first_saves_host_memory_is_pinned_once_trained_weights_are_published(
    base_model: Path, tmp_path: Path
) -> None:
    """With periodic saves staged in the background, the first publication after a step
    that trained has the first save's arena pinned beside the rollout that follows, and
    that save takes it; a publication before any step, or after one that trained nothing,
    pins nothing, nor does a run without periodic saves."""
    config = make_config(base_model, tmp_path, save_staging="background", on_non_finite="skip_step")
    unsaved, context = await started_trainer(config, tmp_path / "unsaved")
    unsaved.saves.pinned.pin = False
    await unsaved.handle(rollout_event(context, 0, two_group_samples()))
    await unsaved.handle(PublishRequested(rollout_id=0))
    assert not unsaved.saves.memory_prepared and unsaved.saves.pinned.num_pinned == 0, "no periodic saves"
    await unsaved.stop()

    trainer, context = await started_trainer(with_save_interval(config, 2), tmp_path)
    trainer.saves.pinned.pin = False
    await trainer.handle(PublishRequested(rollout_id=None))
    assert not trainer.saves.memory_prepared, "no optimizer state before the first step"
    await trainer.handle(rollout_event(context, 0, with_nan_reward()))
    await trainer.handle(PublishRequested(rollout_id=0))
    assert not trainer.saves.memory_prepared, "a step that trained nothing made no optimizer state"
    await trainer.handle(rollout_event(context, 1, two_group_samples()))
    await trainer.handle(PublishRequested(rollout_id=1))
    await prepared_arenas(trainer, 1)
    prepared = trainer.saves.pinned._idle[0]
    await trainer.handle(rollout_event(context, 2, two_group_samples()))
    await trainer.handle(SaveRequested(rollout_id=2, reason="interval"))
    staged = await staged_train_state(context, 2)
    assert trainer.saves.held[staged.weights.key.rsplit("-weights", 1)[0]][0] is prepared
    assert trainer.saves.pinned.num_pinned == 1, "the save took the arena pinned ahead"
    await trainer.stop()


@pytest.mark.usefixtures("save_memory_on_the_cpu")
async def test_a_save_asked_for_before_the_first_publication_pins_its_own_memory_alone(
    base_model: Path, tmp_path: Path
) -> None:
    """A save asked for with the first publication after training (a save every rollout):
    it pins its memory itself, and nothing is pinned ahead beside it."""
    config = with_save_interval(make_config(base_model, tmp_path, save_staging="background"), 1)
    trainer, context = await started_trainer(config, tmp_path)
    trainer.saves.pinned.pin = False
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval", publication_follows=True))
    await trainer.handle(PublishRequested(rollout_id=0))
    await staged_train_state(context, 0)
    assert not trainer.saves.memory_prepared and trainer.saves.pinned.num_pinned == 1
    await trainer.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_a_gpu_the_first_save_takes_the_pinned_memory_prepared_for_it(
    base_model: Path, tmp_path: Path
) -> None:
    config = with_save_interval(make_config(base_model, tmp_path, save_staging="background"), 2)
    trainer, context = await started_trainer(config, tmp_path)
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(PublishRequested(rollout_id=0))
    await prepared_arenas(trainer, 1)
    prepared = trainer.saves.pinned._idle[0]
    assert prepared.block is not None and prepared.tensors[0].is_pinned()
    await trainer.handle(SaveRequested(rollout_id=0, reason="interval"))
    staged = await staged_train_state(context, 0)
    assert trainer.saves.held[staged.weights.key.rsplit("-weights", 1)[0]][0] is prepared
    assert trainer.saves.pinned.num_pinned == 1
    await trainer.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_a_gpu_each_background_save_copies_the_state_into_the_device_memory_of_the_last(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    pointers = []
    for rollout_id in (0, 1):
        await trainer.handle(rollout_event(context, rollout_id, two_group_samples()))
        asked = {n: t.detach().cpu() for n, t in trainer.backend.named_weights().items()}
        optimizer_asked = copy.deepcopy(trainer.backend.optimizer_state_dict())
        await trainer.handle(SaveRequested(rollout_id=rollout_id, reason="interval"))
        staged = await staged_train_state(context, rollout_id)
        weights = context.transport.reader.get_tensors(staged.weights)
        assert all(torch.equal(weights[n], t) for n, t in asked.items())
        optimizer = context.transport.reader.get_state(staged.optimizer)
        for key, state in optimizer_asked["state"].items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(optimizer["state"][key][k], v.cpu()), (key, k)
        arenas = trainer.saves.device_arenas
        assert arenas is not None
        pointers.append(sorted(t.data_ptr() for arena in arenas._idle for t in arena.tensors))
    assert pointers[0] == pointers[1] and arenas.num_pinned == 1  # made once, then reused
    assert trainer.saves.device_buckets.num_allocated == 1  # the weights' buckets likewise


async def test_a_background_saves_pinned_memory_is_reused_once_the_saver_released_what_it_staged(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a CPU nothing is copied to the host: stand in for the GPU's copy into the pool's arena.
    from miles_events.device import host_copy

    def copy_into_arena(obj: Any, after: Any = None, pool: Any = None) -> tuple[Any, Any]:
        arena = pool.take([])
        return obj, arena

    monkeypatch.setattr("actors.trainer_backend.save_staging.copy_to_host", copy_into_arena)
    trainer, context = await started_trainer(
        make_config(base_model, tmp_path, save_staging="background"), tmp_path
    )
    pool: host_copy.PinnedPool = trainer.saves.pinned
    pool.pin = False

    async def staged_save(rollout_id: int) -> TrainStateStaged:
        await trainer.handle(SaveRequested(rollout_id=rollout_id, reason="interval"))
        return await staged_train_state(context, rollout_id)

    first = await staged_save(0)
    await staged_save(1)  # the first is still being written: a second arena
    assert pool.num_pinned == 2
    for ref in (first.weights, first.optimizer):
        await trainer.handle(DataReleased(ref=ref))
    await staged_save(2)
    assert pool.num_pinned == 3, "in use until every part of the save is released"
    await trainer.handle(DataReleased(ref=first.rng))
    await staged_save(3)
    assert pool.num_pinned == 3, "the first save's arena, given back, was taken again"


async def test_released_train_state_is_freed_by_its_owner(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(SaveRequested(rollout_id=0))
    staged = context.of_type(TrainStateStaged)[0]
    for ref in (staged.weights, staged.optimizer, staged.rng):
        await trainer.handle(DataReleased(ref=ref))
    with pytest.raises(KeyError):
        context.transport.reader.get_state(staged.optimizer)
    with pytest.raises(KeyError):
        context.transport.reader.get_tensors(staged.weights)


@dataclass
class LoadedCheckpoint:
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    trainer_state: TrainerState


def install_checkpoint(
    monkeypatch: pytest.MonkeyPatch, checkpoint_dir: Path, loaded: Any
) -> list[tuple[Path, bool]]:
    """The trainer reads ``loaded`` for ``checkpoint_dir``; returns the reads it made."""
    reads: list[tuple[Path, bool]] = []

    def read(path: Path, verify: bool = True) -> Any:
        assert path == checkpoint_dir
        reads.append((path, verify))
        return loaded

    monkeypatch.setattr("actors.trainer.read_checkpoint", read)
    return reads


async def test_resume_continues_training_exactly_where_the_save_left_off(
    base_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await original.handle(rollout_event(context, 0, two_group_samples()))
    await original.handle(PublishRequested(rollout_id=0))
    await original.handle(SaveRequested(rollout_id=0))
    staged = context.of_type(TrainStateStaged)[0]
    loaded = LoadedCheckpoint(
        weights={n: t.clone() for n, t in context.transport.reader.get_tensors(staged.weights).items()},
        optimizer=copy.deepcopy(context.transport.reader.get_state(staged.optimizer)),
        rng=copy.deepcopy(context.transport.reader.get_state(staged.rng)),
        trainer_state=staged.trainer_state,
    )
    checkpoint = tmp_path / "checkpoints" / "rollout-0"
    reads = install_checkpoint(monkeypatch, checkpoint, loaded)
    resumed_config = msgspec.structs.replace(
        original.config, run=msgspec.structs.replace(original.config.run, resume=True)
    )
    resumed, resumed_context = await started_trainer(
        resumed_config, tmp_path, run_id="resumed-run", load_checkpoint=checkpoint, weight_version="1"
    )
    # The plan verified the checkpoint it chose: the trainer reads it without hashing again.
    assert reads == [(checkpoint, False)]

    assert resumed.weight_version == "1"
    assert resumed.backend.num_optimizer_steps == 1
    await original.handle(rollout_event(context, 1, two_group_samples()))
    await resumed.handle(rollout_event(resumed_context, 1, two_group_samples()))
    # Same weights *and* the same Adam moments: the next step lands on identical weights.
    expected = original.backend.named_weights()
    assert all(torch.equal(t, expected[n]) for n, t in resumed.backend.named_weights().items())
    await resumed.handle(PublishRequested(rollout_id=1))
    assert resumed_context.of_type(WeightsStaged)[0].weight_version == "2"


async def test_resume_without_a_checkpoint_in_the_plan_starts_fresh(base_model: Path, tmp_path: Path) -> None:
    config = make_config(base_model, tmp_path)
    config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, resume=True))
    trainer, _ = await started_trainer(config, tmp_path)
    assert trainer.weight_version == "default"
    assert trainer.backend.num_optimizer_steps == 0


def test_the_trainer_asks_for_one_cpu() -> None:
    assert Trainer.resources(Config()) == WorkerGroup(role="actor", cpus_per_rank=1)


async def test_a_verified_publications_manifest_is_removed_and_an_unverified_one_kept(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    await trainer.handle(PublishRequested())
    first = context.of_type(WeightsStaged)[0]
    assert (tmp_path / first.checksums_manifest).is_file()
    verified = PublicationVerified(
        weight_version="1", digest=first.digest, num_tensors=first.num_tensors, engines=["engine-0"]
    )
    await trainer.handle(verified)
    assert not (tmp_path / first.checksums_manifest).exists()
    await trainer.handle(rollout_event(context, 0, two_group_samples()))
    await trainer.handle(PublishRequested(rollout_id=0))
    second = context.of_type(WeightsStaged)[1]
    # Version 2 was not verified (a mismatch, or the run stopped): its manifest names the tensors.
    await trainer.handle(msgspec.structs.replace(verified, weight_version="1"))
    assert (tmp_path / second.checksums_manifest).is_file()


async def test_a_rollout_batch_is_released_even_when_training_raises(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)

    def broken(batch: Any, cancel: Any = None) -> Any:
        raise FloatingPointError("loss is nan")

    trainer.backend.train = broken  # type: ignore[method-assign]
    event = rollout_event(context, 0, two_group_samples())
    with pytest.raises(FloatingPointError):
        await trainer.handle(event)
    assert [e.ref for e in context.of_type(DataReleased)] == [event.batch]
    assert not context.of_type(TrainStepFinished)


# --- non-finite values ---------------------------------------------------------------------------


def with_nan_reward() -> list[Sample]:
    samples = two_group_samples()
    samples[2] = msgspec.structs.replace(samples[2], reward=float("nan"))
    return samples


async def test_a_non_finite_reward_fails_the_step_naming_the_rollout_and_the_sample(
    base_model: Path, tmp_path: Path
) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    before = weights_of(trainer)
    with pytest.raises(NonFiniteError, match=r"^rollout 4: non-finite reward in 1 sample\(s\): 2 \(nan\)"):
        await trainer.handle(rollout_event(context, 4, with_nan_reward()))
    assert all(torch.equal(t, before[n]) for n, t in weights_of(trainer).items())
    assert context.of_type(DataReleased) and not context.of_type(TrainStepFinished)


async def test_skip_sample_trains_on_the_finite_rest_and_skip_step_on_nothing(
    base_model: Path, tmp_path: Path
) -> None:
    for policy, moves in (("skip_sample", True), ("skip_step", False)):
        trainer, context = await started_trainer(
            make_config(base_model, tmp_path, on_non_finite=policy), tmp_path
        )
        before = weights_of(trainer)
        await trainer.handle(rollout_event(context, 0, with_nan_reward()))
        (step,) = context.of_type(TrainStepFinished)
        assert step.metrics.num_optimizer_steps == (1 if moves else 0), policy
        assert any(not torch.equal(t, before[n]) for n, t in weights_of(trainer).items()) == moves, policy
        assert all(math.isfinite(t.abs().sum().item()) for t in weights_of(trainer).values())


async def test_a_non_finite_loss_skips_or_fails_its_step_and_nan_weights_are_never_published(
    base_model: Path, tmp_path: Path
) -> None:
    for policy in ("fail", "skip_step"):
        trainer, context = await started_trainer(
            make_config(base_model, tmp_path, on_non_finite=policy), tmp_path
        )
        with torch.no_grad():
            trainer.backend.model.model.norm.weight[0] = float("nan")  # every logit is NaN now
        if policy == "fail":
            with pytest.raises(NonFiniteError, match=r"^rollout 0, optimizer step 1 of 1: non-finite loss"):
                await trainer.handle(rollout_event(context, 0, two_group_samples()))
        else:
            await trainer.handle(rollout_event(context, 0, two_group_samples()))
            (step,) = context.of_type(TrainStepFinished)
            assert step.metrics.num_optimizer_steps == 0
        with pytest.raises(
            NonFiniteError,
            match=r"weight version 1: non-finite values in 1 tensor\(s\) \(model.norm.weight\)",
        ):
            await trainer.handle(PublishRequested(rollout_id=None))
        with pytest.raises(NonFiniteError, match="non-finite values"):
            await trainer.handle(SaveRequested(rollout_id=0))
        assert not context.of_type(WeightsStaged) and not context.of_type(TrainStateStaged)


async def test_a_cancelled_step_keeps_nothing_and_says_so(base_model: Path, tmp_path: Path) -> None:
    trainer, context = await started_trainer(make_config(base_model, tmp_path), tmp_path)
    before = weights_of(trainer)
    trainer.interrupt(StopRequested(reason="after the current step"))  # not now: trains as usual
    assert not trainer.cancel.cancelled
    trainer.interrupt(StopRequested(reason="cut", now=True))
    await trainer.handle(rollout_event(context, 5, two_group_samples()))
    (cancelled,) = context.of_type(StepCancelled)
    assert (cancelled.rollout_id, cancelled.phase, cancelled.reason) == (5, "train", "cut")
    assert context.of_type(DataReleased) and not context.of_type(TrainStepFinished)
    assert all(torch.equal(t, before[n]) for n, t in weights_of(trainer).items())
    assert trainer.backend.num_optimizer_steps == 0


def test_bfloat16_autocast_trains_the_float32_weights_near_the_float32_step(
    base_model: Path, tmp_path: Path
) -> None:
    samples = two_group_samples()
    logprobs, weights, losses = {}, {}, {}
    for mode in ("off", "bfloat16"):
        torch.manual_seed(0)
        backend = TorchTrainerBackend(make_config(base_model, tmp_path, autocast=mode))
        logprobs[mode] = torch.cat(backend.response_logprobs(samples))
        losses[mode] = backend.train(RolloutBatch(rollout_id=0, samples=samples)).loss
        weights[mode] = backend.named_weights()
    # The model stays float32 (what is published and saved); the products ran in bfloat16.
    assert all(t.dtype == torch.float32 for t in weights["bfloat16"].values())
    assert not torch.equal(logprobs["off"], logprobs["bfloat16"])
    torch.testing.assert_close(logprobs["bfloat16"], logprobs["off"], rtol=0, atol=5e-2)
    assert losses["bfloat16"] == pytest.approx(losses["off"], abs=1e-2)
    moved = [n for n, t in weights["bfloat16"].items() if not torch.equal(t, weights["off"][n])]
    assert moved, "a step in bfloat16 differs from the float32 one"
    for name, tensor in weights["bfloat16"].items():
        torch.testing.assert_close(tensor, weights["off"][name], rtol=0, atol=2e-2)
