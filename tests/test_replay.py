"""Replay: the Coordinator and the Verifier, re-driven from a log recorded by a real run
(tests/fixtures/tiny_run: 3 rollouts, 2 engines, eval and saves), make the recorded
decisions; changed inputs make different ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from miles_events.app.config import load_config
from miles_events.app.redrive import build_actor, decision, redrive, split_runs
from miles_events.app.replay import main as replay_main
from miles_events.bus.event_log import FRAME_SIZE, LogReader, read_events
from miles_events.rl.checksum_manifest import read_manifest, write_manifest
from schemas.events import (
    PublicationMismatch,
    PublicationVerified,
    RankStep,
    RunStarted,
    SaveRequested,
    TrainStepFinished,
    WeightsLoaded,
)

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_run"


@pytest.fixture(scope="module")
def recorded():
    runs = split_runs(read_events(FIXTURE / "events.log"))
    assert len(runs) == 1
    ((run_id, events),) = runs.items()
    return events, load_config(FIXTURE / "configs" / f"{run_id}.toml", check=False)


def async_counts(config, kinds) -> None:
    assert config.run.max_staleness == 2 and config.run.staleness_policy == "wait"
    # Three rollouts asked for before the first step is trained.
    assert kinds[: kinds.index("TrainStepFinished")].count("RolloutRequested") == 3
    assert kinds.count("TrainStepFinished") == 8 and kinds.count("PublicationVerified") == 9


@pytest.mark.parametrize("name", ["coordinator", "verifier", "publisher"])
async def test_redriven_actor_makes_the_recorded_decisions(recorded, name):
    events, config = recorded
    result = await redrive(build_actor(name, config, events, run_dir=FIXTURE), events)
    assert result.inputs > 0 and result.expected
    assert result.matches, result.first_difference()


async def test_the_coordinator_follows_its_config_not_the_record(recorded):
    events, config = recorded
    without_eval = msgspec.structs.replace(
        config, run=msgspec.structs.replace(config.run, eval_interval=None)
    )
    result = await redrive(build_actor("coordinator", without_eval, events), events)
    assert not result.matches
    assert "EvalRequested" in result.first_difference()


def tamper_engine_1_at_version_3(events, tamper):
    """The log with engine-1's WeightsLoaded of version 3 replaced by ``tamper(event)``."""
    out = []
    for event in events:
        if isinstance(event, WeightsLoaded) and event.engine == "engine-1" and event.weight_version == "3":
            event = tamper(event)
        out.append(event)
    return out


async def test_a_tampered_engine_checksum_turns_verified_into_mismatch(recorded, tmp_path):
    events, config = recorded
    shutil.copytree(FIXTURE / "checksums", tmp_path / "checksums")
    named: list[str] = []

    def one_tensor_changed(event):
        checksums = read_manifest(FIXTURE, event.checksums_manifest, event.digest)
        named.append(sorted(checksums)[0])
        digest, manifest = write_manifest(tmp_path, {**checksums, named[0]: "0" * 16})
        return msgspec.structs.replace(event, digest=digest, checksums_manifest=manifest)

    tampered = tamper_engine_1_at_version_3(events, one_tensor_changed)
    verifier = build_actor("verifier", config, tampered, run_dir=tmp_path)
    result = await redrive(verifier, tampered)
    assert not result.matches
    decided = verifier.context.published
    assert [type(e) for e in decided].count(PublicationVerified) == len(decided) - 1
    mismatch = next(e for e in decided if isinstance(e, PublicationMismatch))
    assert mismatch.weight_version == "3"
    assert [(m.engine, m.tensor) for m in mismatch.mismatches] == [("engine-1", named[0])]


async def test_a_tampered_digest_without_its_manifest_is_a_mismatch_naming_why(recorded):
    events, config = recorded
    tampered = tamper_engine_1_at_version_3(events, lambda e: msgspec.structs.replace(e, digest="0" * 64))
    verifier = build_actor("verifier", config, tampered, run_dir=FIXTURE)
    await redrive(verifier, tampered)
    mismatch = next(e for e in verifier.context.published if isinstance(e, PublicationMismatch))
    [only] = mismatch.mismatches
    assert (only.engine, only.tensor, only.actual) == ("engine-1", "*", "0" * 64)
    assert "holds the checksums of digest" in only.reason


def test_the_replay_cli_redrives_the_fixture(capsys):
    assert replay_main([str(FIXTURE / "events.log"), "--redrive", "coordinator,verifier"]) == 0
    out = capsys.readouterr().out
    assert out.count("same decisions") == 2


def test_the_replay_cli_reports_different_decisions_with_exit_1(tmp_path, capsys, recorded):
    events, _config = recorded
    run_id = events[0].run_id
    changed = tmp_path / "changed.toml"
    text = (
        (FIXTURE / "configs" / f"{run_id}.toml").read_text().replace("save_interval = 2", "save_interval = 1")
    )
    changed.write_text(text)
    assert (
        replay_main([str(FIXTURE / "events.log"), "--redrive", "coordinator", "--config", str(changed)]) == 1
    )
    assert "DIFFERENT" in capsys.readouterr().out


def damaged_copy_of_the_fixture(tmp_path: Path, damage) -> Path:
    """The fixture run directory copied to ``tmp_path``, its log replaced by what
    ``damage(data, offsets)`` makes of the log's bytes and its records' offsets."""
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    log = tmp_path / "events.log"
    data = bytearray(log.read_bytes())
    log.write_bytes(bytes(damage(data, [offset for offset, _ in LogReader(log).records()])))
    return log


def test_the_replay_cli_redrives_the_readable_part_of_a_log_damaged_in_the_middle(tmp_path, capsys):
    def flip_a_saver_record(data, offsets):
        # A DataReleased of the saver: neither actor's input nor decision.
        data[offsets[36] + FRAME_SIZE + 4] ^= 0x40
        return data

    log = damaged_copy_of_the_fixture(tmp_path, flip_a_saver_record)
    offsets = [offset for offset, _ in LogReader(FIXTURE / "events.log").records()]
    assert replay_main([str(log), "--redrive", "coordinator,verifier"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("same decisions") == 2
    [warning] = captured.err.splitlines()
    assert warning.startswith(f"replay: warning: {log}: bytes {offsets[36]}..{offsets[37]} damaged, skipped")


def test_the_replay_cli_redrives_the_complete_part_of_a_torn_log_with_a_warning(tmp_path, capsys):
    log = damaged_copy_of_the_fixture(tmp_path, lambda data, offsets: data[: offsets[-1] + FRAME_SIZE + 12])
    last = [offset for offset, _ in LogReader(FIXTURE / "events.log").records()][-1]
    length = (FIXTURE / "events.log").stat().st_size - last - FRAME_SIZE
    assert replay_main([str(log), "--redrive", "verifier"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("same decisions") == 1
    assert captured.err.splitlines() == [
        f"replay: warning: {log}: torn record at byte {last}: short payload (12 of {length} bytes); "
        "re-driving the 59 records before it"
    ]


def test_a_decision_is_what_happens_not_the_header_timings_or_scheduling_advice():
    asked = SaveRequested(
        rollout_id=4, reason="interval", publication_follows=True, seq=9, time=1.5, source="coordinator"
    )
    assert decision(asked) == ("SaveRequested", {"rollout_id": 4, "reason": "interval"})
    # A log written before the advice existed records the same decision.
    assert decision(asked) == decision(SaveRequested(rollout_id=4, reason="interval"))
    assert decision(asked) != decision(SaveRequested(rollout_id=4, reason="stop"))


def test_a_train_steps_per_rank_timings_and_memory_are_not_part_of_its_decision():
    """Each rank's time, memory and pid differ from run to run, as ``train_seconds`` does; a
    log written before ranks were reported records the same decision."""
    ranks = [
        RankStep(rank=r, pid=100 + r, step_seconds=1.0 + r, peak_memory_bytes=1 << 30, state_bytes=1 << 20)
        for r in (0, 1)
    ]
    step = TrainStepFinished(rollout_id=2, weight_version="2", train_seconds=2.5, ranks=ranks)
    assert decision(step) == decision(TrainStepFinished(rollout_id=2, weight_version="2"))
    assert decision(step) != decision(TrainStepFinished(rollout_id=3, weight_version="2"))


def test_the_recorded_log_predates_ranks_and_reads_as_a_one_rank_trainer(recorded):
    events, _ = recorded
    steps = [e for e in events if isinstance(e, TrainStepFinished)]
    (started,) = [e for e in events if isinstance(e, RunStarted)]
    assert len(steps) == 3 and all(step.ranks == [] for step in steps)
    assert (started.trainer_ranks, started.trainer_sharding) == (1, "none")


@pytest.mark.parametrize(("rollout_id", "first", "last"), [(0, 9, 21), (1, 22, 40), (2, 41, 59)])
def test_a_rollout_filter_follows_the_rollout_into_its_publication_save_and_eval(
    rollout_id, first, last, capsys
):
    """Every event of the rollout: its eval, generation and train step, the publication it
    triggered (staged, each engine's load, published, verified), its save, and the release
    of each data reference those events made; the initial publication and the run's start
    and end belong to no rollout."""
    assert replay_main([str(FIXTURE), "--json", "--rollout-id", str(rollout_id)]) == 0
    seqs = [msgspec.json.decode(line)["seq"] for line in capsys.readouterr().out.splitlines()]
    assert seqs == list(range(first, last + 1))


def recorded_config_path(events) -> Path:
    return FIXTURE / "configs" / f"{events[0].run_id}.toml"


def test_redrive_names_the_recorded_config_it_used_before_the_verdicts(recorded, capsys):
    events, _config = recorded
    assert replay_main([str(FIXTURE / "events.log"), "--redrive", "coordinator,verifier"]) == 0
    config_line, *verdicts = capsys.readouterr().out.splitlines()
    assert (
        config_line
        == f"run {events[0].run_id}: config {recorded_config_path(events)}, the one recorded for the run"
    )
    assert [line.split()[0] for line in verdicts] == ["coordinator", "verifier"]


def test_redrive_names_the_keys_a_given_config_changes_before_the_verdict(tmp_path, capsys, recorded):
    events, _config = recorded
    changed = tmp_path / "changed.toml"
    text = recorded_config_path(events).read_text()
    changed.write_text(
        text.replace("save_interval = 2", "save_interval = 1").replace("lr = 0.003", "lr = 0.01")
    )
    assert (
        replay_main([str(FIXTURE / "events.log"), "--redrive", "coordinator", "--config", str(changed)]) == 1
    )
    config_line, verdict = capsys.readouterr().out.splitlines()
    assert config_line == (
        f"run {events[0].run_id}: config {changed} differs from the recorded {recorded_config_path(events)} "
        "in run.save_interval (2 -> 1), trainer.lr (0.003 -> 0.01)"
    )
    assert verdict.startswith("coordinator") and "DIFFERENT" in verdict


def test_redrive_with_a_changed_config_that_decides_the_same_still_names_the_change(
    tmp_path, capsys, recorded
):
    events, _config = recorded
    changed = tmp_path / "changed.toml"
    changed.write_text(recorded_config_path(events).read_text().replace("lr = 0.003", "lr = 0.01"))
    assert (
        replay_main([str(FIXTURE / "events.log"), "--redrive", "coordinator", "--config", str(changed)]) == 0
    )
    config_line, verdict = capsys.readouterr().out.splitlines()
    assert config_line.endswith(
        f"differs from the recorded {recorded_config_path(events)} in trainer.lr (0.003 -> 0.01)"
    )
    assert verdict.endswith("same decisions")


def test_redrive_with_a_copy_of_the_recorded_config_says_it_is_the_same(tmp_path, capsys, recorded):
    events, _config = recorded
    copy = tmp_path / "copy.toml"
    shutil.copy(recorded_config_path(events), copy)
    assert replay_main([str(FIXTURE / "events.log"), "--redrive", "coordinator", "--config", str(copy)]) == 0
    config_line, _verdict = capsys.readouterr().out.splitlines()
    assert config_line == (
        f"run {events[0].run_id}: config {copy}, the same as the recorded {recorded_config_path(events)}"
    )


def test_redrive_says_when_no_recorded_config_is_there_to_compare_with(tmp_path, capsys, recorded):
    events, _config = recorded
    shutil.copy(FIXTURE / "events.log", tmp_path / "events.log")
    given = recorded_config_path(events)
    assert (
        replay_main([str(tmp_path / "events.log"), "--redrive", "coordinator", "--config", str(given)]) == 0
    )
    config_line, _verdict = capsys.readouterr().out.splitlines()
    missing = tmp_path / "configs" / f"{events[0].run_id}.toml"
    assert config_line == (
        f"run {events[0].run_id}: config {given}; the recorded {missing} is missing: not compared"
    )


FIXTURES = Path(__file__).parent / "fixtures"


def offload_counts(config, kinds) -> None:
    assert config.run.offload_train and config.run.offload_rollout
    # Two at the start, then per step: after generation, the trainer's, onload weights, onload KV.
    assert kinds.count("OffloadRequested") == 2 + 2 * 3 and kinds.count("OnloadRequested") == 2 + 2 * 3


def ppo_counts(config, kinds) -> None:
    assert config.trainer.use_critic and config.trainer.num_critic_only_steps == 1
    assert kinds.count("CriticStepFinished") == 3 and kinds.count("CriticStateStaged") == 2


def heal_counts(config, kinds) -> None:
    assert config.run.ft_components == ["rollout"] and config.run.control_server_port
    assert kinds.count("CellRestarted") == 2 and kinds.count("CellResumed") == 1
    assert kinds.count("RestoreVerified") == 3 and kinds.count("CheckpointRequested") == 1


def trainer_heal_counts(config, kinds) -> None:
    assert config.run.ft_components == ["train"] and config.trainer.num_ranks == 2
    assert kinds.count("CellFailed") == 1 and kinds.count("CellRestarted") == 2
    assert kinds.count("TrainerRestoreRequested") == 1 and kinds.count("TrainerRestored") == 1
    assert kinds.count("TrainStepFinished") == 12  # 3 and 4 trained twice (5 died in training)


@pytest.mark.parametrize("name", ["coordinator", "verifier", "publisher"])
@pytest.mark.parametrize(
    ("fixture", "check"),
    [
        ("ppo_run", ppo_counts),
        ("offload_run", offload_counts),
        ("heal_run", heal_counts),
        ("trainer_heal_run", trainer_heal_counts),
        ("async_run", async_counts),
    ],
)
async def test_a_run_of_a_seed_branch_redrives_to_the_recorded_decisions(name, fixture, check):
    """PPO with a critic, offload and onload, engines that heal (the Verifier's verdicts
    on restored engines, the Publisher's publications without a suspended one, a save asked
    for through the control server), and a trainer that heals (the Coordinator's restore of
    the latest checkpoint and the rollouts it asks for again), each re-driven from a
    recorded run, and an asynchronous run (the Coordinator's schedule of rollouts ahead and
    of held publications)."""
    runs = split_runs(read_events(FIXTURES / fixture / "events.log"))
    ((run_id, events),) = runs.items()
    config = load_config(FIXTURES / fixture / "configs" / f"{run_id}.toml", check=False)
    check(config, [type(e).__name__ for e in events])
    result = await redrive(build_actor(name, config, events, run_dir=FIXTURES / fixture), events)
    assert result.inputs > 0 and result.expected
    assert result.matches, result.first_difference()
