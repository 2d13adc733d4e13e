"""Ray for one run: sized for what the run places, started while the driver prepares the
model, and given back whenever the run stops before its actors start."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from actors.coordinator import Coordinator
from actors.generator import Generator
from actors.trainer import Trainer
from miles_events.app.session import Session
from miles_events.checkpoint.format import CheckpointError
from miles_events.runtime.leftovers import ray_processes
from miles_events.runtime.ray import process_modules
from miles_events.runtime.ray_cluster import RayCluster, importable_by_workers
from schemas.config import BuiltinModelConfig, Config, GeneratorConfig, ModelConfig, RayConfig, RunConfig
from tests.ray_actors import Model

ONE_EACH = [{"CPU": 1.0}, {"CPU": 1.0}]


def test_a_worker_per_cpu_is_prestarted_only_when_each_hosts_an_actor_and_imports_its_module():
    cluster = RayCluster(RayConfig(num_cpus=2), ONE_EACH, [Generator, Trainer])
    assert cluster.prestart and cluster.preload == ["actors.generator", "actors.trainer"]
    assert not RayCluster(RayConfig(num_cpus=4), ONE_EACH, [Generator, Trainer]).prestart


def test_the_workers_import_the_actors_backends_and_model_module_not_only_their_own():
    """The actors' modules import torch only where they compute: a worker that imported only
    those would import torch, transformers and the model's module once given its actor."""
    config = Config(model=ModelConfig(builtin=BuiltinModelConfig(architecture="llama")))
    cluster = RayCluster(
        RayConfig(num_cpus=2), ONE_EACH, [Generator, Trainer], process_modules([Generator, Trainer], config)
    )
    assert cluster.preload == [
        "actors.engine.torch_engine",
        "actors.generator",
        "actors.trainer",
        "actors.trainer_backend.torch_backend",
        "transformers.models.llama.modeling_llama",
    ]
    vllm = msgspec.structs.replace(config, generator=GeneratorConfig(engine="vllm"))
    assert Generator.process_modules(vllm) == ["actors.generator", "actors.engine.vllm_engine"], (
        "no model in process"
    )


def test_only_modules_a_worker_can_import_without_the_drivers_directory_are_preloaded():
    assert importable_by_workers("actors.trainer") and importable_by_workers("torch")
    assert not importable_by_workers("tests.ray_actors"), "the tests run from the checkout, not installed"
    assert RayCluster(RayConfig(num_cpus=2), ONE_EACH, [Model, Trainer]).preload == ["actors.trainer"]


def test_a_cluster_sized_before_the_config_was_resolved_says_whether_it_still_fits():
    cluster = RayCluster(RayConfig(), [{"CPU": 1.0, "GPU": 1.0}], [Trainer])
    assert cluster.fits([{"CPU": 1.0, "GPU": 1.0}])
    assert not cluster.fits([{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}])
    assert not cluster.fits([{"CPU": float(cluster.num_cpus + 1)}])
    assert RayCluster(RayConfig(address="127.0.0.1:6379"), [], []).fits([{"CPU": 64.0, "GPU": 8.0}])


def ray_config(tmp_path) -> Config:
    return Config(run=RunConfig(dir=str(tmp_path), runtime="ray", num_rollout=1), ray=RayConfig(num_cpus=2))


@pytest.mark.slow
def test_a_run_that_cannot_be_planned_starts_no_ray_and_writes_nothing(tmp_path, monkeypatch):
    started: list[RayCluster] = []
    real = RayCluster.start

    def start(self: RayCluster) -> RayCluster:
        started.append(self)
        return real(self)

    def refuse(*args: object) -> None:
        raise CheckpointError("checkpoint rollout_000003: model.safetensors does not match its sha256")

    monkeypatch.setattr(RayCluster, "start", start)
    monkeypatch.setattr("miles_events.app.start_checks.make_plan", refuse)
    run_dir = tmp_path / "run"
    config = msgspec.structs.replace(
        ray_config(tmp_path), run=RunConfig(dir=str(run_dir), runtime="ray", num_rollout=1)
    )
    with pytest.raises(CheckpointError):
        Session(config, [Coordinator, Trainer])
    assert not started and not run_dir.exists()


@pytest.mark.slow
async def test_a_run_that_fails_after_ray_started_gives_ray_back(tmp_path, monkeypatch):
    session = Session(ray_config(tmp_path), [Coordinator, Trainer])
    assert session.cluster is not None

    def refuse(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("miles_events.app.session.open_transport", refuse)
    with pytest.raises(OSError):
        await session.run()
    import ray

    assert session.cluster is None and not ray.is_initialized() and not ray_processes()


@pytest.mark.slow
@pytest.mark.parametrize("agents", ["stand_in", "ray"])
def test_the_raylets_agents_are_stood_in_for_unless_rays_own_are_asked_for(agents):
    import ray

    cluster = RayCluster(RayConfig(num_cpus=1, agents=agents), [{"CPU": 1.0}], []).start()
    try:
        cluster.up.result(timeout=120)
        answer = ray.get(ray.remote(num_cpus=1)(lambda: 41 + 1).remote(), timeout=60)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid, _ in ray_processes()]
    finally:
        cluster.shutdown()
    assert answer == 42, "a task runs either way"
    rays_own = [c for c in commands if c.startswith((b"ray::DashboardAgent", b"ray::RuntimeEnvAgent"))]
    assert len(rays_own) == (2 if agents == "ray" else 0)
    assert not ray.is_initialized() and not ray_processes()


def test_the_agents_are_stood_in_for_only_while_ray_gives_them_the_raylets_pipe(monkeypatch, caplog):
    from miles_events.runtime.ray_cluster import AGENT_PIPE_SETTING, stands_in_for_agents

    monkeypatch.delenv(AGENT_PIPE_SETTING, raising=False)
    assert stands_in_for_agents(RayConfig()) and not stands_in_for_agents(RayConfig(agents="ray"))
    monkeypatch.setenv(AGENT_PIPE_SETTING, "false")
    assert not stands_in_for_agents(RayConfig())
    assert AGENT_PIPE_SETTING in caplog.text
