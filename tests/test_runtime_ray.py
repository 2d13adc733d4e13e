"""The ray runtime: model actors in their own processes, light ones on the driver unless
``ray.own_process`` names them; events batched across, failures reported; a lean cluster
with no idle workers, torn down at once."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from pathlib import Path

import pytest

from miles_events.bus.actor import Actor
from miles_events.bus.event_bus import EventBus
from miles_events.runtime.base import ActorStartError, Preparation, RunContext
from miles_events.runtime.leftovers import PROCESSES_FILE, Process, alive, ray_processes, start_time
from miles_events.runtime.ray import RayRuntime
from miles_events.transport.shm import ShmTransport
from schemas.config import Config, ControlConfig, RayConfig, RunConfig
from schemas.events import (
    ActorFailed,
    CellFailed,
    CellRestarted,
    EvalRequested,
    Event,
    RolloutRequested,
    StopRequested,
)
from schemas.plan import RunPlan
from tests.ray_actors import PREPARED, Echo, Learner, Model, Phoenix, Ranked, fill_the_disk, write_pid
from tests.support import cmdline

pytestmark = pytest.mark.slow


async def start(
    tmp_path,
    actors: list[type[Actor]] | None = None,
    ray: RayConfig | None = None,
    prepare: Preparation | None = None,
) -> tuple[EventBus, RayRuntime]:
    # Echo is a light actor (role service): by default the option gives it a process of its own.
    config = Config(run=RunConfig(runtime="ray"), ray=ray or RayConfig(own_process=["echo"]))
    bus = EventBus("ray-test")
    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1, runtime="ray")
    runtime = RayRuntime(
        RunContext("ray-test", config, tmp_path, "shm", plan, prepare=prepare), ShmTransport("ray-test")
    )
    await runtime.start(bus, actors or [Echo])
    return bus, runtime


def running(process: Process) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{process[0]}/stat").read_text()
    except OSError:
        return False
    return alive(process) and stat[stat.rindex(")") + 2] != "Z"


async def collect(mailbox, count: int) -> list[Event]:
    return [await asyncio.wait_for(mailbox.get(), 60) for _ in range(count)]


async def test_events_cross_processes_in_order_and_failures_become_actor_failed(tmp_path):
    bus, runtime = await start(tmp_path)
    try:
        replies = bus.subscribe("replies", (StopRequested, ActorFailed))
        for i in range(300):
            await bus.publish(RolloutRequested(rollout_id=1000 + i))
        got = await collect(replies, 300)
        pids = {int(e.reason.split(":")[0]) for e in got}
        assert pids and os.getpid() not in pids, "the actor runs in another process"
        assert [int(e.reason.split(":")[1]) for e in got] == list(range(1000, 1300))
        assert all(e.source == "echo" for e in got)
        assert runtime.proxies[0].emitted == 300

        await bus.publish(RolloutRequested(rollout_id=13))
        failed = (await collect(replies, 1))[0]
        assert isinstance(failed, ActorFailed) and failed.actor == "echo"
        assert "ValueError: unlucky rollout" in failed.error and "Traceback" in failed.traceback
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_a_dead_actor_process_is_reported_not_hung(tmp_path):
    bus, runtime = await start(tmp_path)
    try:
        failures = bus.subscribe("failures", (ActorFailed,))
        await bus.publish(RolloutRequested(rollout_id=666))
        failed = await asyncio.wait_for(failures.get(), 60)
        assert isinstance(failed, ActorFailed) and failed.actor == "echo"
        assert "actor process died" in failed.error
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_a_restartable_actor_whose_process_dies_mid_event_is_started_again_and_handles_it_once(
    tmp_path,
):
    """The Saver's kind of actor (``restartable``): its process dies while handling an
    event; it is started again (``CellFailed``, ``CellRestarted``), the event delivered again
    and answered once, by the new process; past ``control.max_restarts`` it is dead
    (``ActorFailed`` naming the limit)."""
    bus = EventBus("ray-test")
    config = Config(
        run=RunConfig(runtime="ray"),
        ray=RayConfig(own_process=["phoenix"]),
        control=ControlConfig(max_restarts=1, restart_backoff_seconds=0),
    )
    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1, runtime="ray")
    runtime = RayRuntime(RunContext("ray-test", config, tmp_path, "shm", plan), ShmTransport("ray-test"))
    await runtime.start(bus, [Phoenix])
    try:
        seen = bus.subscribe("seen", (StopRequested, CellFailed, CellRestarted, ActorFailed))
        first_pid = runtime.processes()[0][1]
        await bus.publish(RolloutRequested(rollout_id=1))
        got = await collect(seen, 1)
        await bus.publish(RolloutRequested(rollout_id=777))
        await bus.publish(RolloutRequested(rollout_id=2))
        got += await collect(seen, 4)
        kinds = [type(e).__name__ for e in got]
        assert kinds == ["StopRequested", "CellFailed", "CellRestarted", "StopRequested", "StopRequested"]
        answers = [e.reason for e in got if isinstance(e, StopRequested)]
        assert answers[0] == f"{first_pid}:1"
        new_pid = got[2].pid
        assert new_pid != first_pid and answers[1:] == [f"{new_pid}:777", f"{new_pid}:2"]
        assert got[1].cell == "phoenix" and "actor process died" in got[1].reason
        # Restarts spent: the next death is the actor's end.
        await bus.publish(RolloutRequested(rollout_id=778))
        last = await collect(seen, 2)
        assert isinstance(last[0], CellFailed)
        assert isinstance(last[1], ActorFailed) and "control.max_restarts = 1" in last[1].error
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_light_actors_run_on_the_driver_unless_named_and_model_actors_in_their_own(tmp_path):
    bus, runtime = await start(tmp_path, [Echo, Model], RayConfig())
    try:
        replies = bus.subscribe("replies", (StopRequested,))
        await bus.publish(RolloutRequested(rollout_id=1))
        await bus.publish(EvalRequested(rollout_id=2))
        pids = {e.source: int(e.reason.split(":")[0]) for e in await collect(replies, 2)}
        assert pids["echo"] == os.getpid(), "a light actor is hosted on the driver's loop"
        assert pids["model"] != os.getpid(), "a model actor has a process of its own"
        assert runtime.processes() == [("model", pids["model"])]
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_the_runs_preparation_is_made_in_the_trainers_process_before_any_actor_starts(tmp_path):
    written = tmp_path / PREPARED
    preparation = Preparation("building the test model", functools.partial(write_pid, written))
    bus, runtime = await start(tmp_path, [Model, Learner], RayConfig(), preparation)
    try:
        replies = bus.subscribe("replies", (StopRequested,))
        await bus.publish(EvalRequested(rollout_id=1))
        pids = {e.source: int(e.reason.split(":")[0]) for e in await collect(replies, 2)}
        assert int(written.read_text()) == pids["learner"] != os.getpid()
        assert [(tmp_path / f"{n}.started").read_text() for n in ("model", "learner")] == [
            "prepared",
            "prepared",
        ]
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_a_preparation_that_fails_fails_the_start_naming_what_and_where(tmp_path):
    config = Config(run=RunConfig(runtime="ray"))
    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1, runtime="ray")
    preparation = Preparation("building the test model", fill_the_disk)
    context = RunContext("ray-test", config, tmp_path, "shm", plan, prepare=preparation)
    runtime = RayRuntime(context, ShmTransport("ray-test"))
    try:
        with pytest.raises(ActorStartError) as failed:
            await runtime.start(EventBus("ray-test"), [Model, Learner])
    finally:
        await runtime.stop()
        ShmTransport("ray-test").close()
    message = str(failed.value)
    assert message.startswith("building the test model: OSError: [Errno 28] No space left on device")
    assert message.endswith("(learner's process)")
    assert not list(tmp_path.glob("*.started")), "no actor started"


async def test_the_cluster_is_lean_and_its_stop_runs_every_stop_then_ends_it_at_once(tmp_path):
    # Two CPUs, two actor processes: Ray prestarts a worker per CPU, and each hosts an actor.
    bus, runtime = await start(tmp_path, [Echo, Model], RayConfig(own_process=["echo"], num_cpus=2))
    try:
        replies = bus.subscribe("replies", (StopRequested,))
        await bus.publish(EvalRequested(rollout_id=3))
        pid, _, arenas, _ = (await collect(replies, 1))[0].reason.split(":")
        # The cluster's processes start with few malloc arenas; the driver keeps its own
        # environment, and what an actor starts gets glibc's default again.
        assert b"MALLOC_ARENA_MAX=2" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert arenas == "" and "MALLOC_ARENA_MAX" not in os.environ
        cluster = ray_processes()
        commands = [cmdline(pid) for pid, _ in cluster]
        assert sorted(name for name, _ in runtime.processes()) == ["echo", "model"]
        assert not [c for c in commands if c.startswith(b"ray::IDLE")], "no idle worker is left running"
        assert not [
            c for c in commands if b"dashboard/dashboard.py" in c or b"autoscaler/_private/monitor.py" in c
        ]
        agents = (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")
        assert not [c for c in commands if c.startswith(agents)], "the raylet's agents are stood in for"
        assert (tmp_path / PROCESSES_FILE).exists()
    finally:
        bus.close()
        began = time.monotonic()
        await runtime.stop()
        took = time.monotonic() - began
        ShmTransport("ray-test").close()
    assert (tmp_path / "echo.stopped").exists() and (tmp_path / "model.stopped").exists(), "every stop() ran"
    assert not [p for p in cluster if running(p)], "nothing of the cluster outlives the stop"
    assert not (tmp_path / PROCESSES_FILE).exists()
    assert took < 10, f"stopping took {took:.1f}s"


async def test_an_actors_process_logs_into_the_runs_log_at_the_drivers_level(tmp_path):
    # ``python -m miles_events.run --log-level info`` sets the driver's root logger: an
    # actor's INFO lines must reach the run's log from its own process too, each line
    # naming its process.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        bus, runtime = await start(tmp_path, [Model, Ranked], RayConfig())
    finally:
        root.setLevel(level)
    try:
        replies = bus.subscribe("replies", (StopRequested,))
        await bus.publish(EvalRequested(rollout_id=4))
        answers = {e.source: e.reason.split(":") for e in await collect(replies, 3)}  # ranked's rank 1 last
        model_pid, _, _, model_logs = answers["model"]
        rank, rank_pid, _, actor_pid, _, rank_logs = answers["ranked"]
        assert (int(rank), len({int(model_pid), int(rank_pid), int(actor_pid), os.getpid()})) == (1, 4)
        # The root logger at the driver's level, with one handler: the run's log.
        assert model_logs == rank_logs == "INFO/1", (
            "an actor's process and a rank's process log at the driver's level"
        )
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()
    log = (tmp_path / "run.log").read_text()
    assert f"INFO [model pid {model_pid}] tests.ray_actors: eval 4 asked of the model" in log, log
    assert f"INFO [ranked rank 1 pid {rank_pid}] tests.ray_actors: rank 1 asked where it runs" in log, log


async def test_without_an_actor_for_each_cpu_no_worker_is_prestarted(tmp_path):
    bus, runtime = await start(tmp_path, [Model], RayConfig(num_cpus=4))
    try:
        await asyncio.sleep(1)  # what Ray prestarts comes up beside the actor's own worker
        idle = [pid for pid, _ in ray_processes() if cmdline(pid).startswith(b"ray::IDLE")]
        assert not idle, idle
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_a_worker_group_has_rank_0_in_its_actor_and_each_other_rank_in_a_process_of_its_own(tmp_path):
    bus, runtime = await start(tmp_path, [Ranked], RayConfig())
    try:
        replies = bus.subscribe("replies", (StopRequested,))
        await bus.publish(EvalRequested(rollout_id=1))
        await bus.publish(EvalRequested(rollout_id=2))
        answers = [e.reason.split(":") for e in await collect(replies, 4)]
        (actor_pid,) = {int(a[3]) for a in answers}
        ranks = {int(a[0]): (int(a[1]), int(a[2])) for a in answers}
        assert ranks[0] == (actor_pid, 2), "rank 0 lives in the actor's own process"
        rank_1_pid = ranks[1][0]
        rank_1 = (rank_1_pid, start_time(rank_1_pid))
        assert rank_1_pid not in (actor_pid, os.getpid()), "rank 1 has a process of its own"
        assert ranks[1][1] == 2, "the ranks split the node's cores: Ray pins no process to its CPUs"
        assert all("eval 1" in a[4] for a in answers[2:]), "notifications reach every rank"
        assert runtime.processes() == [("ranked", actor_pid)]

        await bus.publish(RolloutRequested(rollout_id=3))
        (failed,) = await collect(replies, 1)
        assert failed.reason == "KeyError: rank 1 was asked to fail", (
            "a rank's own exception reaches its actor"
        )
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()
    assert (tmp_path / "rank-0.closed").read_text() == str(actor_pid)
    assert (tmp_path / "rank-1.closed").read_text() == str(rank_1_pid), "every rank is closed where it runs"
    assert not running(rank_1), "the rank's process is gone"


async def test_a_rank_killed_in_the_middle_of_a_call_fails_it_and_the_next_naming_the_rank(tmp_path):
    bus, runtime = await start(tmp_path, [Ranked], RayConfig())
    try:
        replies = bus.subscribe("replies", (StopRequested,))
        await bus.publish(EvalRequested(rollout_id=1))
        rank_1_pid = int((await collect(replies, 2))[1].reason.split(":")[1])
        started = time.monotonic()
        await bus.publish(RolloutRequested(rollout_id=66))
        died = [e.reason for e in await collect(replies, 2)]
        assert time.monotonic() - started < 10
        prefix = f"RankDied: ranked rank 1 (pid {rank_1_pid}) died: its Ray actor died"
        assert all(reason.startswith(prefix) and "\n" not in reason for reason in died), died
    finally:
        bus.close()
        await runtime.stop()
        ShmTransport("ray-test").close()


async def test_a_rank_that_cannot_start_fails_its_actors_start_naming_it_with_its_error(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MILES_TEST_FAILING_RANK", "1")
    config = Config(run=RunConfig(runtime="ray"))
    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1, runtime="ray")
    runtime = RayRuntime(RunContext("ray-test", config, tmp_path, "shm", plan), ShmTransport("ray-test"))
    try:
        with pytest.raises(
            ActorStartError,
            match="^ranked: RuntimeError: ranked rank 1 failed to start: OSError: rank 1 cannot start",
        ):
            await runtime.start(EventBus("ray-test"), [Ranked])
    finally:
        await runtime.stop()
        ShmTransport("ray-test").close()
    assert (tmp_path / "rank-0.closed").exists(), "the rank that started is closed"
