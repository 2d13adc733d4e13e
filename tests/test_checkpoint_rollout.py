"""Rollout-only from a checkpoint: the seed's ``_verify_checkpoint_rollout_publication``.

The proof's steps and messages on their own; the Coordinator re-driven from a recorded
rollout-only run (``tests/fixtures/rollout_only_run``), as recorded and with one reply
changed per failure the seed checks for; the config's refusals; and, end to end, a real
checkpoint served on the ray runtime and a checkpoint of the bootstrap's own weights
refused with the seed's message.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from safetensors.torch import load_file

from miles_events.app.config import ConfigError, load_config
from miles_events.app.plan import make_plan
from miles_events.app.redrive import REDRIVABLE, build_actor, redrive, split_runs
from miles_events.app.session import Session
from miles_events.bus.event_log import read_events
from miles_events.checkpoint.format import CheckpointError, read_checkpoint, write_checkpoint
from miles_events.checkpoint.resume import marked_checkpoint
from miles_events.device.fingerprint import fingerprints
from miles_events.rl.checkpoint_rollout import CheckpointRolloutProof, evidence_bytes, write_evidence
from miles_events.rl.publication_checks import canonical_checksums, checksum_digest
from schemas.events import (
    CheckpointSaved,
    Event,
    PublicationEvidenceFailed,
    PublicationEvidenceRequested,
    PublicationEvidenceWritten,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    SaveRequested,
    TrainStepFinished,
    WeightsCheckFinished,
    WeightsPublished,
)
from schemas.evidence import CheckpointRolloutEvidence

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"
FIXTURE = ROOT / "tests" / "fixtures" / "rollout_only_run"

# Every key the seed's _write_checkpoint_rollout_evidence writes.
SEED_EVIDENCE_KEYS = {
    "schema", "effective_load", "ref_load", "checkpoint_iteration", "selector", "skip_tensor_substrings",
    "engine_count", "language_tensor_count", "changed_language_tensor_count",
    "reset_changed_language_tensor_count", "base_language_checksum_sha256", "served_language_checksum_sha256",
    "reset_language_checksum_sha256", "bootstrap_weight_versions", "served_weight_versions",
    "republished_weight_versions", "trained_snapshot_reset_republication_equal",
}  # fmt: skip

BASE = ((("rank0/a", "1"), ("rank0/b", "2")), (("rank0/a", "1"), ("rank0/b", "2")))
SERVED = ((("rank0/a", "3"), ("rank0/b", "2")), (("rank0/a", "3"), ("rank0/b", "2")))
RESET = ((("rank0/a", "5"), ("rank0/b", "6")), (("rank0/a", "7"), ("rank0/b", "8")))


def proven() -> CheckpointRolloutProof:
    proof = CheckpointRolloutProof()
    proof.record_base(BASE, ["default", "default"])
    proof.record_served(SERVED, ["1", "1"])
    proof.record_reset(RESET)
    proof.record_republished_versions(["2", "2"])
    proof.record_republished(SERVED)
    return proof


# --- the proof, step by step ---------------------------------------------------------------


def test_a_proven_publication_gives_the_seeds_evidence(tmp_path):
    evidence = proven().evidence(
        effective_load=str(tmp_path / "ckpt"), ref_load=str(tmp_path / "ref"), checkpoint_iteration=7
    )
    payload = msgspec.to_builtins(evidence)
    assert set(payload) == SEED_EVIDENCE_KEYS
    assert payload["schema"] == "miles.checkpoint-backed-rollout-publication.v1"
    assert (payload["selector"], payload["skip_tensor_substrings"]) == ("target", ["visual"])
    assert (payload["engine_count"], payload["language_tensor_count"]) == (2, 4)
    assert (payload["changed_language_tensor_count"], payload["reset_changed_language_tensor_count"]) == (
        2,
        4,
    )
    assert payload["base_language_checksum_sha256"] == checksum_digest(BASE)
    assert payload["served_language_checksum_sha256"] == checksum_digest(SERVED)
    assert payload["reset_language_checksum_sha256"] == checksum_digest(RESET)
    assert payload["bootstrap_weight_versions"] == ["default", "default"]
    assert (payload["served_weight_versions"], payload["republished_weight_versions"]) == (
        ["1", "1"],
        ["2", "2"],
    )
    assert (
        payload["effective_load"] == str((tmp_path / "ckpt").resolve())
        and payload["checkpoint_iteration"] == 7
    )
    # Byte for byte what the seed's json.dump(payload, sort_keys=True, separators=(",", ":")) writes.
    assert (
        evidence_bytes(evidence)
        == (json.dumps(payload, sort_keys=True, separators=(",", ":")) + "\n").encode()
    )


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (
            "versions",
            "initial checkpoint publication did not transition every inference weight version from 'default' to '1'",
        ),
        (
            "unchanged",
            "checkpoint-backed rollout publication left every language tensor identical to the HF bootstrap",
        ),
        ("reset", "inference weight reset left every selected language tensor unchanged"),
        (
            "increment",
            "checkpoint republication did not increment every inference weight version exactly once",
        ),
        ("republished", "checkpoint-backed rollout weights changed across exact republication"),
        ("roster", "inference tensor roster changed during checkpoint publication"),
    ],
)
def test_each_failed_step_raises_the_seeds_message(step, message):
    proof = CheckpointRolloutProof()
    proof.record_base(BASE, ["default", "default"])
    with pytest.raises(RuntimeError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        if step == "versions":
            proof.record_served(SERVED, ["1", "2"])
        elif step == "unchanged":
            proof.record_served(BASE, ["1", "1"])
        elif step == "roster":
            proof.record_served(((("rank0/a", "3"),), (("rank0/a", "3"),)), ["1", "1"])
        else:
            proof.record_served(SERVED, ["1", "1"])
            if step == "reset":
                proof.record_reset(SERVED)
            elif step == "increment":
                proof.record_republished_versions(["3", "2"])
            else:
                proof.record_republished(RESET)


def test_evidence_is_created_once_with_mode_0600_and_never_overwritten(tmp_path):
    evidence = proven().evidence(effective_load="a", ref_load="b", checkpoint_iteration=1)
    path = tmp_path / "evidence.json"
    write_evidence(path, evidence)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert msgspec.json.decode(path.read_bytes(), type=CheckpointRolloutEvidence) == evidence
    path.write_text("kept\n")
    with pytest.raises(FileExistsError):
        write_evidence(path, evidence)
    assert path.read_text() == "kept\n"


# --- the checkpoint root: latest_checkpointed_iteration.txt -----------------------------------


def test_the_marker_names_the_checkpoint_and_every_bad_root_is_one_line(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        marked_checkpoint(root)
    root.mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("seven\n")
    with pytest.raises(CheckpointError, match="'seven' is not an iteration number"):
        marked_checkpoint(root)
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match="names iteration 7, but .*rollout_000007 does not exist"):
        marked_checkpoint(root)


# --- the Coordinator, re-driven from the recorded run ----------------------------------------


def recorded() -> tuple[list[Event], object]:
    log = list(read_events(FIXTURE / "events.log"))
    ((run_id, events),) = split_runs(log).items()
    config = load_config(FIXTURE / "configs" / f"{run_id}.toml", check=False, recorded=True)
    return events, config


@pytest.mark.parametrize("name", sorted(REDRIVABLE))
async def test_the_recorded_rollout_only_run_redrives_to_the_same_decisions(name):
    events, config = recorded()
    actor = build_actor(name, config, events, run_dir=FIXTURE)
    result = await redrive(actor, events)
    assert result.matches, result.first_difference()


async def test_the_redriven_proof_rebuilds_the_evidence_file_the_run_wrote():
    events, config = recorded()
    actor = build_actor("coordinator", config, events, run_dir=FIXTURE)
    await redrive(actor, events)
    (request,) = [e for e in actor.context.published if isinstance(e, PublicationEvidenceRequested)]
    assert evidence_bytes(request.evidence) == (FIXTURE / "evidence.json").read_bytes()
    checks = [e for e in events if isinstance(e, WeightsCheckFinished)]
    assert [e.request_id.removeprefix("rollout_only:") for e in checks[::2]] == [
        "base", "served", "snapshot", "reset_tensors", "reset", "compare", "republished",
    ]  # fmt: skip
    assert (
        request.evidence.engine_count == 2 and request.evidence.bootstrap_weight_versions == ["default"] * 2
    )


def check_reply(events: list[Event], step: str) -> list[WeightsCheckFinished]:
    return [
        e for e in events if isinstance(e, WeightsCheckFinished) and e.request_id == f"rollout_only:{step}"
    ]


def altered(events: list[Event], step: str, **fields) -> list[Event]:
    """The log with every engine's reply to ``step`` changed, and nothing after it: what the
    Coordinator then decides is the question."""
    replies = check_reply(events, step)
    cut = events.index(replies[-1]) + 1
    return [msgspec.structs.replace(e, **fields) if e in replies else e for e in events[:cut]]


def like(events: list[Event], step: str) -> dict:
    reply = check_reply(events, step)[0]
    return {"digest": reply.digest, "checksums_manifest": reply.checksums_manifest}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # An engine whose load wrote nothing still serves the bootstrap.
        (
            lambda ev: altered(ev, "served", **like(ev, "base")),
            "checkpoint-backed rollout publication left every language tensor identical to the HF bootstrap",
        ),
        (
            lambda ev: altered(ev, "served", weight_version="2"),
            "initial checkpoint publication did not transition every inference weight version from 'default' to '1'",
        ),
        (
            lambda ev: altered(ev, "snapshot", success=False, message="no room"),
            "inference weight check 'snapshot' did not succeed on every engine",
        ),
        (
            lambda ev: altered(ev, "reset_tensors", success=False),
            "inference weight check 'reset_tensors' did not succeed on every engine",
        ),
        # A reset that wrote nothing.
        (
            lambda ev: altered(ev, "reset", **like(ev, "served")),
            "inference weight reset left every selected language tensor unchanged",
        ),
        (
            lambda ev: altered(ev, "compare", weight_version="1"),
            "checkpoint republication did not increment every inference weight version exactly once",
        ),
        (
            lambda ev: altered(ev, "compare", success=False),
            "inference weight check 'compare' did not succeed on every engine",
        ),
        (
            lambda ev: altered(ev, "republished", **like(ev, "reset")),
            "checkpoint-backed rollout weights changed across exact republication",
        ),
        (
            lambda ev: altered(ev, "base", success=False, message="not supported"),
            "inference weight checksum did not succeed: not supported",
        ),
    ],
    ids=[
        "no-op load",
        "versions",
        "snapshot",
        "reset",
        "no-op reset",
        "increment",
        "compare",
        "republished",
        "checksum",
    ],
)
async def test_each_check_the_seed_makes_fails_the_run_with_its_message(change, message):
    events, config = recorded()
    actor = build_actor("coordinator", config, events, run_dir=FIXTURE)
    inputs = change(events)
    await redrive(actor, inputs)
    published = actor.context.published
    finished = [e for e in published if isinstance(e, RunFinished)]
    assert len(finished) == 1 and finished[0].status == "failed"
    assert finished[0].reason.startswith(message), finished[0].reason
    assert not [e for e in published if isinstance(e, PublicationEvidenceRequested)]


async def test_evidence_that_cannot_be_written_fails_the_run():
    events, config = recorded()
    actor = build_actor("coordinator", config, events, run_dir=FIXTURE)
    (written,) = [e for e in events if isinstance(e, PublicationEvidenceWritten)]
    cut = events.index(written)
    failed = PublicationEvidenceFailed(path=written.path, reason=f"{written.path} exists already")
    await redrive(actor, [*events[:cut], failed])
    (finished,) = [e for e in actor.context.published if isinstance(e, RunFinished)]
    assert finished.status == "failed" and "exists already" in finished.reason
    assert not [e for e in actor.context.published if type(e).__name__ == "RolloutRequested"]


# --- the config ------------------------------------------------------------------------------


def config_with(tmp_path: Path, *overrides: str):
    return load_config(TINY, [f'run.dir="{tmp_path / "run"}"', *overrides])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["run.rollout_only_from_checkpoint=true"],
            "run.load: run.rollout_only_from_checkpoint needs the checkpoint root",
        ),
        (
            ["run.rollout_only_from_checkpoint=true", "run.load={root}"],
            "run.rollout_only_publication_evidence: required",
        ),
        (
            [
                "run.rollout_only_from_checkpoint=true",
                "run.load={root}",
                "run.rollout_only_publication_evidence={existing}",
            ],
            "exists already; evidence is never overwritten",
        ),
        (
            [
                "run.rollout_only_from_checkpoint=true",
                "run.load={root}",
                "run.rollout_only_publication_evidence={missing_dir}",
            ],
            "no such directory",
        ),
        (
            [
                "run.rollout_only_from_checkpoint=true",
                "run.load={root}",
                "run.rollout_only_publication_evidence={new}",
                "run.resume=true",
            ],
            "run.resume: run.rollout_only_from_checkpoint serves run.load",
        ),
        (
            [
                "run.rollout_only_from_checkpoint=true",
                "run.load={root}",
                "run.rollout_only_publication_evidence={new}",
                "verifier.check_weight_update_equal=true",
            ],
            "verifier.check_weight_update_equal: run.rollout_only_from_checkpoint",
        ),
        (
            ["run.rollout_only_publication_evidence={new}"],
            "set only with run.rollout_only_from_checkpoint = true",
        ),
        (["run.load={missing_dir}"], "run.load: no such directory"),
        (["run.ref_load={missing_dir}"], "run.ref_load: no such directory"),
    ],
)
def test_the_config_refuses_what_rollout_only_cannot_do(tmp_path, overrides, message):
    (tmp_path / "root").mkdir()
    (tmp_path / "existing.json").write_text("{}")
    paths = {
        "root": tmp_path / "root", "existing": tmp_path / "existing.json",
        "missing_dir": tmp_path / "nowhere" / "e.json", "new": tmp_path / "new.json",
    }  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        config_with(tmp_path, *[o.format(**{k: f'"{v}"' for k, v in paths.items()}) for o in overrides])


# --- end to end ------------------------------------------------------------------------------

SMALL = (
    "data.rollout_batch_size=16",
    "data.n_samples_per_prompt=8",
    "trainer.global_batch_size=64",
    "trainer.micro_batch_size=64",
    "metrics.port=0",
)


def run_cli(*overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "miles_events.run", str(TINY)]
    for override in (*SMALL, *overrides):
        args += ["--set", override]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-rollout training run that saved after rollout 1."""
    run_dir = tmp_path_factory.mktemp("trained")
    result = run_cli(
        f'run.dir="{run_dir}"', 'run.runtime="local"', "run.num_rollout=2", "run.save_interval=2"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


@pytest.mark.slow
def test_rollout_only_serves_the_checkpoint_proves_it_and_then_only_generates(trained, tmp_path):
    evidence_path = tmp_path / "evidence.json"
    serve = tmp_path / "serve"
    result = run_cli(
        f'run.dir="{serve}"', 'run.runtime="ray"', "run.num_rollout=4", "generator.num_engines=2",
        f'run.load="{trained / "checkpoints"}"', "run.rollout_only_from_checkpoint=true",
        f'run.rollout_only_publication_evidence="{evidence_path}"',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    log = list(read_events(serve / "events.log"))
    (started,) = [e for e in log if isinstance(e, RunStarted)]
    assert (started.rollout_only, started.checkpoint_iteration, started.start_rollout_id) == (True, 1, 2)
    # Published twice (the checkpoint, then its exact republication), then never again.
    assert [e.weight_version for e in log if isinstance(e, WeightsPublished)] == ["1", "2"]
    assert [e.rollout_id for e in log if isinstance(e, RolloutGenerated)] == [2, 3]
    assert not [e for e in log if isinstance(e, TrainStepFinished | SaveRequested | CheckpointSaved)]
    assert not (serve / "checkpoints").exists()
    assert isinstance(log[-1], RunFinished) and log[-1].status == "completed"
    assert "not trained (rollout-only)" in result.stdout

    assert stat.S_IMODE(evidence_path.stat().st_mode) == 0o600
    evidence = msgspec.json.decode(evidence_path.read_bytes(), type=CheckpointRolloutEvidence)
    assert evidence.effective_load == str((trained / "checkpoints").resolve())
    assert evidence.ref_load == str(serve / "base_model")
    assert evidence.checkpoint_iteration == int(
        (trained / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()
    )
    assert evidence.bootstrap_weight_versions == ["default", "default"]
    assert (evidence.served_weight_versions, evidence.republished_weight_versions) == (["1", "1"], ["2", "2"])
    # What the engines served is the checkpoint itself, fingerprinted here independently.
    checkpoint = read_checkpoint(trained / "checkpoints" / "rollout_000001")
    engine = {f"rank0/{name}": value for name, value in fingerprints(checkpoint.weights).items()}
    assert evidence.served_language_checksum_sha256 == checksum_digest(canonical_checksums([engine, engine]))
    base = {
        f"rank0/{n}": v
        for n, v in fingerprints(load_file(str(serve / "base_model" / "model.safetensors"))).items()
    }
    assert evidence.base_language_checksum_sha256 == checksum_digest(canonical_checksums([base, base]))
    assert evidence.changed_language_tensor_count == sum(engine[n] != base[n] for n in engine) * 2 > 0
    assert evidence.reset_changed_language_tensor_count > 0

    again = run_cli(
        f'run.dir="{tmp_path / "again"}"', 'run.runtime="local"', "run.num_rollout=4",
        f'run.load="{trained / "checkpoints"}"', "run.rollout_only_from_checkpoint=true",
        f'run.rollout_only_publication_evidence="{evidence_path}"',
    )  # fmt: skip
    assert again.returncode == 2 and "exists already; evidence is never overwritten" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_checkpoint_of_the_bootstrap_weights_is_refused_with_the_seeds_message(trained, tmp_path):
    """A checkpoint that holds the base model's own weights proves nothing: the seed fails."""
    saved = read_checkpoint(trained / "checkpoints" / "rollout_000001")
    base_dir = trained / "base_model"
    write_checkpoint(
        run_dir=tmp_path / "base_ckpt",
        base_model_dir=base_dir,
        rollout_id=saved.trainer_state.rollout_id,
        weights=load_file(str(base_dir / "model.safetensors")),
        optimizer=saved.path / "optimizer.pt",
        rng=saved.path / "rng.pt",
        trainer_state=saved.trainer_state,
    )
    evidence_path = tmp_path / "evidence.json"
    config = load_config(TINY, [
        *SMALL, f'run.dir="{tmp_path / "serve"}"', 'run.runtime="local"', "run.num_rollout=4",
        f'run.load="{tmp_path / "base_ckpt" / "checkpoints"}"', "run.rollout_only_from_checkpoint=true",
        f'run.rollout_only_publication_evidence="{evidence_path}"',
    ])  # fmt: skip
    from miles_events.app.roster import ACTORS

    result = asyncio.run(Session(config, list(ACTORS)).run())
    assert result.finished.status == "failed"
    assert result.finished.reason == (
        "checkpoint-backed rollout publication left every language tensor identical to the HF bootstrap"
    )
    assert not evidence_path.exists()
    log = list(read_events(tmp_path / "serve" / "events.log"))
    assert not [e for e in log if isinstance(e, RolloutGenerated)]


@pytest.mark.slow
def test_run_load_starts_a_training_run_from_another_runs_checkpoint(trained, tmp_path):
    config = config_with(tmp_path, f'run.load="{trained / "checkpoints"}"', "run.num_rollout=4")
    plan = make_plan(config, "local").plan
    assert plan.load_checkpoint == str(trained / "checkpoints" / "rollout_000001")
    assert (plan.start_rollout_id, plan.resumed, plan.weight_version, plan.rollout_only) == (
        2,
        True,
        "2",
        False,
    )
    assert plan.checkpoint_iteration == 1 and plan.reference_checkpoint is None

    only = config_with(
        tmp_path, f'run.ref_load="{trained / "checkpoints"}"', "run.num_rollout=4", "run.rollout_only_from_checkpoint=true",
        f'run.rollout_only_publication_evidence="{tmp_path / "e.json"}"', "trainer.use_kl_loss=true",
    )  # fmt: skip
    plan = make_plan(only, "local").plan
    # Rollout-only: the checkpoint's weights are published as version "1", as in miles.
    assert (plan.start_rollout_id, plan.resumed, plan.weight_version, plan.rollout_only) == (
        2,
        False,
        "default",
        True,
    )
    assert (
        plan.reference_checkpoint == plan.load_checkpoint == str(trained / "checkpoints" / "rollout_000001")
    )
