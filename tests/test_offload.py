"""Offload and onload (``run.offload_train``, ``run.offload_rollout``), piece by piece: the
embedded engine's release and resume by tag, the trainer's host copy, the commands the
Coordinator publishes at each point of the seed's loop, and the gate before training. The
whole sequence on a live run is ``tests/test_offload_run.py``; on a GPU, the memory really
comes free (the CUDA tests below, and ``bench/gpu/offload.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.engine.base import SamplingParams
from actors.engine.torch_engine import TorchEngine
from actors.protocols.memory import MemoryPlan, RolloutGate, gates_training, offload_tags
from actors.trainer_backend.torch_backend import TorchTrainerBackend
from schemas.config import Config, DataConfig, ModelConfig, RunConfig, TrainerConfig
from schemas.events import MemoryOffloaded, OffloadRequested, OnloadRequested
from schemas.rollout import RolloutBatch, Sample

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)
PROMPTS = ["1+2=", "3+4=", "2+2="]


def generate(engine: TorchEngine) -> list[list[int]]:
    return [c.response_ids for c in engine.generate(PROMPTS, SAMPLING, torch.Generator().manual_seed(5))]


def served_bytes(engine: TorchEngine) -> dict[str, bytes]:
    return {name: t.detach().cpu().numpy().tobytes() for name, t in engine.served_tensors().items()}


# --- the embedded engine ----------------------------------------------------------------------


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_released_weights_go_to_a_host_copy_and_come_back_bit_for_bit(model_dir: Path, decode: str) -> None:
    engine = TorchEngine.from_pretrained(model_dir, decode=decode)
    before, first = served_bytes(engine), generate(engine)
    storage = {n: t.untyped_storage().data_ptr() for n, t in engine.served_tensors().items()}
    released = engine.release_memory(["cuda_graph", "kv_cache", "weights"])
    assert released >= sum(len(b) for b in before.values())
    # Every served tensor (the model's parameters) now lives in another buffer.
    moved = {n: t.untyped_storage().data_ptr() for n, t in engine.served_tensors().items()}
    assert all(moved[n] != storage[n] for n in storage)
    # ... and the model's parameters are views of it (the host copy's buckets).
    host = {b.untyped_storage().data_ptr() for b in engine._buckets.buffers}
    assert {p.untyped_storage().data_ptr() for p in engine.model.parameters()} <= host
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache", "cuda_graph"])
    assert served_bytes(engine) == before
    assert generate(engine) == first


def test_a_released_engine_refuses_to_generate_load_or_fingerprint_until_resumed(model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(model_dir)
    engine.release_memory(["cuda_graph", "kv_cache"])
    with pytest.raises(
        RuntimeError, match="cannot generate while its cuda_graph, kv_cache memory is released"
    ):
        generate(engine)
    engine.checksums()  # the weights are still there
    engine.release_memory(["weights"])
    with pytest.raises(RuntimeError, match="cannot fingerprint its weights while its weights memory"):
        engine.checksums()
    with pytest.raises(RuntimeError, match="cannot run snapshot while"):
        engine.weights_check("snapshot")
    engine.resume_memory(["weights"])
    engine.checksums()
    with pytest.raises(RuntimeError, match="cannot generate"):
        generate(engine)  # the KV cache is still released
    engine.resume_memory(["kv_cache", "cuda_graph"])
    generate(engine)


def test_releasing_the_kv_cache_frees_the_static_decoders_buffers(model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(model_dir, decode="static")
    generate(engine)
    decoder = engine._decoder
    assert decoder is not None
    held = decoder.buffer_bytes()
    assert held > 0
    assert engine.release_memory(["cuda_graph", "kv_cache"]) == held
    assert decoder.buffer_bytes() == 0
    engine.resume_memory(["kv_cache", "cuda_graph"])
    generate(engine)
    assert decoder.buffer_bytes() > 0  # allocated again by the next decode


def test_an_unknown_tag_is_refused_naming_it(model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"unknown memory tags \['gpu'\]"):
        engine.release_memory(["gpu"])


# --- the trainer --------------------------------------------------------------------------------


def batch(rollout_id: int) -> RolloutBatch:
    samples = [
        Sample(
            index=g,
            group=g,
            prompt="",
            label="",
            prompt_ids=[3, 4, 5],
            response_ids=response,
            response_logprobs=[-1.0] * len(response),
            response="",
            reward=reward,
            weight_version="1",
            engine="engine-0",
            finish_reason="stop",
        )
        for g, (response, reward) in enumerate(
            [([7, 1], 1.0), ([9, 10, 1], 0.0), ([8, 1], 0.0), ([6, 6, 1], 1.0)]
        )
    ]
    return RolloutBatch(rollout_id=rollout_id, samples=[*samples[:2], *samples[2:]])


def backend_of(model_dir: Path, tmp_path: Path) -> TorchTrainerBackend:
    config = Config(
        run=RunConfig(dir=str(tmp_path), runtime="local", seed=3),
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(rollout_batch_size=2, n_samples_per_prompt=2),
        trainer=TrainerConfig(global_batch_size=2, use_kl_loss=True, kl_loss_coef=0.1),
    )
    return TorchTrainerBackend(config)


def state_of(backend: TorchTrainerBackend) -> list[bytes]:
    weights = [t.cpu().numpy().tobytes() for t in backend.named_weights().values()]
    moments = [
        v.cpu().numpy().tobytes()
        for s in backend.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]
    return weights + moments


def test_an_offloaded_trainer_trains_on_exactly_as_one_never_offloaded(
    model_dir: Path, tmp_path: Path
) -> None:
    plain, moved = backend_of(model_dir, tmp_path / "a"), backend_of(model_dir, tmp_path / "b")
    for rollout_id in range(3):
        plain.train(batch(rollout_id))
        moved.train(batch(rollout_id))
        held = state_of(moved)
        parts = moved.offload()
        assert moved.offloaded and parts[0].name == "rank-0" and parts[0].bytes > 0
        # Saves and publications read the host copy meanwhile; training waits for the onload.
        assert state_of(moved) == held
        with pytest.raises(RuntimeError, match="cannot train while offloaded"):
            moved.train(batch(9))
        moved.onload()
        assert state_of(moved) == held == state_of(plain)
    # The parameters are views of the trainer's buckets again, after every move.
    buckets = moved.weight_buckets()
    assert buckets is not None
    storages = {b.untyped_storage().data_ptr() for b in buckets.buffers}
    assert {p.untyped_storage().data_ptr() for p in moved.model.parameters()} <= storages


# --- the Coordinator's commands, and the gate before training ------------------------------------


def plan(**run: object) -> MemoryPlan:
    trainer = {"use_critic": bool(run.pop("use_critic", False))}
    return MemoryPlan.of(Config(run=RunConfig(**run), trainer=TrainerConfig(**trainer)))  # type: ignore[arg-type]


def summary(commands: list[OffloadRequested | OnloadRequested]) -> list[tuple[str, str, list[str]]]:
    return [("off" if isinstance(c, OffloadRequested) else "on", c.target, list(c.tags)) for c in commands]


def test_without_offload_no_point_of_the_loop_moves_memory() -> None:
    memory = plan()
    assert [memory.at_start(), memory.after_generation(0), memory.before_publication(0)] == [[], [], []]
    assert memory.after_publication(0) == []


def test_the_commands_at_each_point_are_the_seeds() -> None:
    memory = plan(offload_train=True, offload_rollout=True)
    assert summary(memory.at_start()) == [
        ("off", "rollout", ["cuda_graph", "kv_cache", "weights"]),
        ("off", "actor", []),
    ]
    assert summary(memory.after_generation(3)) == [("off", "rollout", ["cuda_graph", "kv_cache", "weights"])]
    # The seed's offload_train(), then onload_weights; the initial publication has no step.
    assert summary(memory.before_publication(3)) == [("off", "actor", []), ("on", "rollout", ["weights"])]
    assert summary(memory.before_publication(None)) == [("on", "rollout", ["weights"])]
    assert summary(memory.after_publication(3)) == [("on", "rollout", ["kv_cache", "cuda_graph"])]
    assert memory.after_generation(3)[0].rollout_id == 3


def test_with_a_critic_the_groups_offload_themselves_and_the_critic_waits_for_the_engines() -> None:
    memory = plan(offload_train=True, offload_rollout=True, use_critic=True)
    assert summary(memory.at_start())[1:] == [("off", "actor", []), ("off", "critic", [])]
    assert summary(memory.before_publication(2)) == [("on", "rollout", ["weights"])]
    config = Config(run=RunConfig(offload_rollout=True), trainer=TrainerConfig(use_critic=True))
    assert gates_training(config, "critic") and not gates_training(config, "actor")
    assert gates_training(Config(run=RunConfig(offload_rollout=True)), "actor")
    assert not gates_training(Config(run=RunConfig(offload_train=True)), "actor")


@pytest.mark.parametrize(
    ("levels", "tags"),
    [
        ([], ["cuda_graph"]),
        (["kv_cache"], ["cuda_graph", "kv_cache"]),
        (["weight"], ["cuda_graph", "weights"]),
    ],
)
def test_the_offload_level_adds_to_the_cuda_graphs(levels: list[str], tags: list[str]) -> None:
    assert offload_tags(levels) == tags


def released(rollout_id: int | None, target: str = "rollout") -> MemoryOffloaded:
    return MemoryOffloaded(target=target, rollout_id=rollout_id)  # type: ignore[arg-type]


def test_the_gate_holds_a_rollout_until_the_engines_released_its_memory_in_either_order() -> None:
    gate: RolloutGate[str] = RolloutGate(closed=True)
    assert gate.arrived(0, "r0") is None
    assert gate.released(released(None)) is None  # the start's offload belongs to no rollout
    assert gate.released(released(0, "actor")) is None
    assert gate.released(released(0)) == "r0"
    assert gate.released(released(1)) is None  # the release came first
    assert gate.arrived(1, "r1") == "r1"
    assert gate.arrived(2, "r2") is None
    assert RolloutGate(closed=False).arrived(5, "r5") == "r5"


# --- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_each_level_frees_device_memory_and_generation_comes_back_the_same(model_dir: Path) -> None:
    from miles_events.device.offload import free_device_bytes

    engine = TorchEngine.from_pretrained(model_dir, device="cuda", decode="cuda_graph")
    first = generate(engine)
    device = torch.device("cuda")
    before = free_device_bytes(device)
    engine.release_memory(["cuda_graph", "kv_cache", "weights"])
    assert free_device_bytes(device) > before
    assert all(t.device.type == "cpu" and t.is_pinned() for t in engine.served_tensors().values())
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache", "cuda_graph"])
    assert all(t.is_cuda for t in engine.served_tensors().values())
    assert generate(engine) == first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_offloaded_trainer_frees_its_state_and_trains_on_alike(
    model_dir: Path, tmp_path: Path
) -> None:
    plain, moved = backend_of(model_dir, tmp_path / "a"), backend_of(model_dir, tmp_path / "b")
    plain.train(batch(0))
    moved.train(batch(0))
    (part,) = moved.offload()
    # (A model this small frees less than the allocator's segments: what moved is checked.)
    assert part.device.startswith("cuda") and part.device_free_after >= part.device_free_before
    assert all(p.device.type == "cpu" and p.is_pinned() for p in moved.model.parameters())
    assert all(
        v.device.type == "cpu"
        for s in moved.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    host = {p.untyped_storage().data_ptr() for p in moved.model.parameters()}
    moved.onload()
    assert all(p.is_cuda for p in moved.model.parameters())
    # A second offload reuses the pinned copies of the first.
    moved.offload()
    again = {p.untyped_storage().data_ptr() for p in moved.model.parameters()}
    moved.onload()
    assert host == again
    plain.train(batch(1))
    moved.train(batch(1))
    assert state_of(moved) == state_of(plain)
