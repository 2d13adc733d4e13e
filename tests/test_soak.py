"""The soak, short: a run whose engines and trainer ranks heal, given four random faults
three seconds apart through the control server (``bench/soak.py``, which runs it long),
keeps every step once: none lost, none doubled, and it completes (slow: real processes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_soak_of_random_faults_keeps_every_step_once(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--rollouts",
            "16",
            "--every",
            "3",
            "--faults",
            "4",
            "--seed",
            "3",
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.match(r"RESULT faults=(\d+) lost=(\d+) doubled=(\d+) redone=\d+ .* status=(\w+)$", last)
    assert found, last
    faults, lost, doubled, status = found.groups()
    assert int(faults) >= 2 and (lost, doubled, status) == ("0", "0", "completed"), last
