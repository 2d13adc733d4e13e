"""The context an actor is tested and re-driven with (``miles_events.bus.testing``) is an
``ActorContext`` like the runtime's: every member of the protocol, the same signatures."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from miles_events.bus.actor import ActorContext
from miles_events.bus.workers import RankPlace
from miles_events.transport.base import Transport
from schemas.config import Config


def protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(ActorContext).items()
        if callable(member) and not name.startswith("_")
    }


def test_a_recording_context_has_every_attribute_of_an_actor_context():
    from miles_events.bus.testing import RecordingContext

    context = RecordingContext(Config())
    missing = [name for name in ActorContext.__annotations__ if not hasattr(context, name)]
    assert not missing, f"RecordingContext lacks {missing}"


def test_a_recording_context_has_every_method_of_an_actor_context_with_its_signature():
    from miles_events.bus.testing import RecordingContext

    assert set(protocol_methods()) == {"publish", "report_failure", "start_workers"}
    for name, signature in protocol_methods().items():
        method = getattr(RecordingContext, name, None)
        assert method is not None, f"RecordingContext lacks {name}"
        assert inspect.iscoroutinefunction(method), name
        assert list(inspect.signature(method).parameters) == list(signature.parameters), name


class Rank:
    def __init__(self, config: Config, transport: Transport, place: RankPlace) -> None:
        self.place = place

    def where(self) -> tuple[int, int, int]:
        return self.place.rank, self.place.ranks_sharing_cores, os.getpid()


def build_rank(config: Config, transport: Transport, place: RankPlace) -> Rank:
    return Rank(config, transport, place)


async def test_a_recording_context_starts_the_worker_ranks_in_this_process(tmp_path: Path):
    from miles_events.bus.testing import RecordingContext

    context = RecordingContext(Config(), run_dir=tmp_path)
    workers = await context.start_workers(build_rank, 2)
    try:
        assert [w.rank for w in workers] == [0, 1]
        assert [await w.call(Rank.where) for w in workers] == [(0, 2, os.getpid()), (1, 2, os.getpid())]
    finally:
        for worker in workers:
            await worker.close()
