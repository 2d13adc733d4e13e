"""The ``ray`` runtime: the model actors (Generator, Trainer) each in its own Ray actor
process on a local Ray cluster that the run starts itself (or one it joins), placed with one
placement group per role (rollout, actor, critic, service) whose bundles are the worker
groups the actors declare. The light actors (role ``service``: Publisher, Verifier, Saver;
no model) run on the driver's event loop beside the bus, as the Coordinator does, unless
``ray.own_process`` names them: those get a Ray actor process of their own.

Ray itself (``ray_cluster.py``) starts on a thread of its own as soon as the run knows what
it places (``start_cluster``, before the model is prepared), so the driver's own start-up,
the cluster's and the actor processes' imports overlap.

The bus stays in the driver. For each remote actor the driver keeps a proxy: a bus
mailbox whose events are msgpack-encoded and delivered in batches (one Ray call carries up to
``bus.max_batch`` events), and a long-poll that brings back, again in batches, what the actor
published. A remote handler that raises is reported as ``ActorFailed`` by the remote host;
an actor process that dies is reported as ``ActorFailed`` by its proxy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from miles_events.bus.actor import Actor, WorkerGroup
from miles_events.bus.clock import SYSTEM_CLOCK, Clock, wait_for
from miles_events.bus.codec import decode_batch, encode_batch
from miles_events.bus.errors import describe_error
from miles_events.bus.event_bus import BusClosed, EventBus, Mailbox
from miles_events.bus.host import ActorHost
from miles_events.runtime.base import (
    ActorStartError,
    InProcessHosts,
    Preparation,
    RunContext,
    host_context,
)
from miles_events.runtime.heap import freeze_start_up
from miles_events.runtime.leftovers import forget_processes, record_processes
from miles_events.runtime.ray_cluster import ARENAS_MARK, RayCluster
from miles_events.runtime.ray_workers import start_ray_workers
from miles_events.runtime.run_log import log_into
from miles_events.transport.base import Transport, open_transport
from schemas.config import Config, ControlConfig, restart_backoff
from schemas.events import ActorFailed, CellFailed, CellRestarted, Event
from schemas.plan import RunPlan

logger = logging.getLogger(__name__)


class RemoteActorHost:
    """Lives in the Ray actor process: hosts one actor, takes event batches in, and queues
    what the actor publishes for the driver to collect."""

    def __init__(
        self,
        actor_cls: type[Actor],
        config_json: bytes,
        plan_json: bytes,
        run_id: str,
        run_dir: str,
        transport: str,
        outbox_size: int,
        first_bundle: int = 0,
        log_level: int = logging.WARNING,
    ) -> None:
        log_into(Path(run_dir), log_level, actor_cls.name)  # the driver's level, the run's log
        if os.environ.pop(ARENAS_MARK, None):
            os.environ.pop("MALLOC_ARENA_MAX", None)  # this process has it; its children need not
        self.actor_cls = actor_cls
        self.config = msgspec.json.decode(config_json, type=Config)
        self.plan = msgspec.json.decode(plan_json, type=RunPlan)
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.transport = open_transport(transport, run_id, self.run_dir, self.config)
        self.first_bundle = first_bundle
        self.outbox = Mailbox(f"{actor_cls.name}-outbox", outbox_size, (Event,))
        self.emitted = 0
        self.host: ActorHost | None = None

    async def _publish(self, event: Event) -> None:
        self.emitted += 1
        await self.outbox.put(event)

    async def prepare(self, preparation: Preparation) -> None:
        """Make what the run needs on disk before any actor starts (before this one's own
        ``start``), in this process."""
        await preparation.run_here()

    async def start(self) -> int:
        name = self.actor_cls.name
        run = RunContext(self.run_id, self.config, self.run_dir, self.transport.name, self.plan)
        start_workers = functools.partial(
            start_ray_workers,
            config=self.config,
            transport=self.transport,
            run_id=self.run_id,
            run_dir=self.run_dir,
            group=self.actor_cls.resources(self.config),
            first_bundle=self.first_bundle,
            timeout=self.config.ray.actor_start_timeout,
            actor=name,
        )
        context = host_context(run, self.transport, name, self._publish, start_workers)
        actor = self.actor_cls(self.config, context)
        await actor.start()
        inbox = Mailbox(name, 1, tuple(actor.handlers()))
        self.host = ActorHost(actor, inbox, context.publish)
        freeze_start_up()  # the process is the actor's alone, for the rest of its life
        return os.getpid()

    async def ready(self) -> None:
        assert self.host is not None
        await self.host.actor.ready()

    async def deliver(self, payload: bytes) -> int:
        """Handle a batch of events in order; returns how many events the actor has emitted."""
        assert self.host is not None
        for event in decode_batch(payload):
            await self.host.handle(event)
        return self.emitted

    async def interrupt(self, payload: bytes) -> None:
        """A stop, delivered beside the batch being handled (the actor runs many calls at once)."""
        assert self.host is not None
        for event in decode_batch(payload):
            self.host.deliver_interrupt(event)

    async def poll(self, max_items: int) -> bytes:
        """Wait for published events; b"" once stopped and drained."""
        batch = await self.outbox.get_batch(max_items)
        return encode_batch(batch) if batch else b""

    async def stop(self) -> int:
        if self.host is not None:
            await self.host.actor.stop()
        self.outbox.close()
        return self.emitted


def actor_died(error: BaseException) -> bool:
    """Whether a call on a Ray actor failed because its process is gone (not because the
    handler raised)."""
    from ray.exceptions import RayActorError

    return isinstance(error, RayActorError)


class RemoteActorProxy:
    """Driver side of one remote actor."""

    def __init__(
        self,
        bus: EventBus,
        name: str,
        handle: Any,
        mailbox: Mailbox,
        max_batch: int,
        clock: Clock = SYSTEM_CLOCK,
        interrupts: Mailbox | None = None,
        respawn: Callable[[], Awaitable[tuple[Any, int]]] | None = None,
        control: ControlConfig | None = None,
    ) -> None:
        """``respawn``: starts the actor again (a new handle and its pid), for an actor that
        is restarted when its process dies (``Actor.restartable``), within ``control``'s
        limits."""
        self.bus = bus
        self.respawn = respawn
        self.control = control or ControlConfig()
        self.restarts = 0
        self._restarting = asyncio.Lock()
        self.interrupts = interrupts
        self.clock = clock
        self.name = name
        self.handle = handle
        self.mailbox = mailbox
        self.max_batch = max_batch
        self.in_flight = False
        self.emitted = 0
        self.collected = 0
        self.dead = False
        self._tasks = [
            asyncio.create_task(self._forward(), name=f"forward-{name}"),
            asyncio.create_task(self._collect(), name=f"collect-{name}"),
        ]
        self._interrupter: asyncio.Task[None] | None = None
        if interrupts is not None:
            self._interrupter = asyncio.create_task(self._interrupt(), name=f"interrupt-{name}")

    async def _interrupt(self) -> None:
        assert self.interrupts is not None
        while (event := await self.interrupts.get()) is not None:
            if self.dead:
                continue
            try:
                await self.handle.interrupt.remote(encode_batch([event]))
            except Exception as error:
                logger.warning("interrupting %s failed: %s", self.name, error)

    async def _forward(self) -> None:
        while batch := await self.mailbox.get_batch(self.max_batch):
            if self.dead:
                continue
            self.in_flight = True
            try:
                while not self.dead:
                    handle = self.handle
                    try:
                        self.emitted = await handle.deliver.remote(encode_batch(batch))
                        break
                    except Exception as error:
                        if not await self._restarted(error, handle, batch[0]):
                            await self._died(error, batch[0])
                    # Restarted: the batch it was handling is delivered again.
            finally:
                self.in_flight = False

    async def _collect(self) -> None:
        handle = self.handle
        while not self.dead:
            try:
                payload = await handle.poll.remote(self.max_batch)
            except Exception as error:
                if not await self._restarted(error, handle, None):
                    await self._died(error, None)
                return
            if not payload:
                return
            events = decode_batch(payload)
            self.collected += len(events)
            if self.bus.closed:
                # The run ended while this actor was still working; nothing can hear it.
                logger.warning("dropping %d events %s published after the run ended", len(events), self.name)
                continue
            for event in events:
                try:
                    await self.bus.publish(event)
                except BusClosed:
                    logger.warning("dropping events %s published after the run ended", self.name)
                    break

    async def _restarted(self, error: BaseException, handle: Any, event: Event | None) -> bool:
        """Whether the actor whose call on ``handle`` failed runs again: restarted here
        (once, whichever of the delivery and the collection saw its death first), or by
        the other already. False when it is not restartable, its restarts are spent, or its
        start fails: it is dead."""
        if self.respawn is None or self.bus.closed or not actor_died(error):
            return False
        async with self._restarting:
            if self.handle is not handle:
                return not self.dead
            if self.dead:
                return False
            control, attempt = self.control, self.restarts + 1
            reason = f"actor process died: {describe_error(error)}"
            on = f" on {type(event).__name__}" if event is not None else ""
            logger.error("actor %s is gone%s: %s", self.name, on, error)
            await self.bus.publish(
                CellFailed(cell=self.name, reason=reason, restarts=self.restarts), source="runtime"
            )
            if attempt > control.max_restarts:
                logger.error(
                    "%s: its restarts are spent (control.max_restarts = %d)", self.name, control.max_restarts
                )
                return False
            started = self.clock.monotonic()
            await self.clock.sleep(restart_backoff(attempt, control))
            try:
                self.handle, pid = await self.respawn()
            except Exception as start_error:
                logger.error("%s did not start again: %s", self.name, describe_error(start_error))
                return False
            self.restarts = attempt
            self.emitted = self.collected = 0
            self._tasks[1] = asyncio.create_task(self._collect(), name=f"collect-{self.name}")
            await self.bus.publish(
                CellRestarted(
                    cell=self.name,
                    attempt=attempt,
                    pid=pid,
                    weight_version="",
                    restart_seconds=self.clock.monotonic() - started,
                ),
                source="runtime",
            )
            return True

    async def _died(self, error: BaseException, event: Event | None) -> None:
        if self.dead:
            return
        self.dead = True
        logger.error("actor %s is gone: %s", self.name, error)
        spent = ""
        if self.respawn is not None:
            spent = f" (after {self.restarts} restarts; control.max_restarts = {self.control.max_restarts})"
        if not self.bus.closed:
            await self.bus.publish(
                ActorFailed(
                    actor=self.name,
                    error=f"actor process died: {describe_error(error)}{spent}",
                    event_type=type(event).__name__ if event else "",
                    event_seq=event.seq if event else -1,
                ),
                source="runtime",
            )

    @property
    def idle(self) -> bool:
        if self.dead:
            return True
        return not self.in_flight and self.mailbox.statistics().depth == 0 and self.collected >= self.emitted

    async def stop(self, timeout: float = 60.0) -> None:
        if self._interrupter is not None:
            self._interrupter.cancel()  # the run is over: no stop is left to deliver
        forward = self._tasks[0]
        try:
            # The mailbox is closed: forwarding ends after the last batch is handled.
            await wait_for(asyncio.shield(forward), timeout, self.clock)
        except TimeoutError:
            logger.warning("actor %s still busy %.0fs after the run ended; killing it", self.name, timeout)
            forward.cancel()
            self.dead = True
        if not self.dead:
            try:
                self.emitted = await self.handle.stop.remote()
            except Exception as error:
                logger.warning("stopping %s failed: %s", self.name, error)
        try:
            await wait_for(self._tasks[1], 30, self.clock)
        except TimeoutError:
            self._tasks[1].cancel()


def own_process(cls: type[Actor], config: Config) -> bool:
    """Whether the ray runtime gives ``cls`` a Ray actor process of its own: a model actor
    (role rollout, actor or critic) always, a light one (role ``service``) when
    ``ray.own_process`` names it, a driver actor (the Coordinator) never. The others are
    hosted on the driver's event loop."""
    role = cls.resources(config).role
    if role == "service":
        return cls.name in config.ray.own_process
    return role != "driver"


def start_cluster(config: Config, actor_classes: list[type[Actor]]) -> RayCluster:
    """Ray for a run of ``actor_classes`` under ``config``, starting now on its own thread:
    the run's placement is known as soon as its config is read, so the cluster (and the
    workers that will host its actors, importing what they will need) start while the
    driver plans the run."""
    groups = placement_bundles(actor_classes, config)
    remote = [cls for _, members in groups.values() for cls, _, _ in members]
    bundles = [b for bundles, _ in groups.values() for b in bundles]
    return RayCluster(config.ray, bundles, remote, process_modules(remote, config)).start()


def process_modules(remote: list[type[Actor]], config: Config) -> list[str]:
    """What the processes of ``remote`` import before each is given its actor."""
    return [module for cls in remote for module in cls.process_modules(config)]


def placement_bundles(
    actor_classes: list[type[Actor]], config: Config
) -> dict[str, tuple[list[dict[str, float]], list[tuple[type[Actor], WorkerGroup, int]]]]:
    """Placement group per role: its bundles, and each actor with its group and first bundle.

    A worker group of N ranks gets N bundles of its per-rank CPUs and GPUs. With
    ``ray.colocate`` the rollout and actor roles share one group, rank by rank (the seed's
    colocated mode: a bundle holds both, so its size is their sum). Only actors with a
    process of their own (``own_process``) are placed.
    """
    groups: dict[str, tuple[list[dict[str, float]], list[tuple[type[Actor], WorkerGroup, int]]]] = {}
    for cls in actor_classes:
        if not cls.wanted(config) or not own_process(cls, config):
            continue
        group = cls.resources(config)
        colocated = config.ray.colocate and group.role in ("rollout", "actor")
        role = "rollout" if colocated else group.role
        bundles, members = groups.setdefault(role, ([], []))
        first = 0 if colocated else len(bundles)
        for index in range(first, first + group.num_ranks):
            if index == len(bundles):
                bundles.append({"CPU": 0.0})
            bundles[index]["CPU"] += group.cpus_per_rank
            if group.gpus_per_rank:
                bundles[index]["GPU"] = bundles[index].get("GPU", 0.0) + group.gpus_per_rank
        members.append((cls, group, first))
    return groups


class RayRuntime:
    name = "ray"

    def __init__(self, run: RunContext, transport: Transport, cluster: RayCluster | None = None) -> None:
        """``cluster``: Ray, already starting for this run (``start_cluster``); this runtime
        owns it from here on. Without one, ``start`` starts it."""
        self.run = run
        self.proxies: list[RemoteActorProxy] = []
        self.driver = InProcessHosts(run, transport)
        self.cluster = cluster
        self._placement_groups: list[Any] = []
        self._handles: list[Any] = []
        self._pids: dict[str, int] = {}
        self._restarts: dict[str, int] = {}
        """Restarts of each restartable actor (``Actor.restartable``)."""

    def _create_placement_groups(self, groups: dict[str, Any]) -> dict[str, Any]:
        from ray.util.placement_group import placement_group

        config = self.run.config
        placed = {}
        for role, (bundles, _) in groups.items():
            group = placement_group(
                bundles, strategy=config.ray.placement_strategy, name=f"miles-{self.run.run_id}-{role}"
            )
            self._placement_groups.append(group)
            placed[role] = group
        return placed

    async def _wait_placed(self, groups: dict[str, Any], placed: dict[str, Any], timeout: float) -> None:
        try:
            await wait_for(asyncio.gather(*(g.ready() for g in placed.values())), timeout, self.run.clock)
        except TimeoutError:
            import ray

            wanted = {role: bundles for role, (bundles, _) in groups.items()}
            raise RuntimeError(
                f"ray could not place the actors' bundles {wanted} within {timeout:g}s "
                f"(cluster resources: {ray.cluster_resources()})"
            ) from None

    async def start(self, bus: EventBus, actor_classes: list[type[Actor]]) -> None:
        config = self.run.config
        groups = placement_bundles(actor_classes, config)
        remote_classes = [cls for _, members in groups.values() for cls, _, _ in members]
        bundles = [b for bundles, _ in groups.values() for b in bundles]
        if self.cluster is not None and not self.cluster.fits(bundles):
            self.cluster.shutdown()  # sized before the config was resolved, too small now
            self.cluster = None
        if self.cluster is None:
            self.cluster = RayCluster(
                config.ray, bundles, remote_classes, process_modules(remote_classes, config)
            ).start()
        # Ray starts in a thread; meanwhile the driver starts the actors it hosts.
        try:
            for cls in actor_classes:
                if cls not in remote_classes:
                    await self.driver.start(bus, cls)
                    logger.info("started %s (driver)", cls.name)
        finally:
            await asyncio.wrap_future(self.cluster.up)
        up_at = self.run.clock.monotonic()
        self._record_processes()
        placed = self._create_placement_groups(groups)
        remote = self._create_remote(groups, placed)
        timeout = config.ray.actor_start_timeout
        # The actors are created at once and load their models while the groups are
        # placed (Ray schedules each as soon as its bundle is); the wait for the placement
        # only names the bundles that could not be placed. A run's Preparation (its
        # base model) is made first, within a timeout of its own, and the starts follow.
        preparation = self.run.prepare
        asked = self._ask_preparation(remote)
        starts = [] if preparation is not None else [h.start.remote() for _, h in remote]
        deadline = self.run.clock.monotonic() + timeout
        try:
            await self._wait_placed(groups, placed, timeout)
            if preparation is not None:
                if asked is None:
                    await preparation.run_here()
                else:
                    await self._wait_prepared(*asked, preparation, timeout)
                deadline = self.run.clock.monotonic() + timeout
                starts = [h.start.remote() for _, h in remote]
            pids = await wait_for(
                asyncio.gather(*starts, return_exceptions=True),
                deadline - self.run.clock.monotonic(),
                self.run.clock,
            )
        except TimeoutError:
            raise RuntimeError(f"actors did not start within {timeout:g}s") from None
        started = self._raise_start_errors([cls for cls, _ in remote], pids)
        logger.info(
            "ray actors started %.1fs after the cluster was up",
            self.run.clock.monotonic() - up_at,
        )
        self._record_processes()  # now with the actors' worker processes
        # Every remote actor is told all have started before any event reaches it.
        readies = [h.ready.remote() for _, h in remote]
        try:
            done = await wait_for(asyncio.gather(*readies, return_exceptions=True), timeout, self.run.clock)
        except TimeoutError:
            raise RuntimeError(f"actors were not ready within {timeout:g}s") from None
        self._raise_start_errors([cls for cls, _ in remote], done)
        places = {
            cls: (group, first, placed[role])
            for role, (_, members) in groups.items()
            for cls, group, first in members
        }
        for (cls, handle), pid in zip(remote, started, strict=True):
            mailbox = bus.subscribe(cls.name, tuple(cls.handlers()))
            interrupts = (
                bus.subscribe(f"{cls.name}/interrupt", cls.interrupt_types) if cls.interruptible() else None
            )
            respawn = functools.partial(self._respawn, cls, *places[cls]) if cls.restartable else None
            self.proxies.append(
                RemoteActorProxy(
                    bus,
                    cls.name,
                    handle,
                    mailbox,
                    # One event at a time to an actor that restarts: the one it was handling
                    # when it died is the one delivered again.
                    1 if cls.restartable else config.bus.max_batch,
                    self.run.clock,
                    interrupts,
                    respawn=respawn,
                    control=config.control,
                )
            )
            self._pids[cls.name] = pid
            logger.info("started %s (ray actor, pid %d)", cls.name, pid)
        await self.driver.ready()

    def _ask_preparation(self, remote: list[tuple[type[Actor], Any]]) -> tuple[Any, str] | None:
        """The run's ``Preparation``, asked for now (Ray runs it once the actor exists), of
        the first remote actor with role ``actor`` (the trainer: it imports torch anyway),
        else of the first: the call's reference and the actor's name. None without a
        Preparation or a remote actor."""
        if self.run.prepare is None or not remote:
            return None
        roles = [cls.resources(self.run.config).role for cls, _ in remote]
        cls, handle = remote[roles.index("actor") if "actor" in roles else 0]
        return handle.prepare.remote(self.run.prepare), cls.name

    async def _wait_prepared(self, made: Any, where: str, preparation: Preparation, timeout: float) -> None:
        began = self.run.clock.monotonic()
        try:
            await wait_for(made, timeout, self.run.clock)
        except TimeoutError:
            raise RuntimeError(
                f"{preparation.what} ({where}'s process) did not finish within ray.actor_start_timeout ({timeout:g}s)"
            ) from None
        except Exception as error:
            cause = getattr(error, "cause", None)
            detail = (
                str(cause)
                if isinstance(cause, ActorStartError)
                else f"{preparation.what}: {describe_error(cause or error)}"
            )
            raise ActorStartError(f"{detail} ({where}'s process)") from None
        logger.info(
            "%s took %.1fs (%s's process)", preparation.what, self.run.clock.monotonic() - began, where
        )

    def _create_remote(self, groups: dict[str, Any], placed: dict[str, Any]) -> list[tuple[type[Actor], Any]]:
        """Each placed actor as a Ray actor, on the first bundle of its ranks (created; its
        ``start`` not yet called)."""
        remote: list[tuple[type[Actor], Any]] = []
        for role, (_, members) in groups.items():
            for cls, group, first in members:
                handle = self._create_one(cls, group, first, placed[role])
                self._handles.append(handle)
                remote.append((cls, handle))
        return remote

    def _create_one(
        self, cls: type[Actor], group: WorkerGroup, first: int, placement: Any, restart: int = 0
    ) -> Any:
        """``cls`` as a Ray actor on bundle ``first`` of ``placement`` (its ``restart``-th
        start again: a name of its own)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = self.run.config
        again = f"-{restart}" if restart else ""
        return (
            ray.remote(RemoteActorHost)
            .options(
                name=f"miles-{self.run.run_id}-{cls.name}{again}",
                num_cpus=group.cpus_per_rank,
                num_gpus=group.gpus_per_rank,
                max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement, placement_group_bundle_index=first
                ),
            )
            .remote(
                cls,
                msgspec.json.encode(config),
                msgspec.json.encode(self.run.plan),
                self.run.run_id,
                str(self.run.run_dir),
                self.run.transport,
                config.bus.mailbox_size,
                first,
                logging.getLogger().getEffectiveLevel(),
            )
        )

    async def _respawn(
        self, cls: type[Actor], group: WorkerGroup, first: int, placement: Any
    ) -> tuple[Any, int]:
        """Start ``cls`` again where it ran (its bundle is free once its process is gone):
        created, started and told every actor has started; its handle and pid."""
        self._restarts[cls.name] = restart = self._restarts.get(cls.name, 0) + 1
        handle = self._create_one(cls, group, first, placement, restart)
        self._handles.append(handle)
        timeout = self.run.config.ray.actor_start_timeout
        pid: int = await wait_for(handle.start.remote(), timeout, self.run.clock)
        await wait_for(handle.ready.remote(), timeout, self.run.clock)
        self._pids[cls.name] = pid
        self._record_processes()
        logger.info("started %s again (ray actor, pid %d)", cls.name, pid)
        return handle, pid

    def _record_processes(self) -> None:
        """So that a run after a ``kill -9`` of this driver can kill what is left of the
        cluster this run started (``miles_events.runtime.leftovers``)."""
        if self.cluster is not None and self.cluster.started_here:
            record_processes(self.run.run_dir)

    @staticmethod
    def _raise_start_errors(classes: list[type[Actor]], results: list[Any | BaseException]) -> list[Any]:
        """``results`` (one per class) when none is an exception, else ``ActorStartError``."""
        values = []
        for cls, result in zip(classes, results, strict=True):
            if isinstance(result, BaseException):
                # Ray wraps the actor's own exception; the user needs that one, and whose it was.
                cause = getattr(result, "cause", None)
                raise ActorStartError(f"{cls.name}: {describe_error(cause or result)}") from None
            values.append(result)
        return values

    def idle(self) -> bool:
        return self.driver.idle() and all(proxy.idle for proxy in self.proxies)

    def processes(self) -> list[tuple[str, int]]:
        return [(proxy.name, self._pids[proxy.name]) for proxy in self.proxies if not proxy.dead]

    async def stop(self) -> None:
        """Drain and stop every actor, those hosted here and the remote ones together (each
        ``stop()`` runs: nothing they write is lost), then tear the cluster down."""
        try:
            await asyncio.gather(self.driver.stop(), *(proxy.stop() for proxy in self.proxies))
        finally:
            if self.cluster is not None and not self.cluster.up.done():
                # Stopped while Ray was still starting (an abort): let it come up, then end it.
                await asyncio.wait([asyncio.wrap_future(self.cluster.up)])
            self.shutdown()

    def shutdown(self) -> None:
        if self.cluster is None:
            return
        try:
            if (
                self.cluster.up.done()
                and self.cluster.up.exception() is None
                and not self.cluster.started_here
            ):
                self._take_back()
        finally:
            # The run's own cluster goes whole: its actors have stopped, so nothing is asked
            # of them or of the placement groups one by one.
            self.cluster.shutdown()
            forget_processes(self.run.run_dir)

    def _take_back(self) -> None:
        """A cluster this run joined outlives it: take back only what the run made there."""
        import ray

        if not ray.is_initialized():
            return
        for handle in self._handles:
            try:
                ray.kill(handle)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group

        for group in self._placement_groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
