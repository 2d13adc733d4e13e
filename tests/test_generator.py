"""The Generator actor, driven through a fake context that collects what it publishes."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import torch

from actors.generator import Generator, engine_seed, sorted_versions
from miles_events.bus.actor import WorkerGroup
from miles_events.bus.workers import OwnProcesses, Worker, WorkerFactory, start_in_process
from miles_events.device.fingerprint import fingerprints
from miles_events.rl.checksum import per_gpu_checksum
from miles_events.rl.checksum_manifest import read_manifest, write_manifest
from miles_events.rl.hf_model import load_model
from miles_events.rl.prompts import load_prompts, rollout_prompts
from miles_events.rl.sample_excerpts import ELISION, cut_text
from miles_events.transport.base import Transport
from miles_events.transport.inprocess import InProcessTransport
from schemas.checksums import EngineChecksumReport
from schemas.config import (
    Config,
    DataConfig,
    GeneratorConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    VerifierConfig,
)
from schemas.events import (
    DataReleased,
    EvalFinished,
    EvalRequested,
    Event,
    RolloutGenerated,
    RolloutRequested,
    WeightsCheckFinished,
    WeightsCheckRequested,
    WeightsLoaded,
    WeightsStaged,
)
from schemas.rollout import RolloutBatch

ROLLOUT_BATCH = 4
N_SAMPLES = 3


def response_length_reward(prompt: str, response: str, label: str) -> float:
    return len(response) / 4


def half_reward(prompt: str, response: str, label: str) -> float:
    return 0.5


def full_reward(prompt: str, response: str, label: str) -> float:
    return 1.0


@dataclass
class FakeContext:
    config: Config
    run_dir: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    name: str = "generator"
    events: list[Event] = field(default_factory=list)
    transport: Transport = field(init=False)

    def __post_init__(self) -> None:
        self.transport = InProcessTransport(self.run_id)

    async def publish(self, event: Event) -> None:
        self.events.append(event)

    async def start_workers(
        self, factory: WorkerFactory, ranks: int, *, own_processes: OwnProcesses = False, only=None
    ) -> list[Worker]:
        return await start_in_process(
            factory,
            ranks,
            self.config,
            self.transport,
            self.run_dir,
            self.run_id,
            own_processes=own_processes,
            only=only,
        )

    def of(self, event_type: type[Event]) -> list:
        return [e for e in self.events if isinstance(e, event_type)]


Started = tuple[Generator, FakeContext]


def served_engines(generator: Generator) -> list:
    """The engines themselves (the local runtime hosts every rank in process)."""
    return [worker.target.engine for worker in generator.engines]


@pytest.fixture(scope="module")
def model_dir(built_in_model: Callable[[int], Path]) -> Path:
    return built_in_model(5)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(3) for b in range(4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_config(model_dir: Path, prompt_file: Path, tmp_path: Path, **rollout: object) -> Config:
    rollout_fields = {
        "max_new_tokens": 4,
        "reward_fn": f"{__name__}.response_length_reward",
        **rollout,
    }
    return Config(
        run=RunConfig(dir=str(tmp_path), seed=7, runtime="local"),
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(
            prompt_data=str(prompt_file), rollout_batch_size=ROLLOUT_BATCH, n_samples_per_prompt=N_SAMPLES
        ),
        rollout=RolloutConfig(**rollout_fields),  # type: ignore[arg-type]
        generator=GeneratorConfig(num_engines=2),
    )


async def started(config: Config, tmp_path: Path) -> Started:
    context = FakeContext(config=config, run_dir=tmp_path)
    generator = Generator(config, context)
    await generator.start()
    return generator, context


@pytest.fixture
async def actor(model_dir: Path, prompt_file: Path, tmp_path: Path) -> Started:
    return await started(make_config(model_dir, prompt_file, tmp_path), tmp_path)


def batch_of(context: FakeContext, event: RolloutGenerated) -> RolloutBatch:
    return msgspec.msgpack.decode(context.transport.reader.get_bytes(event.batch), type=RolloutBatch)


def staged_weights(model_dir: Path, scale: float) -> dict[str, torch.Tensor]:
    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    return {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in model.state_dict().items()}


def weights_staged(context: FakeContext, tensors: dict[str, torch.Tensor], version: str) -> WeightsStaged:
    ref = context.transport.stager.put_tensors(f"weights-{version}", tensors, owner="trainer")
    digest, manifest = write_manifest(context.run_dir, fingerprints(tensors))
    return WeightsStaged(
        weight_version=version,
        weights=ref,
        digest=digest,
        num_tensors=len(tensors),
        num_bytes=ref.num_bytes,
        checksums_manifest=manifest,
    )


def manifest_of(context: FakeContext, event: WeightsLoaded | WeightsCheckFinished) -> dict[str, str]:
    return read_manifest(context.run_dir, event.checksums_manifest, event.digest)


# --- rollouts ---------------------------------------------------------------------------------


def test_generator_declares_one_cpu(model_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    assert Generator.resources(make_config(model_dir, prompt_file, tmp_path)) == WorkerGroup(
        role="rollout", num_ranks=2, cpus_per_rank=1
    ), "a rank of one CPU per engine"


async def test_start_loads_one_engine_per_configured_engine(actor: Started) -> None:
    generator, _ = actor
    assert [e.name for e in served_engines(generator)] == ["engine-0", "engine-1"]
    assert all(e.weight_version == "default" for e in served_engines(generator))


async def test_rollout_yields_groups_of_samples_at_the_default_version(actor: Started) -> None:
    generator, context = actor
    await generator.handle(RolloutRequested(rollout_id=0))
    [event] = context.of(RolloutGenerated)
    batch = batch_of(context, event)
    expected = rollout_prompts(generator.prompts, 0, ROLLOUT_BATCH, 7, True)
    assert event.num_samples == len(batch.samples) == ROLLOUT_BATCH * N_SAMPLES
    assert event.weight_versions == ["default"]
    assert event.batch.owner == "generator" and event.batch.key == "rollout-0"
    assert event.response_tokens == sum(len(s.response_ids) for s in batch.samples)
    for group, prompt in enumerate(expected):
        members = [s for s in batch.samples if s.group == group]
        assert len(members) == N_SAMPLES
        identity = {(s.index, s.prompt, s.label) for s in members}
        assert identity == {(prompt.index, prompt.prompt, prompt.label)}
        assert {s.engine for s in members} == {f"engine-{group % 2}"}
    assert all(s.weight_version == "default" for s in batch.samples)
    assert [s.group for s in batch.samples] == sorted(s.group for s in batch.samples)


async def test_reward_mean_matches_recomputed_rewards(actor: Started) -> None:
    generator, context = actor
    await generator.handle(RolloutRequested(rollout_id=1))
    [event] = context.of(RolloutGenerated)
    samples = batch_of(context, event).samples
    rewards = [response_length_reward(s.prompt, s.response, s.label) for s in samples]
    assert [s.reward for s in samples] == rewards
    assert event.reward_mean == pytest.approx(sum(rewards) / len(rewards))
    assert event.reward_mean > 0


async def test_same_rollout_id_reproduces_the_identical_batch(
    model_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    batches = []
    for _ in range(2):
        generator, context = await started(make_config(model_dir, prompt_file, tmp_path), tmp_path)
        await generator.handle(RolloutRequested(rollout_id=2))
        [event] = context.of(RolloutGenerated)
        batches.append(context.transport.reader.get_bytes(event.batch))
    assert batches[0] == batches[1]


async def test_data_released_frees_only_the_generators_own_data(actor: Started) -> None:
    generator, context = actor
    await generator.handle(RolloutRequested(rollout_id=0))
    [event] = context.of(RolloutGenerated)
    foreign = context.transport.stager.put_bytes("foreign", b"x", owner="trainer")
    await generator.handle(DataReleased(ref=foreign))
    await generator.handle(DataReleased(ref=event.batch))
    assert context.transport.reader.get_bytes(foreign) == b"x"
    with pytest.raises(KeyError):
        context.transport.reader.get_bytes(event.batch)


async def test_eval_reports_reward_mean_and_full_credit_accuracy(
    model_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    eval_file = tmp_path / "eval.jsonl"
    rows = [("1+1=", "2"), ("2+2=", "4"), ("3", "3")]
    eval_file.write_text("".join(json.dumps({"input": i, "label": label}) + "\n" for i, label in rows))
    for reward_fn, accuracy in (("half_reward", 0.0), ("full_reward", 1.0)):
        config = make_config(model_dir, prompt_file, tmp_path, reward_fn=f"{__name__}.{reward_fn}")
        config.data.eval_data = str(eval_file)
        config.data.eval_n_samples_per_prompt = 2
        generator, context = await started(config, tmp_path)
        await generator.handle(EvalRequested(rollout_id=4))
        [event] = context.of(EvalFinished)
        assert event.rollout_id == 4 and event.weight_versions == ["default"]
        assert event.metrics["eval/num_samples"] == 6
        assert event.metrics["eval/reward_mean"] == (0.5 if reward_fn == "half_reward" else 1.0)
        assert event.metrics["eval/accuracy"] == accuracy


async def test_a_rollout_keeps_the_first_sample_of_its_first_prompts_in_its_event(
    model_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    config = make_config(model_dir, prompt_file, tmp_path, log_samples=3, log_sample_chars=3)
    generator, context = await started(config, tmp_path)
    await generator.handle(RolloutRequested(rollout_id=0))
    [event] = context.of(RolloutGenerated)
    samples = batch_of(context, event).samples
    firsts = [next(s for s in samples if s.group == group) for group in range(3)]
    assert [
        (k.index, k.group, k.reward, k.response_tokens, k.finish_reason, k.weight_version)
        for k in event.samples
    ] == [
        (s.index, s.group, s.reward, len(s.response_ids), s.finish_reason, s.weight_version) for s in firsts
    ]
    for kept, whole in zip(event.samples, firsts, strict=True):
        assert (kept.prompt, kept.response, kept.label) == (
            cut_text(whole.prompt, 3),
            cut_text(whole.response, 3),
            cut_text(whole.label, 3),
        )
        assert (kept.prompt_chars, kept.response_chars) == (len(whole.prompt), len(whole.response))
    assert all(len(kept.prompt) == 3 and ELISION in kept.prompt for kept in event.samples)  # 4 characters


async def test_an_eval_keeps_samples_too_and_zero_keeps_none(
    model_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    generator, context = await started(make_config(model_dir, prompt_file, tmp_path), tmp_path)
    await generator.handle(EvalRequested(rollout_id=0))
    [event] = context.of(EvalFinished)
    prompts = load_prompts(prompt_file, "input", "label")
    assert [(k.index, k.prompt, k.label) for k in event.samples] == [
        (p.index, p.prompt, p.label) for p in prompts[:4]
    ]
    config = make_config(model_dir, prompt_file, tmp_path, log_samples=0)
    generator, context = await started(config, tmp_path)
    await generator.handle(RolloutRequested(rollout_id=0))
    await generator.handle(EvalRequested(rollout_id=0))
    assert [e.samples for e in context.events] == [[], []]


async def test_eval_falls_back_to_the_prompt_data(actor: Started, prompt_file: Path) -> None:
    generator, context = actor
    await generator.handle(EvalRequested(rollout_id=0))
    [event] = context.of(EvalFinished)
    assert event.metrics["eval/num_samples"] == len(load_prompts(prompt_file, "input", "label"))


# --- weights ----------------------------------------------------------------------------------


async def test_weights_staged_loads_every_engine_and_reports_served_checksums(
    actor: Started, model_dir: Path
) -> None:
    generator, context = actor
    tensors = staged_weights(model_dir, 0.01)
    staged = weights_staged(context, tensors, "1")
    await generator.handle(staged)
    loaded = context.of(WeightsLoaded)
    assert [e.engine for e in loaded] == ["engine-0", "engine-1"]
    for event in loaded:
        assert (event.weight_version, event.previous_version) == ("1", "default")
        assert manifest_of(context, event) == fingerprints(tensors)
        assert (event.digest, event.checksums_manifest) == (staged.digest, staged.checksums_manifest)
        assert event.num_tensors == len(tensors)
        assert event.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # The staged weights belong to their stager: still readable.
    assert set(context.transport.reader.get_tensors(staged.weights)) == set(tensors)


async def test_engines_are_handed_the_handle_and_read_the_weights_themselves(
    actor: Started, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generator, context = actor
    staged = weights_staged(context, staged_weights(model_dir, 0.01), "1")
    handed: list[tuple[str, object]] = []
    reads: list[str | None] = []  # the engine loading when the transport was read, else None
    loading = threading.local()  # engines load concurrently, each on a thread
    for engine in served_engines(generator):
        load = engine.load_weights

        def spy(weights, version, engine=engine, load=load):  # type: ignore[no-untyped-def]
            handed.append((engine.name, weights))
            loading.engine = engine.name
            try:
                return load(weights, version)
            finally:
                loading.engine = None

        monkeypatch.setattr(engine, "load_weights", spy)
    get_tensors = context.transport.reader.get_tensors

    def read(ref):  # type: ignore[no-untyped-def]
        reads.append(getattr(loading, "engine", None))
        return get_tensors(ref)

    monkeypatch.setattr(context.transport.reader, "get_tensors", read)
    await generator.handle(staged)
    assert sorted(handed) == [("engine-0", staged.weights), ("engine-1", staged.weights)]
    reads.sort()
    assert reads == ["engine-0", "engine-1"], "only the engines read the staged tensors"


async def test_rollouts_after_a_load_carry_the_new_version(actor: Started, model_dir: Path) -> None:
    generator, context = actor
    await generator.handle(weights_staged(context, staged_weights(model_dir, 0.01), "1"))
    await generator.handle(RolloutRequested(rollout_id=0))
    [event] = context.of(RolloutGenerated)
    assert event.weight_versions == ["1"]


async def test_loaded_checksums_leave_out_the_verifier_skip_list(
    model_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    config = make_config(model_dir, prompt_file, tmp_path)
    config.verifier = VerifierConfig(skip_tensor_list=["norm"])
    generator, context = await started(config, tmp_path)
    tensors = staged_weights(model_dir, 0.01)
    await generator.handle(weights_staged(context, tensors, "1"))
    for event in context.of(WeightsLoaded):
        assert manifest_of(context, event) == fingerprints(tensors, ["norm"])
        assert event.digest == per_gpu_checksum(fingerprints(tensors, ["norm"]))


async def test_weights_with_a_missing_tensor_fail_the_load(actor: Started, model_dir: Path) -> None:
    generator, context = actor
    tensors = staged_weights(model_dir, 0.01)
    del tensors["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        await generator.handle(weights_staged(context, tensors, "1"))
    assert context.of(WeightsLoaded) == []


async def test_checksum_check_reports_each_engines_served_checksums(actor: Started, model_dir: Path) -> None:
    generator, context = actor
    request = WeightsCheckRequested(action="checksum", skip_tensor_list=["norm"], request_id="r1")
    await generator.handle(request)
    finished = context.of(WeightsCheckFinished)
    # Flattened as miles flattens a checksum reply: every name under its rank.
    expected = {
        f"rank0/{name}": value
        for name, value in fingerprints(load_model(model_dir).state_dict(), ["norm"]).items()
    }
    assert [e.engine for e in finished] == ["engine-0", "engine-1"]
    for event in finished:
        assert event.success and event.action == "checksum" and event.request_id == "r1"
        assert manifest_of(context, event) == expected and event.digest == per_gpu_checksum(expected)
        assert event.num_tensors == len(expected)
        assert event.weight_version == "default"


def repeating_rank_zero(engine) -> None:  # type: ignore[no-untyped-def]
    """``engine`` answers the checksum action with its rank 0 reported twice (a test double
    of an engine's reply, inside this unit test of the Generator)."""
    real = engine.checksums

    def checksums(skip_tensor_list=(), selector="all"):  # type: ignore[no-untyped-def]
        report = real(skip_tensor_list, selector)
        return msgspec.structs.replace(report, ranks=[*report.ranks, *report.ranks])

    engine.checksums = checksums


async def test_a_load_whose_checksum_reply_repeats_a_rank_reports_it_in_weights_loaded(
    actor: Started, model_dir: Path
) -> None:
    generator, context = actor
    repeating_rank_zero(served_engines(generator)[1])
    await generator.handle(weights_staged(context, staged_weights(model_dir, 0.01), "1"))
    good, bad = context.of(WeightsLoaded)
    assert (good.engine, good.checksum_error) == ("engine-0", "") and good.digest
    assert bad.engine == "engine-1" and bad.weight_version == "1"
    assert bad.checksum_error == "engine-1: the checksum reply reports rank 0 twice"
    assert (bad.digest, bad.checksums_manifest, bad.num_tensors) == ("", "", 0)


async def test_a_load_whose_checksum_action_failed_reports_it_in_weights_loaded(
    actor: Started, model_dir: Path
) -> None:
    generator, context = actor
    engine = served_engines(generator)[0]
    engine.checksums = lambda *args: EngineChecksumReport(success=False, message="out of memory")
    await generator.handle(weights_staged(context, staged_weights(model_dir, 0.01), "1"))
    bad = context.of(WeightsLoaded)[0]
    assert bad.checksum_error == "engine-0: the checksum action failed: out of memory" and bad.digest == ""


async def test_a_checksum_check_whose_reply_repeats_a_rank_is_an_unsuccessful_check_naming_the_engine(
    actor: Started,
) -> None:
    generator, context = actor
    repeating_rank_zero(served_engines(generator)[1])
    await generator.handle(WeightsCheckRequested(action="checksum", request_id="r1"))
    good, bad = context.of(WeightsCheckFinished)
    assert good.success and good.digest
    assert (bad.engine, bad.success) == ("engine-1", False)
    assert bad.message == "engine-1: the checksum reply reports rank 0 twice"
    assert (bad.digest, bad.checksums_manifest, bad.num_tensors) == ("", "", 0)


async def test_a_checksum_check_without_ranks_is_an_unsuccessful_check(actor: Started) -> None:
    generator, context = actor
    served_engines(generator)[0].checksums = lambda *args: EngineChecksumReport(success=True)
    await generator.handle(WeightsCheckRequested(action="checksum"))
    bad = context.of(WeightsCheckFinished)[0]
    assert not bad.success and bad.message == "engine-0: the checksum reply has no ranks"


async def test_compare_check_fails_after_reset_and_passes_after_republication(
    actor: Started, model_dir: Path
) -> None:
    generator, context = actor
    await generator.handle(WeightsCheckRequested(action="snapshot"))
    await generator.handle(WeightsCheckRequested(action="reset_tensors"))
    await generator.handle(WeightsCheckRequested(action="compare", request_id="after-reset"))
    await generator.handle(weights_staged(context, load_model(model_dir).state_dict(), "1"))
    await generator.handle(WeightsCheckRequested(action="compare", request_id="after-load"))
    outcome = {(e.request_id, e.engine): e for e in context.of(WeightsCheckFinished) if e.action == "compare"}
    for engine in ("engine-0", "engine-1"):
        assert not outcome["after-reset", engine].success
        assert outcome["after-load", engine].success
        assert outcome["after-load", engine].weight_version == "1"
        assert (outcome["after-load", engine].digest, outcome["after-load", engine].checksums_manifest) == (
            "",
            "",
        )
        assert outcome["after-load", engine].num_tensors == len(load_model(model_dir).state_dict())


# --- pure functions ---------------------------------------------------------------------------


def test_engine_seeds_differ_by_rollout_engine_and_kind() -> None:
    seeds = {engine_seed(7, kind, r, i) for kind in ("rollout", "eval") for r in range(3) for i in range(2)}
    assert len(seeds) == 12
    assert engine_seed(7, "rollout", 1, 0) == engine_seed(7, "rollout", 1, 0)


def test_versions_sort_oldest_first() -> None:
    assert sorted_versions(["10", "default", "9", "10"]) == ["default", "9", "10"]


async def test_an_engine_that_fails_a_rollout_stops_the_others_and_is_named(actor: Started) -> None:
    generator, context = actor
    failing, other = generator.engines[1].target, generator.engines[0].target
    finished: list[str] = []
    real_generate = other.generate

    def generate(*args):  # type: ignore[no-untyped-def]
        try:
            return real_generate(*args)
        finally:
            finished.append("engine-0")

    def broken(*args):  # type: ignore[no-untyped-def]
        raise ConnectionError("the server went away")

    other.generate, failing.generate = generate, broken
    with pytest.raises(Exception, match="engine-1: ConnectionError: the server went away"):
        await generator.handle(RolloutRequested(rollout_id=0))
    assert finished == ["engine-0"], "the other engine's call was waited for, not left running"
    assert other.cancellation.cancelled, "and told to stop at its next decode step"
    assert not context.of(RolloutGenerated)
