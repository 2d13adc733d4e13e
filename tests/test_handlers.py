"""One dispatch style: ``@handles`` tables with declared emits, for actors and sinks alike;
every event class is in the tagged union."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.coordinator import Coordinator
from miles_events.app.roster import ACTORS, SINKS
from miles_events.bus.actor import Actor, UndeclaredEmit
from miles_events.bus.clock import ManualClock, wait_for
from miles_events.bus.handlers import handles
from miles_events.bus.testing import RecordingContext, feed
from miles_events.sinks.base import Sink
from schemas import events as events_module
from schemas.config import Config
from schemas.events import (
    EVENT_TYPES,
    ActorFailed,
    EvalRequested,
    Event,
    PublicationEvidenceRequested,
    RolloutGenerated,
    RolloutRequested,
    SaveRequested,
    StopRequested,
    WeightsCheckRequested,
)


class Echo(Actor):
    name = "echo"

    @handles(RolloutRequested, emits=(StopRequested,))
    async def on_rollout(self, event: RolloutRequested) -> None:
        if event.rollout_id == 1:
            await self.publish(
                RolloutGenerated(rollout_id=1, batch=None, num_samples=0, reward_mean=0, weight_versions=[])
            )  # type: ignore[arg-type]
        await self.publish(StopRequested(reason=str(event.rollout_id)))


def echo() -> Echo:
    return Echo(Config(), RecordingContext(Config(), name="echo"))


async def test_a_handler_publishes_what_it_declares():
    out = await feed(echo(), RolloutRequested(rollout_id=0))
    assert out == [StopRequested(reason="0")]


async def test_a_handler_that_publishes_an_undeclared_type_fails():
    with pytest.raises(UndeclaredEmit, match="Echo.on_rollout published RolloutGenerated"):
        await feed(echo(), RolloutRequested(rollout_id=1))


async def test_outside_a_handler_only_the_class_emits_are_allowed():
    actor = echo()
    with pytest.raises(UndeclaredEmit, match="outside a handler"):
        await actor.publish(StopRequested(reason="x"))


def test_a_handler_without_emits_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match="must declare emits"):

        class Silent(Actor):
            @handles(RolloutRequested)
            async def on_rollout(self, event: RolloutRequested) -> None: ...


def test_every_actor_handler_declares_emits():
    for actor in ACTORS:
        assert actor.routes(), actor
        assert all(route.emits is not None for route in actor.routes()), actor


def test_a_subclass_handler_replaces_its_base_handler():
    class Base(Sink):
        @handles(RolloutRequested)
        def on_any(self, event: Event) -> None: ...

    class Derived(Base):
        @handles(RolloutRequested)
        def on_rollout(self, event: Event) -> None: ...

    assert Derived.handlers() == {RolloutRequested: "on_rollout"}
    assert [r.method for r in Derived.routes()] == ["on_rollout"]


def test_a_handler_of_event_sees_every_type():
    class All(Sink):
        seen: list[str] = []

        @handles(Event)
        def on_event(self, event: Event) -> None:
            self.seen.append(type(event).__name__)

    sink = All()
    sink.observe(RolloutRequested(rollout_id=0))
    sink.observe(StopRequested(reason="x"))
    assert sink.seen == ["RolloutRequested", "StopRequested"]


def test_sinks_handle_with_the_same_tables():
    for sink in SINKS:
        assert sink.handlers(), sink


def test_every_event_class_is_in_the_tagged_union():
    defined = {
        value
        for value in vars(events_module).values()
        if isinstance(value, type)
        and issubclass(value, Event)
        and value is not Event
        and not value.__name__.startswith("_")  # a private base (shared fields) is no event
    }
    missing = sorted(cls.__name__ for cls in defined - set(EVENT_TYPES))
    assert not missing, f"add to AnyEvent in schemas/events.py: {missing}"


def test_an_event_missing_from_the_union_is_caught():
    class Orphan(Event, frozen=True, kw_only=True):
        x: int = 0

    decoded = msgspec.msgpack.Decoder(events_module.AnyEvent)
    with pytest.raises(msgspec.ValidationError):
        decoded.decode(msgspec.msgpack.encode(Orphan()))
    assert Orphan not in EVENT_TYPES


def test_the_coordinator_runs_in_the_driver():
    assert Coordinator.resources(Config()).role == "driver"


def emitted_on(actor: type[Actor], event_type: type[Event]) -> set[str]:
    """The events on which ``actor`` declares it may publish ``event_type``."""
    return {
        handled.__name__
        for route in actor.routes()
        if event_type in (route.emits or ())
        for handled in route.handles
    }


def test_the_coordinator_asks_for_a_save_only_after_a_step_a_save_or_a_stop():
    # A step trained, a save written, a step cut; or a stop once a step's publication (or
    # the eval after it) is through. The opening's checks and evidence never save.
    assert emitted_on(Coordinator, SaveRequested) == {
        "TrainStepFinished", "CheckpointSaved", "StepCancelled",
        "WeightsPublished", "PublicationVerified", "PublicationMismatch", "EvalFinished",
        "PolicySyncFinished",  # an external policy synchronizer's hook after a step or a publication
        "MemoryOffloaded", "MemoryOnloaded",  # offload: the moves before and after a publication
    }  # fmt: skip


def test_only_the_opening_asks_for_weight_checks_and_an_eval_never_asks_for_another():
    assert emitted_on(Coordinator, WeightsCheckRequested) == {
        "RunStarted", "WeightsCheckFinished", "WeightsPublished", "PublicationVerified", "PublicationMismatch",
        "PolicySyncFinished",  # the opening goes on after initialize / after_inference_publication(None)
        "MemoryOffloaded", "MemoryOnloaded",  # offload: the moves at the start and around the publication
        "TrainerRestored",  # a trainer group lost during the opening: the opening again
    }  # fmt: skip
    assert "EvalFinished" not in emitted_on(Coordinator, EvalRequested)
    assert emitted_on(Coordinator, PublicationEvidenceRequested) == {"WeightsCheckFinished"}


async def test_a_manual_clock_wakes_sleepers_only_when_advanced():
    clock = ManualClock()
    woke: list[float] = []

    async def sleeper(seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(clock.monotonic())

    tasks = [asyncio.create_task(sleeper(s)) for s in (3, 1)]
    await clock.advance(0.5)
    assert woke == []
    await clock.advance(0.5)
    assert woke == [1.0]
    await clock.advance(2)
    assert woke == [1.0, 3.0]
    await asyncio.gather(*tasks)


async def test_wait_for_times_out_on_the_clock_it_is_given():
    clock = ManualClock()
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(wait_for(never, 10, clock))
    await clock.advance(9)
    assert not waiting.done()
    await clock.advance(1)
    with pytest.raises(TimeoutError):
        await waiting
    assert never.cancelled()


class Timed(Actor):
    name = "timed"

    @handles(RolloutRequested, emits=())
    async def on_rollout(self, event: RolloutRequested) -> None:
        if event.rollout_id == 0:
            self.spawn(self._later(StopRequested(reason="timer")), emits=(StopRequested,))
        else:
            self.spawn(
                self._later(
                    RolloutGenerated(
                        rollout_id=1, batch=None, num_samples=0, reward_mean=0, weight_versions=[]
                    )
                ),
                emits=(StopRequested,),
            )  # type: ignore[arg-type]

    async def _later(self, event: Event) -> None:
        await asyncio.sleep(0)
        await self.publish(event)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_spawned_task_publishes_what_it_was_spawned_to_emit():
    actor = Timed(Config(), RecordingContext(Config(), name="timed"))
    await feed(actor, RolloutRequested(rollout_id=0))
    await settle()
    assert actor.context.published == [StopRequested(reason="timer")]


async def test_a_spawned_task_that_raises_is_the_actors_failure():
    actor = Timed(Config(), RecordingContext(Config(), name="timed"))
    await feed(actor, RolloutRequested(rollout_id=1))
    await settle()
    [failed] = actor.context.published
    assert isinstance(failed, ActorFailed) and failed.actor == "timed"
    assert "UndeclaredEmit" in failed.error and "_later published RolloutGenerated" in failed.error


def test_a_method_redefined_for_other_types_no_longer_takes_the_base_types():
    class Base(Sink):
        @handles(RolloutRequested)
        def on(self, event: Event) -> None: ...

    class Derived(Base):
        @handles(StopRequested)
        def on(self, event: Event) -> None: ...

    assert Derived.handlers() == {StopRequested: "on"}


async def test_no_actor_sees_an_event_before_its_ready(tmp_path):
    from miles_events.bus.event_bus import EventBus
    from miles_events.runtime.base import RunContext
    from miles_events.runtime.local import LocalRuntime
    from miles_events.transport.inprocess import InProcessTransport
    from schemas.plan import RunPlan

    seen: list[str] = []

    class Starter(Actor):
        name = "starter"
        emits = (RolloutRequested,)

        async def ready(self) -> None:
            seen.append("starter ready")
            await self.publish(RolloutRequested(rollout_id=0))

    class Late(Actor):
        name = "late"

        async def ready(self) -> None:
            seen.append("late ready")

        @handles(RolloutRequested, emits=())
        async def on(self, event: RolloutRequested) -> None:
            seen.append("late handled")

    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1)
    runtime = LocalRuntime(RunContext("r", Config(), tmp_path, "inprocess", plan), InProcessTransport("r"))
    bus = EventBus("r")
    await runtime.start(bus, [Starter, Late])
    await settle()
    bus.close()
    await runtime.stop()
    assert seen == ["starter ready", "late ready", "late handled"]
