"""The console sinks, driven through a real bus by the recorded run in tests/fixtures/tiny_run
(3 rollouts, 2 engines, evals at 0..2, checkpoints at 1 and 2, every publication verified)."""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from rich.console import Console

from miles_events.bus.clock import ManualClock
from miles_events.bus.event_log import read_events
from miles_events.sinks.console import (
    ConsoleSink,
    PlainProgress,
    RichProgress,
    RunProgress,
    describe_bytes,
    make_console,
    sparkline,
)
from schemas.config import Config, ConsoleConfig, VerifierConfig
from schemas.data import DataRef
from schemas.events import (
    ActorFailed,
    EvalFinished,
    Event,
    PublicationMismatch,
    PublicationVerified,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    TensorMismatch,
    TrainMetrics,
    TrainStepFinished,
    WeightsPublished,
)
from tests.support import drive_sink, not_console, with_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_run" / "events.log"
EVENTS: list[Event] = list(read_events(FIXTURE))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


async def drive(
    make_sink,
    events: list[Event],
    settle: float = 0.0,
    config: Config | None = None,
    clock: ManualClock | None = None,
) -> ConsoleSink:
    """Publish ``events`` on a real bus to the sink ``make_sink()``, then end as the session does."""
    sink = make_sink()
    sink.host = await drive_sink(sink, events, config, settle=settle, clock=clock)
    return sink


async def plain_lines(events: list[Event], **options: object) -> list[str]:
    stream = StringIO()
    await drive(lambda: PlainProgress(stream, **options), events)
    return stream.getvalue().splitlines()


def with_mismatch_at_rollout_0(events: list[Event]) -> list[Event]:
    """The fixture with the verification of version 2 turned into a mismatch on one tensor."""
    mismatch = TensorMismatch(engine="engine-1", tensor="model.norm.weight", expected="aaaa", actual="bbbb")
    out: list[Event] = []
    for event in events:
        if isinstance(event, PublicationVerified) and event.rollout_id == 0:
            event = PublicationMismatch(
                weight_version="2",
                mismatches=[mismatch],
                expected_digest="d",
                engine_digests={},
                rollout_id=0,
            )
        out.append(event)
    return out


def rich_summary(output: str) -> str:
    """The final summary: the last panel printed."""
    return ANSI.sub("", output).rsplit("╭", 1)[1]


async def test_plain_prints_one_line_per_rollout_with_reward_loss_times_and_verification():
    lines = [line for line in await plain_lines(EVENTS) if line.startswith("rollout ")]
    assert lines == [
        "rollout 0 [1/3]: reward 0.008 loss -0.0037 kl 0.0000 grad 0.127 | gen 0.06s train 0.13s pub 0.02s verify 0.00s | v2 verified",
        "rollout 1 [2/3]: reward 0.023 loss +0.0015 kl 0.0000 grad 0.239 | gen 0.07s train 0.13s pub 0.04s verify 0.00s | v3 verified",
        "rollout 2 [3/3]: reward 0.023 loss +0.0076 kl 0.0000 grad 0.201 | gen 0.06s train 0.12s pub 0.04s verify 0.00s | v4 verified",
    ]


async def test_plain_prints_start_publication_evals_checkpoints_and_end_in_event_order():
    lines = await plain_lines(EVENTS)
    assert lines[:3] == [
        "run test-run (local): rollouts 0..2 (3 to run), engines engine-0, engine-1",
        "initial weights published as version 1 in 0.01s",
        "initial publication v1 verified",
    ]
    assert lines[3].startswith("eval at rollout 0 (weights v1): accuracy=0.000 ")
    assert (
        lines[6]
        == "checkpoint rollout 1 (trained from version 2) -> /tmp/fx/checkpoints/rollout_000001 in 0.05s"
    )
    assert lines[-1] == "run completed after rollout 2 [3/3] at weight version 4 in 0.9s"
    assert len(lines) == 12


async def test_plain_shows_a_two_rank_trainer_at_start_and_each_ranks_time_and_memory_per_rollout():
    lines = await plain_lines(with_ranks(EVENTS, 2))
    assert lines[:2] == [
        "run test-run (local): rollouts 0..2 (3 to run), engines engine-0, engine-1",
        "trainer: 2 ranks, fsdp2",
    ]
    rollouts = [line for line in lines if line.startswith("rollout ")]
    assert rollouts == [
        "rollout 0 [1/3]: reward 0.008 loss -0.0037 kl 0.0000 grad 0.127 | gen 0.06s train 0.13s pub 0.02s verify 0.00s"
        " | ranks 0: 0.10s 400 MiB, 1: 0.11s 410 MiB | v2 verified",
        "rollout 1 [2/3]: reward 0.023 loss +0.0015 kl 0.0000 grad 0.239 | gen 0.07s train 0.13s pub 0.04s verify 0.00s"
        " | ranks 0: 0.20s 400 MiB, 1: 0.21s 410 MiB | v3 verified",
        "rollout 2 [3/3]: reward 0.023 loss +0.0076 kl 0.0000 grad 0.201 | gen 0.06s train 0.12s pub 0.04s verify 0.00s"
        " | ranks 0: 0.30s 400 MiB, 1: 0.31s 410 MiB | v4 verified",
    ]


async def test_every_plain_line_of_a_two_rank_run_reads_as_the_consoles():
    """The end-to-end tests tell the console's stdout from stray prints by how lines begin."""
    assert not_console("\n".join(await plain_lines(with_ranks(EVENTS, 2)))) == []


async def test_plain_prints_a_one_rank_trainer_as_it_always_did():
    assert await plain_lines(with_ranks(EVENTS, 1, "none")) == await plain_lines(EVENTS)


def test_memory_reads_in_mib_below_a_gib_and_in_gib_from_one():
    assert [describe_bytes(n) for n in (0, 410 << 20, (1 << 30) - 1, 1 << 30, 75 * (1 << 30) // 2)] == [
        "0 MiB",
        "410 MiB",
        "1024 MiB",
        "1.0 GiB",
        "37.5 GiB",
    ]


async def test_plain_output_is_the_same_on_every_replay():
    assert await plain_lines(EVENTS) == await plain_lines(EVENTS)


async def test_plain_reports_a_mismatch_naming_the_first_tensor():
    lines = await plain_lines(with_mismatch_at_rollout_0(EVENTS))
    assert lines[4].startswith("rollout 0 [1/3]: ") and lines[4].endswith("| v2 MISMATCH")
    assert lines[5] == (
        "weight version 2: MISMATCH in 1 tensor(s), first engine-1:model.norm.weight (expected aaaa, got bbbb)"
    )


async def test_plain_says_why_the_tensors_of_a_mismatch_are_not_named():
    unnamed = TensorMismatch(
        engine="engine-1", tensor="*", expected="aa", actual="bb", reason="cannot read checksums manifest x"
    )
    event = PublicationMismatch(
        weight_version="2", mismatches=[unnamed], expected_digest="aa", engine_digests={}
    )
    lines = await plain_lines([EVENTS[0], event])
    assert lines[-2] == (
        "weight version 2: MISMATCH in 1 tensor(s), first engine-1:* (expected aa, got bb): "
        "cannot read checksums manifest x"
    )


async def test_plain_reports_an_actor_failure_and_the_failed_run_with_its_reason():
    start = EVENTS[0]
    failed = [
        start,
        ActorFailed(actor="trainer", error="RuntimeError: out of memory at trainer.py:10"),
        RunFinished(status="failed", reason="trainer failed", weight_version="default", time=start.time + 2),
    ]
    lines = await plain_lines(failed)
    assert lines[1] == "actor trainer failed: RuntimeError: out of memory at trainer.py:10"
    assert lines[2] == "run failed before any rollout at weight version default in 2.0s: trainer failed"


async def test_plain_without_verification_prints_each_rollout_when_it_is_published():
    unverified = [e for e in EVENTS if not isinstance(e, PublicationVerified)]
    lines = [line for line in await plain_lines(unverified, verify=False) if line.startswith("rollout ")]
    assert [line.rsplit("| ", 1)[1] for line in lines] == ["v2 published", "v3 published", "v4 published"]


async def test_a_trained_rollout_that_was_never_published_still_gets_its_line():
    cut = next(i for i, e in enumerate(EVENTS) if isinstance(e, TrainStepFinished) and e.rollout_id == 2)
    stopped = [
        *EVENTS[: cut + 1],
        RunFinished(status="stopped", reason="interrupted", last_rollout_id=2, weight_version="3"),
    ]
    lines = await plain_lines(stopped)
    assert lines[-2].startswith("rollout 2 [3/3]: reward 0.023 ") and lines[-2].endswith("| not published")
    assert lines[-1].startswith("run stopped after rollout 2 [3/3] at weight version 3")


async def test_a_run_that_ends_without_run_finished_says_it_was_interrupted():
    lines = await plain_lines(EVENTS[:12])
    assert lines[-1] == "run interrupted before it finished"


async def test_quiet_prints_only_the_final_line():
    assert await plain_lines(EVENTS, quiet=True) == [
        "run completed after rollout 2 [3/3] at weight version 4 in 0.9s"
    ]


def resumed_at(
    start: int, num_rollout: int, trained: tuple[int, ...], status: str = "stopped"
) -> list[Event]:
    """A run resumed at rollout ``start`` that trains and publishes ``trained``, then ends."""
    events: list[Event] = [RunStarted(
        run_id="test-run", runtime="local", config_digest="", start_rollout_id=start, num_rollout=num_rollout,
        num_rollout_per_epoch=None, resumed=True, weight_version=str(start + 1), engines=["engine-0"], time=100.0,
    )]  # fmt: skip
    for rollout_id in trained:
        version = str(rollout_id + 2)
        events += [
            RolloutGenerated(rollout_id=rollout_id, batch=DataRef("inprocess", "b", "generator"), num_samples=8,
                             reward_mean=0.5, weight_versions=[str(rollout_id + 1)]),
            TrainStepFinished(rollout_id=rollout_id, weight_version=str(rollout_id + 1), metrics=TrainMetrics()),
            WeightsPublished(weight_version=version, engines=["engine-0"], previous_versions=[], rollout_id=rollout_id),
            PublicationVerified(weight_version=version, digest="d", num_tensors=1, engines=["engine-0"],
                                rollout_id=rollout_id),
        ]  # fmt: skip
    last = trained[-1] if trained else start - 1
    events.append(RunFinished(status=status, last_rollout_id=last, weight_version=str(last + 2), time=101.0))  # type: ignore[arg-type]
    return events


async def test_a_resumed_run_names_each_rollout_by_its_id_and_counts_its_progress_beside_it():
    lines = await plain_lines(resumed_at(100, 150, trained=(100, 101)))
    assert (
        lines[0]
        == "run test-run (local): rollouts 100..149 (50 to run), engines engine-0, resumed at weight version 101"
    )
    assert [line.split(":")[0] for line in lines[1:3]] == ["rollout 100 [1/50]", "rollout 101 [2/50]"]
    assert lines[-1] == "run stopped after rollout 101 [2/50] at weight version 103 in 1.0s"


async def test_a_resumed_run_stopped_before_its_first_rollout_says_so():
    lines = await plain_lines(resumed_at(100, 150, trained=()))
    assert lines[-1] == "run stopped before any rollout at weight version 101 in 1.0s"


async def test_a_run_with_no_rollouts_to_run_says_so_plainly():
    lines = await plain_lines(resumed_at(100, 2, trained=(), status="completed"))
    assert lines == [
        "run test-run (local): no rollouts to run (it starts at rollout 100, run.num_rollout = 2), engines engine-0, "
        "resumed at weight version 101",
        "run completed with no rollouts to run at weight version 101 in 1.0s",
    ]


async def test_a_run_of_zero_rollouts_says_there_is_nothing_to_run():
    start = RunStarted(run_id="test-run", runtime="local", config_digest="", start_rollout_id=0, num_rollout=0,
                       num_rollout_per_epoch=None, engines=["engine-0"])  # fmt: skip
    lines = await plain_lines([start, RunFinished(status="completed", weight_version="1")])
    assert lines[0] == "run test-run (local): no rollouts to run (run.num_rollout = 0), engines engine-0"
    assert lines[1].startswith("run completed with no rollouts to run at weight version 1 in ")


async def test_two_evals_of_one_rollout_id_are_told_apart_by_the_weights_they_ran_on():
    start, *_ = EVENTS
    before = EvalFinished(rollout_id=0, metrics={"eval/accuracy": 0.25}, weight_versions=["1"])
    after = EvalFinished(rollout_id=0, metrics={"eval/accuracy": 0.5}, weight_versions=["2"])
    lines = await plain_lines([start, before, after])
    assert lines[1:3] == [
        "eval at rollout 0 (weights v1): accuracy=0.250",
        "eval at rollout 0 (weights v2): accuracy=0.500",
    ]
    console = rich_console()
    await drive(lambda: RichProgress(console), [start, before, after])
    assert "rollout 0 (weights v2): accuracy=0.5" in rich_summary(console.file.getvalue())  # type: ignore[attr-defined]


async def test_rich_shows_the_last_rollout_id_with_the_runs_progress_beside_it():
    console = rich_console()
    await drive(lambda: RichProgress(console), resumed_at(100, 150, trained=(100,)))
    summary = rich_summary(console.file.getvalue())  # type: ignore[attr-defined]
    assert "rollout 100 [1/50]" in summary and "run stopped after rollout 100 [1/50]" in summary


async def test_rich_before_any_rollout_shows_none_done_and_a_run_with_nothing_to_run_says_so():
    console = rich_console()
    await drive(lambda: RichProgress(console), resumed_at(100, 150, trained=()))
    assert "no rollout yet [0/50]" in rich_summary(console.file.getvalue())  # type: ignore[attr-defined]
    console = rich_console()
    await drive(lambda: RichProgress(console), resumed_at(100, 2, trained=(), status="completed"))
    assert "no rollouts to run (it starts at rollout 100, run.num_rollout = 2)" in rich_summary(
        console.file.getvalue()  # type: ignore[attr-defined]
    )


def session_with(mode: str, verify: bool = True) -> SimpleNamespace:
    config = Config(console=ConsoleConfig(mode=mode), verifier=VerifierConfig(enabled=verify))  # type: ignore[arg-type]
    return SimpleNamespace(config=config, run_id="test-run", run_dir=Path("."))


class Terminal(StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("mode", "stream", "kind"),
    [
        ("auto", StringIO, PlainProgress),
        ("auto", Terminal, RichProgress),
        ("plain", Terminal, PlainProgress),
        ("rich", StringIO, RichProgress),
    ],
)
async def test_make_console_picks_the_display_by_mode_and_terminal(mode, stream, kind):
    sink = await drive(lambda: make_console(session_with(mode).config, stream()), EVENTS)
    assert type(sink) is kind


async def test_make_console_quiet_mode_prints_only_the_end():
    stream = StringIO()
    await drive(lambda: make_console(session_with("quiet").config, stream), EVENTS)
    assert stream.getvalue() == "run completed after rollout 2 [3/3] at weight version 4 in 0.9s\n"


async def test_make_console_follows_the_verifier_setting():
    unverified = [e for e in EVENTS if not isinstance(e, PublicationVerified)]
    stream = StringIO()
    await drive(lambda: make_console(session_with("plain", verify=False).config, stream), unverified)
    assert "rollout 2 [3/3]: " in stream.getvalue() and "v4 published" in stream.getvalue()


def rich_console() -> Console:
    return Console(file=StringIO(), force_terminal=True, width=120)


async def test_rich_leaves_a_summary_with_reward_versions_and_verification():
    console = rich_console()
    await drive(lambda: RichProgress(console), EVENTS)
    summary = rich_summary(console.file.getvalue())  # type: ignore[attr-defined]
    assert "rollout 2 [3/3]" in summary
    assert "0.023" in summary and "min 0.008 max 0.023" in summary
    assert "trainer 4  engine-0 4  engine-1 4" in summary
    assert "v4 verified (27 tensors)" in summary
    assert "gen 0.06s  train 0.12s  pub 0.04s  verify 0.00s  save 0.08s" in summary
    assert "rollout 2 (trained from version 3) -> /tmp/fx/checkpoints/rollout_000002" in summary
    assert "run completed after rollout 2 [3/3] at weight version 4" in summary


async def test_rich_shows_the_trainers_ranks_and_each_ranks_last_time_and_memory():
    console = rich_console()
    await drive(lambda: RichProgress(console), with_ranks(EVENTS, 2))
    summary = rich_summary(console.file.getvalue())  # type: ignore[attr-defined]
    assert "ranks         2 ranks, fsdp2 · 0: 0.30s 400 MiB  1: 0.31s 410 MiB" in summary


async def test_rich_shows_no_ranks_row_for_a_one_rank_trainer():
    console = rich_console()
    await drive(lambda: RichProgress(console), with_ranks(EVENTS, 1, "none"))
    summary = rich_summary(console.file.getvalue())  # type: ignore[attr-defined]
    assert "ranks" not in summary


async def test_rich_summary_names_the_first_mismatched_tensor():
    console = rich_console()
    await drive(lambda: RichProgress(console), with_mismatch_at_rollout_0(EVENTS)[:22])
    summary = rich_summary(console.file.getvalue())  # type: ignore[attr-defined]
    assert "v2 MISMATCH in 1 tensor(s), first engine-1:model.norm.weight" in summary


async def test_rich_redraws_at_most_once_per_interval_and_catches_up_after_it():
    console = rich_console()
    updates: list[int] = []

    def make() -> RichProgress:
        sink = RichProgress(console, min_interval=0.2)
        update = sink.live.update
        sink.live.update = lambda *a, **k: (updates.append(1), update(*a, **k))  # type: ignore[method-assign]
        return sink

    await drive(make, EVENTS, settle=0.2, clock=ManualClock())
    # The first event draws at once; the burst after it is drawn once, when the interval ends.
    assert len(updates) == 2


async def test_a_display_that_cannot_write_keeps_draining_its_mailbox():
    class Broken(StringIO):
        def write(self, text: str) -> int:
            raise OSError("broken pipe")

    sink = await drive(lambda: PlainProgress(Broken()), EVENTS)
    host = sink.host
    assert host.task.done() and host.task.exception() is None
    assert host.mailbox.statistics().delivered == sum(isinstance(e, host.mailbox.types) for e in EVENTS)


def test_eta_is_the_remaining_rollouts_at_the_pace_so_far():
    progress = RunProgress()
    progress.apply(
        RunStarted(
            runtime="local",
            config_digest="",
            start_rollout_id=2,
            num_rollout=6,
            num_rollout_per_epoch=6,
            time=100.0,
        )
    )
    train = TrainStepFinished(
        rollout_id=3, weight_version="4", metrics=TrainMetrics(num_optimizer_steps=1), time=110.0,
    )  # fmt: skip
    progress.apply(train)
    assert (progress.done, progress.total) == (2, 4)
    assert progress.eta_seconds() == pytest.approx(10.0)


def test_engine_versions_start_at_default_even_on_resume():
    progress = RunProgress()
    resumed = RunStarted(
        runtime="local", config_digest="", start_rollout_id=5, num_rollout=9, num_rollout_per_epoch=9,
        resumed=True, weight_version="6", engines=["engine-0"],
    )  # fmt: skip
    progress.apply(resumed)
    assert progress.trainer_version == "6"
    assert progress.engine_versions == {"engine-0": "default"}


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.3, 0.3]) == "▅▅"
    assert sparkline([]) == ""


def test_final_line_of_a_completed_run_has_no_trailing_reason():
    progress = RunProgress()
    progress.apply(EVENTS[0])
    progress.apply(RunFinished(status="completed", last_rollout_id=2, weight_version="4"))
    assert progress.final_line() == "run completed after rollout 2 [3/3] at weight version 4"


async def test_a_ppo_run_shows_the_critic_only_step_and_the_critics_value_loss():
    ppo = list(read_events(Path(__file__).parent / "fixtures" / "ppo_run" / "events.log"))
    rollout_lines = [line for line in await plain_lines(ppo) if line.startswith("rollout ")]
    assert len(rollout_lines) == 3
    assert "reward 0.008 critic only vloss 0.0036 | gen " in rollout_lines[0]
    assert " critic 0.06s train 0.00s " in rollout_lines[0]
    assert all(" loss " in line and " vloss " in line for line in rollout_lines[1:]), rollout_lines


async def test_a_resume_names_the_rollouts_it_generates_again():
    events = resumed_at(100, 150, trained=())
    events[0] = msgspec.structs.replace(events[0], regenerated=[100, 101])
    lines = await plain_lines(events)
    assert lines[1] == "rollouts 100, 101: asked for after the checkpoint before the resume, generated again"
