"""The run plan: the loop's bounds as miles derives them, and where a resumed run picks up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_events.app.plan import make_plan, set_aside_all
from miles_events.checkpoint.format import CheckpointError, write_checkpoint
from miles_events.rl.prompts import DataError
from schemas.checkpoint import DataCursor, TrainerState
from schemas.config import Config, DataConfig, RunConfig, TrainerConfig
from schemas.events import run_started

TINY_PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith_train.jsonl"


def config(tmp_path: Path, prompts: Path | None = TINY_PROMPTS, **run: object) -> Config:
    data = DataConfig(prompt_data=str(prompts) if prompts else "", rollout_batch_size=64)
    return Config(run=RunConfig(dir=str(tmp_path), **run), data=data)  # type: ignore[arg-type]


def prompts(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i}+0=", "label": str(i)}) + "\n" for i in range(n)))
    return path


def test_a_given_num_rollout_has_no_epoch_boundary(tmp_path):
    """The embedded default: 55 prompts, batches of 64, num_rollout = 50. In miles the rollouts
    per epoch are None then, so intervals alone trigger evals and saves."""
    plan = make_plan(config(tmp_path, num_rollout=50), "local").plan
    assert plan.num_rollout == 50 and plan.num_rollout_per_epoch is None


def test_an_unset_num_rollout_is_epochs_of_whole_batches(tmp_path):
    plan = make_plan(config(tmp_path, prompts(tmp_path, 200), num_epoch=3), "local").plan
    assert plan.num_rollout_per_epoch == 3 and plan.num_rollout == 9


def test_an_unset_num_rollout_with_fewer_prompts_than_a_batch_is_one_clear_error(tmp_path):
    with pytest.raises(
        DataError, match=r"55 prompts, fewer than one rollout batch \(data.rollout_batch_size = 64\)"
    ):
        make_plan(config(tmp_path), "local")


def test_a_fresh_plan_starts_at_rollout_zero_with_default_weights(tmp_path):
    plan = make_plan(config(tmp_path, num_rollout=3, resume=True), "ray").plan
    assert (plan.start_rollout_id, plan.weight_version, plan.resumed, plan.load_checkpoint) == (
        0,
        "default",
        False,
        None,
    )
    assert plan.engines == ("engine-0",) and plan.runtime == "ray"


@pytest.mark.parametrize(
    ("num_ranks", "sharding", "announced"),
    [(1, "auto", (1, "none")), (2, "auto", (2, "fsdp2")), (4, "ddp", (4, "ddp"))],
)
def test_the_plan_carries_the_trainers_ranks_and_resolved_sharding(tmp_path, num_ranks, sharding, announced):
    base = config(tmp_path, num_rollout=3)
    trainer = TrainerConfig(num_ranks=num_ranks, sharding=sharding)
    plan = make_plan(Config(run=base.run, data=base.data, trainer=trainer), "local").plan
    assert (plan.trainer_ranks, plan.trainer_sharding) == announced
    assert (run_started(plan).trainer_ranks, run_started(plan).trainer_sharding) == announced


def test_start_rollout_id_overrides_the_start(tmp_path):
    assert make_plan(config(tmp_path, num_rollout=9, start_rollout_id=4), "local").plan.start_rollout_id == 4


# --- resume: a verified checkpoint of this lineage, or a one-line refusal ----------------------


def save(run_dir: Path, base: Path, rollout_id: int, lineage: str = "run-a") -> Path:
    state = TrainerState(
        rollout_id=rollout_id, weight_version=str(rollout_id + 1), num_optimizer_steps=rollout_id + 1,
        data=DataCursor(next_rollout_id=rollout_id + 1, epoch=0, offset=0), seed=1, run_id=lineage, lineage=lineage,
    )  # fmt: skip
    return write_checkpoint(
        run_dir, base, rollout_id, {"w": torch.full((2,), float(rollout_id))}, {"state": {}},
        {"torch": torch.get_rng_state()}, state, fsync=False,
    )  # fmt: skip


def corrupt(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_resume_with_every_checkpoint_corrupt_refuses_naming_each_and_changes_nothing(tmp_path, base):
    run_dir = tmp_path / "run"
    for rollout_id in (0, 1):
        corrupt(save(run_dir, base, rollout_id))
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(CheckpointError) as caught:
        make_plan(config(run_dir, num_rollout=3, resume=True), "local")
    message = str(caught.value)
    assert "\n" not in message and "no checkpoint under" in message
    assert "rollout_000001: model.safetensors does not match its sha256" in message
    assert "rollout_000000: model.safetensors does not match its sha256" in message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_resume_falls_back_and_sets_the_unreadable_newer_checkpoint_aside(tmp_path, base):
    run_dir = tmp_path / "run"
    save(run_dir, base, 0)
    corrupt(save(run_dir, base, 1))
    planned = make_plan(config(run_dir, num_rollout=3, resume=True), "local", run_id="run-b")
    plan = planned.plan
    assert plan.load_checkpoint == str(run_dir / "checkpoints" / "rollout_000000")
    assert (plan.start_rollout_id, plan.lineage) == (1, "run-a")
    assert (run_dir / "checkpoints" / "rollout_000001").is_dir(), "planning moves nothing"
    set_aside_all(planned.moves)
    # A later save of rollout 1 cannot replace what could not be read: it is kept aside.
    assert not (run_dir / "checkpoints" / "rollout_000001").exists()
    assert (run_dir / "checkpoints" / "rollout_000001.unreadable" / "model.safetensors").is_file()


def test_resume_never_crosses_into_another_runs_lineage(tmp_path, base):
    run_dir = tmp_path / "run"
    save(run_dir, base, 0, lineage="run-old")
    corrupt(save(run_dir, base, 1, lineage="run-new"))
    with pytest.raises(
        CheckpointError, match=r"rollout_000000: another run's \(lineage run-old, resuming run-new\)"
    ):
        make_plan(config(run_dir, num_rollout=3, resume=True), "local")


def test_a_fresh_run_is_refused_where_another_run_saved_unless_it_overwrites(tmp_path, base):
    run_dir = tmp_path / "run"
    save(run_dir, base, 0)
    with pytest.raises(
        CheckpointError, match="holds another run's checkpoints .*rollout_000000.*run.overwrite = true"
    ):
        make_plan(config(run_dir, num_rollout=3), "local", run_id="run-b")
    planned = make_plan(config(run_dir, num_rollout=3, overwrite=True), "local", run_id="run-b")
    plan = planned.plan
    assert (plan.start_rollout_id, plan.resumed, plan.lineage) == (0, False, "run-b")
    assert (run_dir / "checkpoints" / "rollout_000000").is_dir(), "planning moves nothing"
    set_aside_all(planned.moves)
    (moved,) = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints.replaced-")]
    assert (moved / "rollout_000000" / "model.safetensors").is_file()
    assert not (run_dir / "checkpoints").exists()


def test_resume_sets_aside_every_checkpoint_of_another_lineage_so_nothing_prunes_or_replaces_it(
    tmp_path, base
):
    run_dir = tmp_path / "run"
    save(run_dir, base, 0, lineage="run-old")
    save(run_dir, base, 1, lineage="run-new")
    planned = make_plan(config(run_dir, num_rollout=3, resume=True), "local")
    plan = planned.plan
    assert (
        plan.load_checkpoint == str(run_dir / "checkpoints" / "rollout_000001") and plan.lineage == "run-new"
    )
    set_aside_all(planned.moves)
    assert not (run_dir / "checkpoints" / "rollout_000000").exists()
    assert (run_dir / "checkpoints" / "rollout_000000.other-lineage" / "model.safetensors").is_file()


def test_a_resume_that_finds_only_checkpoints_an_overwrite_moved_aside_says_where_they_are(tmp_path, base):
    """An overwriting run that ended before its first save leaves no checkpoint to resume:
    a resume there must not start from rollout 0 as if nothing had been trained."""
    run_dir = tmp_path / "run"
    save(run_dir, base, 3)
    set_aside_all(make_plan(config(run_dir, num_rollout=3, overwrite=True), "local", run_id="run-b").moves)
    with pytest.raises(CheckpointError) as caught:
        make_plan(config(run_dir, num_rollout=3, resume=True), "local")
    message = str(caught.value)
    assert "\n" not in message and "run.overwrite moved an earlier run's checkpoints to" in message
    assert "checkpoints.replaced-" in message and "run.resume = false" in message


def test_a_resume_names_the_rollouts_its_log_asked_for_after_the_checkpoint(tmp_path, base):
    from miles_events.bus.event_log import EventLogWriter
    from schemas.events import RolloutRequested

    run_dir = tmp_path / "run"
    save(run_dir, base, 1)
    with EventLogWriter(run_dir / "events.log") as log:
        for rollout_id in (0, 1, 2, 3, 2):  # 2 and 3 asked for after the checkpoint (2 twice)
            log.append(RolloutRequested(rollout_id=rollout_id, run_id="run-a", seq=rollout_id + 1))
    plan = make_plan(config(run_dir, num_rollout=6, resume=True), "local").plan
    assert (plan.start_rollout_id, plan.regenerated) == (2, (2, 3))
    loaded = make_plan(
        config(tmp_path / "other", num_rollout=6, load=str(run_dir / "checkpoints")), "local"
    ).plan
    assert loaded.start_rollout_id == 2 and loaded.regenerated == ()
