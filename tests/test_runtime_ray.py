"""The ray runtime: actors in their own processes, events batched across, failures reported."""

from __future__ import annotations

import asyncio
import os

import pytest

from miles_events.bus.event_bus import EventBus
from miles_events.runtime.base import RunContext
from miles_events.runtime.ray import RayRuntime
from miles_events.transport.base import ShmTransport
from schemas.config import Config, RunConfig
from schemas.events import ActorFailed, Event, RolloutRequested, StopRequested
from schemas.plan import RunPlan
from tests.ray_actors import Echo

pytestmark = pytest.mark.slow


async def start(tmp_path) -> tuple[EventBus, RayRuntime]:
    config = Config(run=RunConfig(runtime="ray"))
    bus = EventBus("ray-test")
    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1, runtime="ray")
    runtime = RayRuntime(RunContext("ray-test", config, tmp_path, "shm", plan), ShmTransport("ray-test"))
    await runtime.start(bus, [Echo])
    return bus, runtime


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
