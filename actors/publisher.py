"""The Publisher: runs the publication saga and enforces the seed's version semantics.

    PublishRequested -> (Trainer) WeightsStaged -> (each engine) WeightsLoaded
                     -> WeightsPublished(version)      or PublicationFailed(phase)

Versions: engines bootstrapped from a checkpoint serve ``"default"``; the first publication
of a run makes every engine the trainer's next version (``"1"`` on a fresh run, the saved
version plus one on a resumed run); each later publication adds exactly one. Every phase has
a timeout, so an engine or trainer that hangs turns into ``PublicationFailed``, never a
stuck run.

The Publisher alone follows which version each engine serves (``served``); the others read
it from its ``WeightsPublished``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.rl.versions import engine_names, next_version
from schemas.config import Config, engines_heal, engines_isolated, staleness_bound
from schemas.events import (
    CellResumed,
    CellSuspended,
    DataReleased,
    PublicationFailed,
    PublicationPhase,
    PublishRequested,
    RunStarted,
    WeightsLoaded,
    WeightsLoadStarted,
    WeightsPublished,
    WeightsStaged,
)


@dataclass
class Publication:
    rollout_id: int | None
    requested_at: float
    phase: PublicationPhase = "stage"
    staged: WeightsStaged | None = None
    staged_at: float = 0.0
    loaded: dict[str, WeightsLoaded] = field(default_factory=dict)
    timer: asyncio.Task[None] | None = None


class Publisher(Actor):
    name = "publisher"

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self.engines = engine_names(config)
        self.served: dict[str, str] = dict.fromkeys(self.engines, "default")
        """The version each engine serves, as of the last publication every engine loaded."""
        self.first_version = "1"
        self.current: Publication | None = None
        self.suspended: set[str] = set()
        """Engines whose cell is suspended: a publication goes on without them."""
        self._asynchronous = staleness_bound(config) > 0
        """Asynchronous training: the engines may load a publication after a rollout."""
        self.keep_served = engines_heal(config)
        """Whether the staged weights of the last publication are kept until the next one
        is through: an engine restarted meanwhile loads them again."""
        self.served_weights: WeightsStaged | None = None

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        return WorkerGroup(role="service", cpus_per_rank=0.1)

    @classmethod
    def data_plane(cls, config: Config) -> str:
        """The transport the run's data travels through (``publisher.transport``), with
        ``auto`` resolved for the runtime: in-process on the local runtime, shared memory on
        ray. The publication's data plane is the Publisher's choice; the session opens it."""
        transport = config.publisher.transport
        if transport == "auto":
            # Engines in processes of their own (healing ones) read through shared memory.
            in_one_process = config.run.runtime == "local" and not engines_isolated(config)
            return "inprocess" if in_one_process else "shm"
        return transport

    @handles(RunStarted, emits=())
    async def on_run_started(self, event: RunStarted) -> None:
        self.first_version = next_version(event.weight_version)

    @handles(PublishRequested, emits=())
    async def on_publish_requested(self, event: PublishRequested) -> None:
        self._cancel_timer()
        self.current = Publication(rollout_id=event.rollout_id, requested_at=self.context.clock.monotonic())
        self._arm("stage", self.config.publisher.stage_timeout)

    @handles(WeightsStaged, emits=(PublicationFailed,))
    async def on_weights_staged(self, event: WeightsStaged) -> None:
        publication = self.current
        if publication is None or publication.staged is not None:
            # Staged without a request (another driver asked the trainer): still a saga.
            publication = self.current = Publication(
                rollout_id=event.rollout_id, requested_at=self.context.clock.monotonic()
            )
        publication.staged = event
        publication.staged_at = self.context.clock.monotonic()
        if self._asynchronous:
            # The Generator may load it only after the rollout it generates: the load's
            # clock starts when it begins (``WeightsLoadStarted``).
            self._cancel_timer()
            publication.phase = "load"
        else:
            self._arm("load", self.config.publisher.load_timeout)
        wrong = {
            e: v
            for e, v in self.served.items()
            if e not in self.suspended and self._expected_version(v) != event.weight_version
        }
        if wrong:
            await self._fail(
                "version",
                f"trainer staged version {event.weight_version!r}, which does not follow what the "
                f"engines serve ({wrong!r}): each publication must add exactly one",
            )

    @handles(WeightsLoadStarted, emits=(PublicationFailed,))
    async def on_weights_load_started(self, event: WeightsLoadStarted) -> None:
        publication = self.current
        if publication is not None and publication.staged is not None:
            if publication.staged.weight_version == event.weight_version and publication.phase == "load":
                self._arm("load", self.config.publisher.load_timeout)

    def _expected_version(self, served: str) -> str:
        return self.first_version if served == "default" else next_version(served)

    @handles(CellSuspended, emits=(DataReleased, WeightsPublished, PublicationFailed))
    async def on_cell_suspended(self, event: CellSuspended) -> None:
        engine = self._engine_of(event.cell)
        if engine is None:
            return
        self.suspended.add(engine)
        publication = self.current
        if publication is not None and publication.staged is not None and self._all_loaded(publication):
            await self._complete(publication)

    @handles(CellResumed, emits=())
    async def on_cell_resumed(self, event: CellResumed) -> None:
        engine = self._engine_of(event.cell)
        if engine is not None:
            self.suspended.discard(engine)
            self.served[engine] = event.weight_version

    def _engine_of(self, cell: str) -> str | None:
        prefix, _, index = cell.partition("-")
        if prefix != "rollout" or not index.isdigit() or int(index) >= len(self.engines):
            return None
        return self.engines[int(index)]

    def _all_loaded(self, publication: Publication) -> bool:
        return bool(publication.loaded) and set(publication.loaded) >= set(self.engines) - self.suspended

    @handles(WeightsLoaded, emits=(DataReleased, WeightsPublished, PublicationFailed))
    async def on_weights_loaded(self, event: WeightsLoaded) -> None:
        publication = self.current
        if event.restore:
            return  # a restarted engine serving the last publication again, not a saga
        if publication is None or publication.staged is None:
            return
        if event.weight_version != publication.staged.weight_version:
            return
        if event.previous_version != self.served.get(event.engine):
            await self._fail(
                "version",
                f"{event.engine} reports it served {event.previous_version!r} before loading, "
                f"but it last loaded {self.served.get(event.engine)!r}",
            )
            return
        publication.loaded[event.engine] = event
        if self._all_loaded(publication):
            await self._complete(publication)

    async def _complete(self, publication: Publication) -> None:
        self._cancel_timer()
        staged = publication.staged
        assert staged is not None
        engines = [e for e in self.engines if e in publication.loaded]
        previous = [self.served[e] for e in engines]
        for engine in engines:
            self.served[engine] = staged.weight_version
        now = self.context.clock.monotonic()
        self.current = None
        released = self.served_weights if self.keep_served else staged
        self.served_weights = staged
        if released is not None:
            await self.publish(DataReleased(ref=released.weights))
        await self.publish(
            WeightsPublished(
                weight_version=staged.weight_version,
                engines=engines,
                previous_versions=previous,
                rollout_id=publication.rollout_id,
                stage_seconds=publication.staged_at - publication.requested_at,
                load_seconds=now - publication.staged_at,
                publish_seconds=now - publication.requested_at,
            )
        )

    # -- timeouts -----------------------------------------------------------------------

    def _arm(self, phase: PublicationPhase, timeout: float) -> None:
        self._cancel_timer()
        publication = self.current
        assert publication is not None
        publication.phase = phase
        publication.timer = self.spawn(self._expire(publication, phase, timeout), emits=(PublicationFailed,))

    def _cancel_timer(self) -> None:
        if self.current is not None and self.current.timer is not None:
            self.current.timer.cancel()
            self.current.timer = None

    async def _expire(self, publication: Publication, phase: PublicationPhase, timeout: float) -> None:
        await self.context.clock.sleep(timeout)
        if self.current is publication and publication.phase == phase:
            publication.timer = None
            missing = sorted(set(self.engines) - set(publication.loaded))
            detail = (
                "the trainer did not stage weights"
                if phase == "stage"
                else f"no WeightsLoaded from {missing}"
            )
            await self._fail(phase, f"timed out after {timeout:g}s: {detail}")

    async def _fail(self, phase: PublicationPhase, reason: str) -> None:
        publication = self.current
        self._cancel_timer()
        self.current = None
        version = publication.staged.weight_version if publication and publication.staged else ""
        await self.publish(
            PublicationFailed(
                weight_version=version,
                phase=phase,
                reason=reason,
                rollout_id=publication.rollout_id if publication else None,
            )
        )

    async def stop(self) -> None:
        self._cancel_timer()
