"""The CI set-up scripts: a second run over a complete environment starts no Python (no
pip) and returns at once; a change to what the environment is made from sets it up again.
Each script runs in a copy of the repository whose environments' ``python`` is a stand-in
that logs its arguments and answers as the real one would."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "{log}"
case "$*" in
    *sysconfig*) echo "{purelib}" ;;
    *torch.__version__*) echo "2.13.0+cpu" ;;
esac
exit 0
"""


def checkout(tmp_path: Path, *scripts: str) -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    for script in scripts:
        shutil.copy(REPO / ".ci" / script, repo / ".ci" / script)
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    return repo


def stand_in_python(repo: Path, venv: str, log: Path) -> None:
    python = repo / venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    purelib = repo / venv / "lib" / "site-packages"
    purelib.mkdir(parents=True)
    python.write_text(STAND_IN.format(log=log, purelib=purelib))
    python.chmod(0o755)


def run(repo: Path, script: str) -> None:
    result = subprocess.run(["bash", f".ci/{script}"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_setup_installs_once_and_again_only_when_pyproject_changes(tmp_path: Path):
    repo = checkout(tmp_path, "setup")
    log = tmp_path / "python.log"
    stand_in_python(repo, ".venv", log)
    run(repo, "setup")
    assert [c.split()[:3] for c in calls(log)] == [["-m", "pip", "install"]] * 3
    log.unlink()
    run(repo, "setup")
    assert calls(log) == [], "a complete .venv runs pip again"
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    run(repo, "setup")
    assert len(calls(log)) == 3


def test_setup_trl_checks_once_and_again_only_when_the_project_venv_is_set_up_again(tmp_path: Path):
    repo = checkout(tmp_path, "setup", "setup-trl")
    log = tmp_path / "python.log"
    stand_in_python(repo, ".venv", log)
    stand_in_python(repo, ".venv-trl", log)
    run(repo, "setup")
    run(repo, "setup-trl")
    assert any("trl" in c for c in calls(log))
    log.unlink()
    run(repo, "setup")
    run(repo, "setup-trl")
    assert calls(log) == [], "a complete .venv-trl starts Python again"
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    run(repo, "setup")
    log.unlink()
    run(repo, "setup-trl")
    assert any("trl" in c for c in calls(log)), "a .venv set up again leaves .venv-trl unchecked"
