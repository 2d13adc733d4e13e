"""The Coordinator's reaction table: the seed's loop, one behaviour per test."""

from __future__ import annotations

import msgspec
import pytest

from actors.coordinator import Coordinator, should_run_periodic_action
from actors.publisher import Publisher
from miles_events.bus.clock import ManualClock
from miles_events.bus.testing import RecordingContext, feed
from schemas.checkpoint import DataCursor, TrainerState
from schemas.config import Config, RolloutConfig, RunConfig, VerifierConfig
from schemas.data import DataRef
from schemas.events import (
    ActorFailed,
    CellFailed,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CheckpointFailed,
    CheckpointSaved,
    EvalFinished,
    EvalRequested,
    PublicationFailed,
    PublicationMismatch,
    PublicationVerified,
    PublishRequested,
    RolloutGenerated,
    RolloutRequested,
    RunFinished,
    RunStarted,
    SaveRequested,
    StepCancelled,
    StopRequested,
    TensorMismatch,
    TrainerRestored,
    TrainerRestoreRequested,
    TrainMetrics,
    TrainStateStaged,
    TrainStepFinished,
    WeightsCheckFinished,
    WeightsLoaded,
    WeightsPublished,
)
from schemas.plan import RunPlan


def make(
    num_rollout: int = 3,
    start: int = 0,
    per_epoch: int | None = 100,
    verifier: bool = True,
    check_weight_update_equal: bool = False,
    partial: bool = False,
    **run,
) -> Coordinator:
    config = Config(
        run=RunConfig(num_rollout=num_rollout, **run),
        rollout=RolloutConfig(partial=partial),
        verifier=VerifierConfig(enabled=verifier, check_weight_update_equal=check_weight_update_equal),
    )
    plan = RunPlan(
        start_rollout_id=start,
        num_rollout=num_rollout,
        num_rollout_per_epoch=per_epoch,
        resumed=start > 0,
        weight_version="default",
        engines=("engine-0",),
        runtime="local",
        config_digest="x",
    )
    return Coordinator(config, RecordingContext(config, name="coordinator", plan=plan))


def started(c: Coordinator) -> RunStarted:
    return RunStarted(
        runtime="local",
        config_digest="x",
        start_rollout_id=c.plan.start_rollout_id,
        num_rollout=c.plan.num_rollout,
        num_rollout_per_epoch=c.plan.num_rollout_per_epoch,
    )


def verified(version: int, rollout_id: int | None) -> PublicationVerified:
    return PublicationVerified(
        weight_version=str(version), digest="d", num_tensors=1, engines=["engine-0"], rollout_id=rollout_id
    )


def trained(rollout_id: int) -> TrainStepFinished:
    return TrainStepFinished(
        rollout_id=rollout_id, weight_version="1", metrics=TrainMetrics(train_tokens=1, num_optimizer_steps=1)
    )


def kinds(events) -> list[tuple]:
    out = []
    for e in events:
        key = getattr(e, "rollout_id", None)
        out.append((type(e).__name__, key) if not isinstance(e, RunFinished) else ("RunFinished", e.status))
    return out


async def test_run_started_publishes_the_initial_weights_first():
    c = make()
    assert kinds(await feed(c, started(c))) == [("PublishRequested", None)]


async def test_the_loop_is_rollout_train_publish_until_num_rollout():
    c = make(num_rollout=2)
    out = await feed(c, started(c), verified(1, None), trained(0), verified(2, 0), trained(1), verified(3, 1))
    assert kinds(out) == [
        ("PublishRequested", None),
        ("RolloutRequested", 0),
        ("PublishRequested", 0),
        ("RolloutRequested", 1),
        ("PublishRequested", 1),
        ("RunFinished", "completed"),
    ]


async def test_eval_runs_before_training_unless_skipped():
    c = make(eval_interval=5)
    assert kinds(await feed(c, started(c), verified(1, None))) == [
        ("PublishRequested", None),
        ("EvalRequested", 0),
    ]
    assert kinds(await feed(c, EvalFinished(rollout_id=0, metrics={}))) == [("RolloutRequested", 0)]
    skipped = make(eval_interval=5, skip_eval_before_train=True)
    assert kinds(await feed(skipped, started(skipped), verified(1, None)))[-1] == ("RolloutRequested", 0)


async def test_periodic_eval_after_publication_then_the_next_rollout():
    c = make(num_rollout=4, eval_interval=2, skip_eval_before_train=True)
    await feed(c, started(c), verified(1, None), trained(0))
    assert kinds(await feed(c, verified(2, 0))) == [("RolloutRequested", 1)]
    await feed(c, trained(1))
    assert kinds(await feed(c, verified(3, 1))) == [("EvalRequested", 1)]
    assert kinds(await feed(c, EvalFinished(rollout_id=1, metrics={}))) == [("RolloutRequested", 2)]


async def test_num_rollout_zero_with_eval_interval_is_eval_only():
    c = make(num_rollout=0, eval_interval=1)
    out = await feed(c, started(c), verified(1, None), EvalFinished(rollout_id=0, metrics={}))
    assert kinds(out) == [("PublishRequested", None), ("EvalRequested", 0), ("RunFinished", "completed")]


async def test_periodic_save_and_forced_save_on_the_last_rollout():
    c = make(num_rollout=3, save_interval=2)
    await feed(c, started(c), verified(1, None))
    assert kinds(await feed(c, trained(0))) == [("PublishRequested", 0)]
    await feed(c, verified(2, 0))
    saves = await feed(c, trained(1))
    assert kinds(saves) == [("SaveRequested", 1), ("PublishRequested", 1)]
    assert saves[0].publication_follows  # the trainer may stage the save behind that publication
    await feed(
        c,
        verified(3, 1),
        CheckpointSaved(rollout_id=1, path="p", weight_version="2", num_bytes=1),
        trained(2),
    )
    last = c.context.published[-2]
    assert isinstance(last, SaveRequested) and last.rollout_id == 2 and last.reason == "last"
    assert last.publication_follows


async def test_a_completed_run_waits_for_its_pending_checkpoint():
    c = make(num_rollout=1, save_interval=1)
    out = await feed(c, started(c), verified(1, None), trained(0), verified(2, 0))
    assert ("RunFinished", "completed") not in kinds(out)
    done = await feed(c, CheckpointSaved(rollout_id=0, path="p", weight_version="1", num_bytes=1))
    assert kinds(done) == [("RunFinished", "completed")]


async def test_a_save_due_while_the_one_before_is_being_written_waits_for_it_and_the_loop_with_it():
    c = make(num_rollout=3, save_interval=1)
    await feed(c, started(c), verified(1, None))
    assert kinds(await feed(c, trained(0))) == [("SaveRequested", 0), ("PublishRequested", 0)]
    await feed(c, verified(2, 0))
    # One save in flight at a time: the step's save and its publication wait for the last one.
    assert kinds(await feed(c, trained(1))) == []
    saved = CheckpointSaved(rollout_id=0, path="p", weight_version="1", num_bytes=1)
    assert kinds(await feed(c, saved)) == [("SaveRequested", 1), ("PublishRequested", 1)]
    # A failed save fails the run: the one waiting for it is never asked for.
    await feed(c, verified(3, 1))
    out = await feed(c, trained(2), CheckpointFailed(rollout_id=1, reason="disk full"))
    assert kinds(out) == [("RunFinished", "failed")]


def saved(rollout_id: int) -> CheckpointSaved:
    return CheckpointSaved(rollout_id=rollout_id, path="p", weight_version=str(rollout_id + 1), num_bytes=1)


async def test_a_stop_or_the_last_rollout_while_a_save_waits_finishes_only_once_both_saves_are_written():
    for stop in (True, False):
        c = make(num_rollout=2 if not stop else 5, save_interval=1)
        await feed(c, started(c), verified(1, None), trained(0), verified(2, 0))
        assert kinds(await feed(c, trained(1))) == []
        if stop:
            assert kinds(await feed(c, StopRequested(reason="signal"))) == []
        assert kinds(await feed(c, saved(0))) == [("SaveRequested", 1), ("PublishRequested", 1)]
        assert kinds(await feed(c, verified(3, 1))) == []  # the step's own save is still being written
        assert kinds(await feed(c, saved(1))) == [("RunFinished", "stopped" if stop else "completed")]


async def test_a_sentinel_touched_while_a_save_is_written_is_one_save_asked_for_once_that_one_is_done(
    tmp_path,
):
    sentinel = tmp_path / "save-now"
    c = make(num_rollout=5, save_trigger_sentinel=str(sentinel))
    sentinel.touch()
    await feed(c, started(c), verified(1, None))
    assert kinds(await feed(c, trained(0))) == [("SaveRequested", 0), ("PublishRequested", 0)]
    await feed(c, verified(2, 0))
    sentinel.touch()
    assert kinds(await feed(c, trained(1))) == []
    assert not sentinel.exists(), "taken as soon as its step ends"
    assert kinds(await feed(c, saved(0))) == [("SaveRequested", 1), ("PublishRequested", 1)]


async def test_one_touch_of_the_sentinel_file_is_one_save(tmp_path):
    sentinel = tmp_path / "save-now"
    sentinel.touch()
    c = make(num_rollout=5, save_trigger_sentinel=str(sentinel))
    await feed(c, started(c), verified(1, None))
    out = await feed(c, trained(0))
    assert isinstance(out[0], SaveRequested) and out[0].reason == "sentinel"
    assert not sentinel.exists(), "removed when its save is asked for, before the next rollout"
    # The save is still being written when the next step ends: that step does not save again.
    assert kinds(await feed(c, verified(2, 0), trained(1))) == [
        ("RolloutRequested", 1),
        ("PublishRequested", 1),
    ]


async def test_debug_exit_after_rollout_counts_from_the_start_rollout():
    c = make(num_rollout=10, start=4, debug_exit_after_rollout=2)
    out = await feed(c, started(c), verified(5, None), trained(4), verified(6, 4), trained(5), verified(7, 5))
    assert kinds(out)[-1] == ("RunFinished", "completed")
    assert [e.rollout_id for e in out if isinstance(e, RolloutRequested)] == [4, 5]


async def test_resumed_plan_starts_at_its_start_rollout_id():
    c = make(num_rollout=6, start=3)
    out = await feed(c, started(c), verified(4, None))
    assert kinds(out)[-1] == ("RolloutRequested", 3)


async def test_a_mismatch_stops_the_run_with_the_tensor_named():
    c = make()
    mismatch = PublicationMismatch(
        weight_version="1",
        mismatches=[TensorMismatch("engine-0", "model.norm.weight", "a", "b")],
        expected_digest="e",
        engine_digests={},
        rollout_id=None,
    )
    out = await feed(c, started(c), mismatch)
    assert isinstance(out[-1], RunFinished) and out[-1].status == "failed"
    assert "model.norm.weight" in out[-1].reason


async def test_a_mismatch_continues_when_configured():
    config = Config(run=RunConfig(num_rollout=2), verifier=VerifierConfig(continue_on_mismatch=True))
    c = Coordinator(config, RecordingContext(config, plan=make().plan))
    mismatch = PublicationMismatch(weight_version="1", mismatches=[], expected_digest="e", engine_digests={})
    out = await feed(c, started(c), mismatch)
    assert kinds(out)[-1] == ("RolloutRequested", 0)


async def test_without_verification_the_loop_follows_weights_published():
    c = make(verifier=False)
    published = WeightsPublished(weight_version="1", engines=["engine-0"], previous_versions=["default"])
    assert kinds(await feed(c, started(c), published))[-1] == ("RolloutRequested", 0)


@pytest.mark.parametrize(
    "failure",
    [
        ActorFailed(actor="trainer", error="ValueError: boom", event_type="RolloutGenerated"),
        CheckpointFailed(rollout_id=0, reason="disk full"),
    ],
)
async def test_failures_finish_the_run_once_with_a_reason(failure):
    c = make()
    out = await feed(c, started(c), failure, failure)
    finished = [e for e in out if isinstance(e, RunFinished)]
    assert len(finished) == 1 and finished[0].status == "failed"
    assert ("boom" in finished[0].reason) or ("disk full" in finished[0].reason)


def test_periodic_action_matches_miles():
    assert [r for r in range(10) if should_run_periodic_action(r, 3)] == [2, 5, 8]
    assert should_run_periodic_action(9, 4, num_rollout=10)
    assert should_run_periodic_action(4, 100, num_rollout_per_epoch=5)
    assert not should_run_periodic_action(3, None, 1, 4)


def test_the_coordinator_handles_only_facts_and_commands_it_reacts_to():
    handled = set(Coordinator.handlers())
    assert RolloutRequested not in handled and EvalRequested not in handled
    assert PublishRequested not in handled


async def test_a_stop_finishes_after_the_current_steps_save_and_publication():
    c = make(num_rollout=5, save_interval=1)
    await feed(c, started(c), verified(1, None))
    assert kinds(await feed(c, StopRequested(reason="interrupted by signal"))) == []
    # The step in flight goes on: it is saved and published.
    assert kinds(await feed(c, trained(0))) == [("SaveRequested", 0), ("PublishRequested", 0)]
    assert kinds(await feed(c, verified(2, 0))) == [], "no next rollout; waits for its checkpoint"
    done = await feed(c, CheckpointSaved(rollout_id=0, path="p", weight_version="1", num_bytes=1))
    assert kinds(done) == [("RunFinished", "stopped")]
    assert done[0].reason == "interrupted by signal" and done[0].last_rollout_id == 0


async def test_a_stop_saves_the_step_it_ends_after_unless_it_was_saved():
    c = make(num_rollout=5)  # no save_interval: only the stop saves
    await feed(c, started(c), verified(1, None), trained(0), verified(2, 0))
    await feed(c, trained(1), StopRequested(reason="interrupted by signal"))
    out = await feed(c, verified(3, 1))
    assert kinds(out) == [("SaveRequested", 1)] and out[0].reason == "stop"
    assert not out[0].publication_follows  # nothing comes after it: staged at once
    done = await feed(c, CheckpointSaved(rollout_id=1, path="p", weight_version="2", num_bytes=1))
    assert kinds(done) == [("RunFinished", "stopped")] and done[0].last_rollout_id == 1


def test_the_publisher_alone_follows_which_version_each_engine_serves():
    assert WeightsLoaded in Publisher.handlers()
    assert WeightsLoaded not in Coordinator.handlers()
    assert not hasattr(make(), "served")


async def test_run_finished_says_what_the_engines_serve_after_a_publication_failed_part_way():
    c = make(num_rollout=5)
    c.plan = msgspec.structs.replace(c.plan, engines=("engine-0", "engine-1"))
    loaded = [
        WeightsLoaded(engine=e, weight_version="1", previous_version="default", digest="d")
        for e in c.plan.engines
    ]
    published = WeightsPublished(
        weight_version="1", engines=list(c.plan.engines), previous_versions=["default"] * 2
    )
    await feed(c, started(c), *loaded, published, verified(1, None), trained(0))
    out = await feed(
        c,
        WeightsLoaded(engine="engine-0", weight_version="2", previous_version="1", digest="d"),
        PublicationFailed(weight_version="2", phase="load", reason="engine-1 timed out", rollout_id=0),
    )
    (finished,) = out
    # engine-0 serves "2", engine-1 still "1": the run ends at what every engine serves.
    assert finished.status == "failed" and finished.weight_version == "1"


async def test_a_step_that_outlives_the_stop_grace_is_cut_and_the_last_complete_step_saved():
    config = Config(run=RunConfig(num_rollout=5, stop_grace_seconds=30.0), verifier=VerifierConfig())
    clock = ManualClock()
    plan = RunPlan(start_rollout_id=0, num_rollout=5, num_rollout_per_epoch=None, engines=("engine-0",))
    c = Coordinator(config, RecordingContext(config, name="coordinator", plan=plan, clock=clock))
    await feed(c, started(c), verified(1, None), trained(0), verified(2, 0))  # rollout 1 is generating
    assert kinds(await feed(c, StopRequested(reason="SIGTERM"))) == []
    await clock.advance(29.0)
    assert not [e for e in c.context.published if isinstance(e, StopRequested)]
    await clock.advance(1.0)
    (cut,) = [e for e in c.context.published if isinstance(e, StopRequested)]
    assert cut.now and "cut after 30s" in cut.reason
    out = await feed(c, cut, StepCancelled(rollout_id=1, phase="generate", reason=cut.reason))
    assert kinds(out) == [("SaveRequested", 0)] and out[0].reason == "stop"
    done = await feed(c, CheckpointSaved(rollout_id=0, path="p", weight_version="1", num_bytes=1))
    assert kinds(done) == [("RunFinished", "stopped")] and done[0].last_rollout_id == 0


async def test_a_stop_during_an_eval_finishes_when_it_ends():
    c = make(num_rollout=5, eval_interval=5)
    await feed(c, started(c), verified(1, None), StopRequested(reason="x"))
    assert kinds(await feed(c, EvalFinished(rollout_id=0, metrics={}))) == [("RunFinished", "stopped")]


async def test_after_a_failure_nothing_new_is_asked_for():
    c = make(num_rollout=5, save_interval=1, eval_interval=1)
    await feed(c, started(c), verified(1, None), EvalFinished(rollout_id=0, metrics={}))
    out = await feed(
        c,
        ActorFailed(actor="generator", error="x"),
        trained(0),
        verified(2, 0),
        EvalFinished(rollout_id=0, metrics={}),
    )
    assert kinds(out) == [("RunFinished", "failed")]


async def test_num_rollout_zero_without_eval_publishes_then_finishes():
    c = make(num_rollout=0)
    out = await feed(c, started(c), verified(1, None))
    assert kinds(out) == [("PublishRequested", None), ("RunFinished", "completed")]


async def test_a_given_num_rollout_has_no_epoch_end_triggers():
    """The embedded default's case: 55 prompts, batches of 64, num_rollout = 50, intervals 10."""
    c = make(num_rollout=50, per_epoch=None, eval_interval=10, save_interval=10, skip_eval_before_train=True)
    events = [started(c), verified(1, None)]
    for k in range(50):
        events += [trained(k), verified(k + 2, k)]
        if (k + 1) % 10 == 0:
            events.append(EvalFinished(rollout_id=k, metrics={}))
            events.append(CheckpointSaved(rollout_id=k, path="p", weight_version=str(k + 1), num_bytes=1))
    out = await feed(c, *events)
    assert [e.rollout_id for e in out if isinstance(e, SaveRequested)] == [9, 19, 29, 39, 49]
    assert [e.rollout_id for e in out if isinstance(e, EvalRequested)] == [9, 19, 29, 39, 49]


def check_done(
    action: str, success: bool = True, engine: str = "engine-0", message: str = ""
) -> WeightsCheckFinished:
    return WeightsCheckFinished(
        engine=engine,
        action=action,
        success=success,
        message=message,
        request_id=f"check_weight_update_equal:{action}",
    )


async def test_check_weight_update_equal_is_snapshot_reset_publish_compare():
    c = make(num_rollout=2, check_weight_update_equal=True)
    out = await feed(c, started(c))
    assert [(type(e).__name__, getattr(e, "action", None)) for e in out] == [
        ("WeightsCheckRequested", "snapshot")
    ]
    assert [e.action for e in await feed(c, check_done("snapshot"))] == ["reset_tensors"]
    assert kinds(await feed(c, check_done("reset_tensors"))) == [("PublishRequested", None)]
    out = await feed(c, verified(1, None))
    assert [e.action for e in out] == ["compare"]
    assert kinds(await feed(c, check_done("compare"))) == [("RolloutRequested", 0)]


async def test_a_failed_compare_stops_the_run_with_the_seeds_message():
    c = make(num_rollout=2, check_weight_update_equal=True)
    await feed(c, started(c), check_done("snapshot"), check_done("reset_tensors"), verified(1, None))
    out = await feed(
        c, check_done("compare", success=False, message="3 of 27 tensors differ from the snapshot")
    )
    assert kinds(out) == [("RunFinished", "failed")]
    assert out[0].reason == (
        "inference weight check 'compare' did not succeed on every engine: "
        "engine-0: 3 of 27 tensors differ from the snapshot"
    )


# --- a trainer that heals ("train" in run.ft_components) -------------------------------------


def staged(rollout_id: int) -> TrainStateStaged:
    ref = DataRef("inprocess", f"s{rollout_id}", "trainer", 1)
    return TrainStateStaged(
        rollout_id=rollout_id,
        weights=ref,
        optimizer=ref,
        rng=ref,
        trainer_state=TrainerState(
            rollout_id=rollout_id,
            weight_version="1",
            num_optimizer_steps=1,
            data=DataCursor(next_rollout_id=rollout_id + 1, epoch=0, offset=0),
            seed=1,
            run_id="r",
        ),
        reason="interval",
    )


def written(rollout_id: int) -> CheckpointSaved:
    return CheckpointSaved(rollout_id=rollout_id, path=f"ckpt-{rollout_id}", weight_version="1", num_bytes=1)


async def test_a_failed_trainer_group_restores_the_latest_checkpoint_once_the_save_in_flight_is_written():
    """Rank 1 dies training rollout 3 while the save of rollout 2 is being written: once the
    group is back and the save is in, the checkpoint of rollout 2 is restored, published as
    the next version, and rollout 3 asked for again; a late step and its publication are
    left be meanwhile."""
    c = make(num_rollout=5, save_interval=3, skip_eval_before_train=True, eval_interval=2)
    await feed(c, started(c), verified(1, None))
    for r in range(2):
        await feed(c, trained(r), verified(r + 2, r))
    await feed(c, trained(2), staged(2), verified(4, 2))  # the save of 2 staged, not yet written
    out = await feed(
        c,
        CellFailed(cell="actor-1", reason="rank 1 died", rollout_id=3),
        CellRestarted(cell="actor-0", attempt=1, pid=1, weight_version="4", restart_seconds=1.0),
        CellRestarted(cell="actor-1", attempt=1, pid=2, weight_version="4", restart_seconds=1.0),
    )
    assert out == [], "the restore waits for the save being written"
    (request,) = await feed(c, written(2))
    assert isinstance(request, TrainerRestoreRequested)
    assert (request.checkpoint, request.rollout_id, request.redo) == ("ckpt-2", 2, [3])
    out = await feed(c, TrainerRestored(checkpoint="ckpt-2", rollout_id=2, weight_version="4"))
    assert kinds(out) == [("PublishRequested", 2)]
    # The restored weights' publication: no eval again for rollout 2's state, rollout 3 again.
    assert kinds(await feed(c, verified(5, 2))) == [("RolloutRequested", 3)]


async def test_a_group_lost_before_any_checkpoint_goes_back_to_the_runs_start_and_forgets_unstaged_saves():
    c = make(num_rollout=4, save_interval=1)
    await feed(c, started(c), verified(1, None))
    out = await feed(c, trained(0))
    assert kinds(out) == [("SaveRequested", 0), ("PublishRequested", 0)]
    # The group dies staging that save: it is never written, and not waited for.
    out = await feed(
        c,
        CellFailed(cell="actor-0", reason="rank 0 died", rollout_id=0),
        CellRestarted(cell="actor-0", attempt=1, pid=1, weight_version="1", restart_seconds=1.0),
    )
    (request,) = out
    assert isinstance(request, TrainerRestoreRequested)
    assert (request.checkpoint, request.rollout_id, request.redo) == (None, -1, [0])
    await feed(c, TrainerRestored(checkpoint=None, rollout_id=-1, weight_version="1"))
    assert kinds(await feed(c, verified(2, -1))) == [("RolloutRequested", 0)]


async def test_an_engine_cell_failing_does_not_move_the_loop():
    c = make(num_rollout=2)
    await feed(c, started(c), verified(1, None))
    assert await feed(c, CellFailed(cell="rollout-0", reason="engine died", rollout_id=0)) == []
    assert kinds(await feed(c, trained(0))) == [("PublishRequested", 0)]


async def test_a_group_lost_during_the_opening_runs_the_opening_again():
    c = make(num_rollout=2)
    assert kinds(await feed(c, started(c))) == [("PublishRequested", None)]
    out = await feed(
        c,
        CellFailed(cell="actor-1", reason="rank 1 died"),
        CellRestarted(cell="actor-0", attempt=1, pid=1, weight_version="default", restart_seconds=1.0),
    )
    assert kinds(out) == [("TrainerRestoreRequested", -1)]
    out = await feed(c, TrainerRestored(checkpoint=None, rollout_id=-1, weight_version="default"))
    assert kinds(out) == [("PublishRequested", None)]
    assert kinds(await feed(c, verified(1, None))) == [("RolloutRequested", 0)]


async def test_a_group_suspended_again_before_its_restore_is_answered_is_asked_again():
    """Found by the soak: a suspension that lands after the restore was asked for and before
    the trainer answered it (the trainer then never answers it) starts the restore over; an
    answer from before the suspension is left be."""
    c = make(num_rollout=3)
    await feed(c, started(c), verified(1, None), trained(0), verified(2, 0))

    def resumed(rank: int) -> CellResumed:
        return CellResumed(cell=f"actor-{rank}", pid=rank, weight_version="2")

    out = await feed(c, *(CellSuspended(cell=f"actor-{r}") for r in (0, 1)), resumed(0), resumed(1))
    assert kinds(out) == [("TrainerRestoreRequested", -1)]
    out = await feed(c, *(CellSuspended(cell=f"actor-{r}") for r in (0, 1)))
    assert out == []
    late = TrainerRestored(checkpoint=None, rollout_id=-1, weight_version="2")
    assert await feed(c, late) == [], "an answer from before the suspension moves nothing"
    out = await feed(c, resumed(0), resumed(1))
    assert kinds(out) == [("TrainerRestoreRequested", -1)]
    assert kinds(await feed(c, late)) == [("PublishRequested", -1)]


# -- asynchronous training (run.max_staleness) -------------------------------------------


async def test_with_max_staleness_k_rollouts_run_k_ahead_and_each_publication_waits_for_the_rollout_k_after():
    """Rollout r is asked for once step r - 1 - k is published; step n's publication once
    rollout n + k is asked for: the Generator meets requests and publications in one order."""
    c = make(num_rollout=5, max_staleness=1)
    out = await feed(
        c,
        started(c),
        verified(1, None),  # rollouts 0 and 1 on the initial weights
        trained(0),  # rollout 1 was asked for: publish step 0
        verified(2, 0),  # rollout 2 on step 0's weights
        trained(1),
        trained(2),  # cannot come before step 1's publication: the Trainer waits for it
    )
    assert kinds(out) == [
        ("PublishRequested", None),
        ("RolloutRequested", 0),
        ("RolloutRequested", 1),
        ("PublishRequested", 0),
        ("RolloutRequested", 2),
        ("PublishRequested", 1),
    ]


async def test_a_publication_waits_for_the_rollout_it_must_follow_and_for_the_one_before_it():
    c = make(num_rollout=6, max_staleness=2)
    out = await feed(c, started(c), verified(1, None), trained(0), trained(1))
    # 0, 1, 2 on the initial weights; step 0's publication once rollout 2 is asked for;
    # step 1's only after step 0's is through.
    assert kinds(out) == [
        ("PublishRequested", None),
        ("RolloutRequested", 0),
        ("RolloutRequested", 1),
        ("RolloutRequested", 2),
        ("PublishRequested", 0),
    ]
    more = await feed(c, verified(2, 0))
    assert kinds(more) == [("RolloutRequested", 3), ("PublishRequested", 1)]


async def test_asynchronous_saves_go_with_their_steps_publication_and_the_last_rollout_finishes():
    c = make(num_rollout=3, max_staleness=1, save_interval=2)
    out = await feed(
        c, started(c), verified(1, None), trained(0), verified(2, 0), trained(1), verified(3, 1), trained(2)
    )
    # Step 2's save (the last) waits for step 1's to be written, and its publication with it.
    assert kinds(out)[-3:] == [("RolloutRequested", 2), ("SaveRequested", 1), ("PublishRequested", 1)]
    assert kinds(await feed(c, saved(1))) == [("SaveRequested", 2), ("PublishRequested", 2)]
    assert kinds(await feed(c, verified(4, 2), saved(2))) == [("RunFinished", "completed")]


def generated(rollout_id: int) -> RolloutGenerated:
    return RolloutGenerated(
        rollout_id=rollout_id, batch=DataRef("inprocess", f"r{rollout_id}", "generator", 1), num_samples=1,
        reward_mean=0.0, weight_versions=["1"],
    )  # fmt: skip


async def test_asynchronous_stop_saves_the_last_step_trained_and_asks_for_nothing_more():
    c = make(num_rollout=10, max_staleness=1)
    await feed(c, started(c), verified(1, None), generated(0), generated(1), trained(0), verified(2, 0))
    await feed(c, generated(2), trained(1))  # step 1's publication asked for: 2 may train
    out = await feed(c, StopRequested(reason="user"), trained(2), verified(3, 1))
    # Step 2 was trained (its publication never asked for): the stop saves it.
    assert kinds(out) == [("SaveRequested", 2)]
    assert kinds(await feed(c, saved(2))) == [("RunFinished", "stopped")]


async def test_an_asynchronous_stop_waits_for_the_step_in_training_and_saves_it():
    """The Trainer trains step n + 1 once step n's publication is asked for: a stop that
    comes then saves step n + 1 once it is trained, never step n with n + 1's state."""
    c = make(num_rollout=10, max_staleness=1)
    await feed(c, started(c), verified(1, None), generated(0), generated(1), trained(0), verified(2, 0))
    await feed(c, generated(2), trained(1))
    assert kinds(await feed(c, StopRequested(reason="user"), verified(3, 1))) == []  # step 2 is training
    assert kinds(await feed(c, trained(2))) == [("SaveRequested", 2)]
    assert kinds(await feed(c, saved(2))) == [("RunFinished", "stopped")]


async def test_an_asynchronous_stop_after_the_step_in_training_was_cut_saves_the_one_before():
    c = make(num_rollout=10, max_staleness=1)
    await feed(c, started(c), verified(1, None), generated(0), generated(1), trained(0), verified(2, 0))
    await feed(c, generated(2), trained(1), verified(3, 1))
    cut = StepCancelled(rollout_id=2, phase="train", reason="stop now")
    assert kinds(await feed(c, StopRequested(reason="user", now=True), cut)) == [("SaveRequested", 1)]


async def test_with_partial_rollouts_a_publication_waits_for_the_eval_asked_before_it():
    c = make(num_rollout=6, max_staleness=2, eval_interval=1, skip_eval_before_train=True, partial=True)
    await feed(c, started(c), verified(1, None), trained(0))
    out = await feed(c, verified(2, 0), trained(1))
    assert ("EvalRequested", 0) in kinds(out) and ("PublishRequested", 1) not in kinds(out)
    after = await feed(c, EvalFinished(rollout_id=0, metrics={}))
    assert ("PublishRequested", 1) in kinds(after)


async def test_drop_and_mask_ask_for_rollouts_once_the_weights_keeping_them_in_bound_are_staged():
    from schemas.events import WeightsStaged

    c = make(num_rollout=6, max_staleness=1, staleness_policy="drop")
    await feed(c, started(c), verified(1, None), trained(0))
    staged_0 = WeightsStaged(
        weight_version="2",
        weights=DataRef("inprocess", "w2", "trainer", 1),
        digest="d",
        num_tensors=1,
        num_bytes=1,
        rollout_id=0,
    )
    assert kinds(await feed(c, staged_0)) == [("RolloutRequested", 2)]  # before the publication is through


def test_fully_async_is_a_staleness_bound_of_one():
    from schemas.config import staleness_bound

    assert staleness_bound(Config(run=RunConfig(fully_async=True))) == 1
    assert staleness_bound(Config(run=RunConfig(fully_async=True, max_staleness=3))) == 3
    assert staleness_bound(Config()) == 0
