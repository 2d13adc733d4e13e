"""Backends are chosen by config through one registry each, imported only when chosen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import actors.engine
import actors.trainer_backend
from actors.engine import build_engine, engine_class
from actors.engine.torch_engine import TorchEngine
from actors.trainer_backend import backend_class, build_backend
from actors.trainer_backend.torch_backend import TorchTrainerBackend
from schemas.config import Config, GeneratorConfig, TrainerConfig

ROOT = Path(__file__).resolve().parent.parent


class FakeBackend:
    def __init__(self, config: Config) -> None:
        self.config = config


class FakeEngine:
    @classmethod
    def from_config(cls, config: Config, *, index: int, name: str, transport: object) -> FakeEngine:
        engine = cls()
        engine.index, engine.name, engine.transport = index, name, transport  # type: ignore[attr-defined]
        return engine


def test_the_builtin_names_resolve_to_the_torch_classes():
    assert engine_class("torch") is TorchEngine
    assert backend_class("torch") is TorchTrainerBackend


@pytest.mark.parametrize(
    ("lookup", "message"),
    [
        (engine_class, "unknown engine 'vllmm'; known: sglang, torch, vllm"),
        (backend_class, "unknown trainer backend 'vllmm'; known: megatron, torch"),
    ],
)
def test_an_unknown_name_is_one_line_naming_the_known_ones(lookup, message):
    with pytest.raises(ValueError) as raised:
        lookup("vllmm")
    assert str(raised.value) == message


def test_build_backend_honours_trainer_backend(monkeypatch):
    monkeypatch.setitem(actors.trainer_backend.BACKENDS, "fake", f"{__name__}:FakeBackend")
    config = Config(trainer=TrainerConfig(backend="fake"))
    backend = build_backend(config)
    assert isinstance(backend, FakeBackend) and backend.config is config


def test_build_engine_honours_generator_engine(monkeypatch):
    monkeypatch.setitem(actors.engine.ENGINES, "fake", f"{__name__}:FakeEngine")
    plane = object()
    engine = build_engine(
        Config(generator=GeneratorConfig(engine="fake")), index=1, name="engine-1", transport=plane
    )  # type: ignore[arg-type]
    assert isinstance(engine, FakeEngine)
    assert (engine.index, engine.name, engine.transport) == (1, "engine-1", plane)  # type: ignore[attr-defined]


def test_registries_import_no_backend_until_one_is_asked_for():
    code = (
        "import sys, actors.engine, actors.trainer_backend, miles_events.app.config\n"
        "loaded = [m for m in ('actors.engine.torch_engine', 'actors.trainer_backend.torch_backend', 'torch')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
