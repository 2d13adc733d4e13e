"""The process of ``python -m miles_events.run`` caps glibc's malloc arenas, unless the
user set ``MALLOC_ARENA_MAX``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CAP = "from miles_events.runtime.malloc import cap_this_process; print(cap_this_process())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_arenas_are_capped_unless_the_user_set_them() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    capped = subprocess.run([sys.executable, "-c", CAP], capture_output=True, text=True, env=env, timeout=60)
    assert capped.stdout.strip() == "True", capped.stderr
    left = subprocess.run(
        [sys.executable, "-c", CAP],
        capture_output=True,
        text=True,
        env={**env, "MALLOC_ARENA_MAX": "8"},
        timeout=60,
    )
    assert left.stdout.strip() == "False", left.stderr
