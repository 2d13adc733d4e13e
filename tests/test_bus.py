"""The bus: ordering, typed subscriptions, backpressure without loss, statistics, drain,
and handler failures turned into ActorFailed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from miles_events.bus.actor import Actor, handles
from miles_events.bus.clock import ManualClock
from miles_events.bus.event_bus import BusClosed, EventBus
from miles_events.bus.host import ActorHost
from schemas.events import (
    ActorFailed,
    Event,
    RolloutRequested,
    RunFinished,
    SaveRequested,
)


async def test_seq_strictly_increases_in_every_mailbox_under_concurrent_publishers():
    bus = EventBus("r", mailbox_size=3)
    everything = bus.subscribe("all", (Event,), max_size=3)
    rollouts = bus.subscribe("rollouts", (RolloutRequested,), max_size=2)

    async def publisher(offset: int) -> None:
        for i in range(50):
            event = RolloutRequested(rollout_id=offset + i) if i % 2 else SaveRequested(rollout_id=offset + i)
            await bus.publish(event, source=f"p{offset}")

    async def drain(mailbox, out):
        while (event := await mailbox.get()) is not None:
            out.append(event)
            await asyncio.sleep(0)

    seen_all, seen_rollouts = [], []
    consumers = [
        asyncio.create_task(drain(everything, seen_all)),
        asyncio.create_task(drain(rollouts, seen_rollouts)),
    ]
    await asyncio.gather(*(publisher(k * 1000) for k in range(4)))
    bus.close()
    await asyncio.gather(*consumers)
    assert [e.seq for e in seen_all] == list(range(1, 201))
    seqs = [e.seq for e in seen_rollouts]
    assert seqs == sorted(seqs) and len(seqs) == 100
    assert all(isinstance(e, RolloutRequested) for e in seen_rollouts)


async def test_publish_stamps_the_header():
    bus = EventBus("run-7")
    mailbox = bus.subscribe("m", (Event,))
    stamped = await bus.publish(RolloutRequested(rollout_id=3), source="coordinator")
    assert (stamped.run_id, stamped.seq, stamped.source) == ("run-7", 1, "coordinator")
    assert stamped.time > 0
    assert await mailbox.get() == stamped


async def test_subscription_by_type_receives_only_those_types():
    bus = EventBus("r")
    saves = bus.subscribe("saves", (SaveRequested,))
    await bus.publish(RolloutRequested(rollout_id=0))
    await bus.publish(SaveRequested(rollout_id=0))
    bus.close()
    got = [e async for e in _iterate(saves)]
    assert [type(e) for e in got] == [SaveRequested]


async def _iterate(mailbox):
    while (event := await mailbox.get()) is not None:
        yield event


async def test_full_mailbox_blocks_the_publisher_instead_of_dropping():
    bus = EventBus("r")
    slow = bus.subscribe("slow", (Event,), max_size=2)
    await bus.publish(RolloutRequested(rollout_id=0))
    await bus.publish(RolloutRequested(rollout_id=1))
    third = asyncio.create_task(bus.publish(RolloutRequested(rollout_id=2)))
    await asyncio.sleep(0.01)
    assert not third.done(), "publishing into a full mailbox must wait"
    assert slow.statistics().depth == 2
    assert (await slow.get()).rollout_id == 0
    await asyncio.wait_for(third, 1)
    assert [(await slow.get()).rollout_id for _ in range(2)] == [1, 2]


async def test_no_event_is_lost_with_a_slow_consumer():
    bus = EventBus("r")
    mailbox = bus.subscribe("slow", (Event,), max_size=4)
    received = []

    async def consume():
        while (event := await mailbox.get()) is not None:
            received.append(event.rollout_id)
            if len(received) % 7 == 0:
                await asyncio.sleep(0.001)

    consumer = asyncio.create_task(consume())
    for i in range(500):
        await bus.publish(RolloutRequested(rollout_id=i))
    bus.close()
    await consumer
    assert received == list(range(500))


async def test_statistics_report_depth_delivered_and_high_water_mark():
    bus = EventBus("r")
    mailbox = bus.subscribe("m", (Event,), max_size=10)
    for i in range(5):
        await bus.publish(RolloutRequested(rollout_id=i))
    await mailbox.get()
    await mailbox.get_batch(2)
    stats = mailbox.statistics()
    assert (stats.depth, stats.delivered, stats.high_water_mark, stats.max_size) == (2, 3, 5, 10)
    assert [s.name for s in bus.statistics()] == ["m"]


async def test_close_drains_what_is_queued_then_ends():
    bus = EventBus("r")
    mailbox = bus.subscribe("m", (Event,))
    for i in range(3):
        await bus.publish(RolloutRequested(rollout_id=i))
    bus.close()
    assert [e.rollout_id async for e in _iterate(mailbox)] == [0, 1, 2]
    assert await mailbox.get_batch(10) == []
    with pytest.raises(BusClosed):
        await bus.publish(RolloutRequested(rollout_id=9))


async def test_a_stalled_publish_is_reported(caplog):
    clock = ManualClock()
    bus = EventBus("r", stall_warning_seconds=20, clock=clock)
    mailbox = bus.subscribe("stuck", (Event,), max_size=1)
    await bus.publish(RolloutRequested(rollout_id=0))
    with caplog.at_level(logging.WARNING, logger="miles_events.bus.event_bus"):
        blocked = asyncio.create_task(bus.publish(RolloutRequested(rollout_id=1)))
        for _ in range(3):
            await clock.advance(5)
        assert "stuck" not in caplog.text
        for _ in range(2):
            await clock.advance(5)
        assert "waited 20.0s on the full mailbox 'stuck'" in caplog.text
    await mailbox.get()
    await asyncio.wait_for(blocked, 1)


class Exploding(Actor):
    name = "exploding"

    def __init__(self) -> None:
        self.handled: list[int] = []

    @handles(RolloutRequested, emits=())
    async def on_rollout(self, event: RolloutRequested) -> None:
        if event.rollout_id == 1:
            raise ValueError("reward function returned None")
        self.handled.append(event.rollout_id)


async def test_a_raising_handler_becomes_actor_failed_and_the_actor_stops_handling():
    bus = EventBus("r")
    failures = bus.subscribe("watch", (ActorFailed,))
    actor = Exploding()

    async def publish(event):
        return await bus.publish(event, source="exploding")

    host = ActorHost(actor, bus.subscribe("exploding", (RolloutRequested,)), publish)
    host.start()
    for i in range(3):
        await bus.publish(RolloutRequested(rollout_id=i))
    failed = await asyncio.wait_for(failures.get(), 1)
    assert isinstance(failed, ActorFailed)
    assert failed.actor == "exploding" and failed.event_type == "RolloutRequested"
    assert "ValueError: reward function returned None" in failed.error
    bus.close()
    await asyncio.wait_for(host.join(), 1)  # never a hung loop
    assert actor.handled == [0]


async def test_handlers_are_found_through_the_decorator():
    assert Exploding.handlers() == {RolloutRequested: "on_rollout"}
    assert RunFinished not in Exploding.handlers()


async def test_the_consumer_of_a_full_mailbox_can_still_publish():
    bus = EventBus("r")
    inbox = bus.subscribe("actor", (RolloutRequested,), max_size=1)
    outbox = bus.subscribe("other", (SaveRequested,))
    await bus.publish(RolloutRequested(rollout_id=0))
    blocked = asyncio.create_task(bus.publish(RolloutRequested(rollout_id=1)))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    # The actor, before it takes its next event, publishes elsewhere: it must not wait.
    await asyncio.wait_for(bus.publish(SaveRequested(rollout_id=0)), 1)
    assert (await outbox.get()).rollout_id == 0
    assert (await inbox.get()).rollout_id == 0
    await asyncio.wait_for(blocked, 1)
    got = await inbox.get()
    assert got.rollout_id == 1 and got.seq > 2


async def test_closing_the_bus_releases_a_blocked_publisher():
    bus = EventBus("r")
    bus.subscribe("stuck", (Event,), max_size=1)
    await bus.publish(RolloutRequested(rollout_id=0))
    blocked = asyncio.create_task(bus.publish(RolloutRequested(rollout_id=1)))
    await asyncio.sleep(0.01)
    bus.close()
    with pytest.raises(BusClosed):
        await asyncio.wait_for(blocked, 1)
