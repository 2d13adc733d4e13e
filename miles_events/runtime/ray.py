"""The ``ray`` runtime: each actor in its own Ray actor process on a local Ray cluster that
the run starts itself (or one it joins), placed with one placement group per role (rollout,
actor, critic, service) whose bundles are the worker groups the actors declare; the
driver's actors (the Coordinator) run beside the bus.

The bus stays in the driver. For each remote actor the driver keeps a proxy: a bus
mailbox whose events are msgpack-encoded and delivered in batches (one Ray call carries up to
``bus.max_batch`` events), and a long-poll that brings back, again in batches, what the actor
published. A remote handler that raises is reported as ``ActorFailed`` by the remote host;
an actor process that dies is reported as ``ActorFailed`` by its proxy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from pathlib import Path
from typing import Any

import msgspec

from miles_events.bus.actor import Actor, WorkerGroup
from miles_events.bus.clock import SYSTEM_CLOCK, Clock, wait_for
from miles_events.bus.codec import decode_batch, encode_batch
from miles_events.bus.errors import describe_error
from miles_events.bus.event_bus import BusClosed, EventBus, Mailbox
from miles_events.bus.host import ActorHost
from miles_events.runtime.base import ActorStartError, InProcessHosts, RunContext, host_context
from miles_events.runtime.leftovers import forget_processes, record_processes
from miles_events.transport.base import Transport, open_transport
from schemas.config import Config
from schemas.events import ActorFailed, Event, StopRequested
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
    ) -> None:
        self.actor_cls = actor_cls
        self.config = msgspec.json.decode(config_json, type=Config)
        self.plan = msgspec.json.decode(plan_json, type=RunPlan)
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.transport = open_transport(transport, run_id, self.run_dir)
        self.outbox = Mailbox(f"{actor_cls.name}-outbox", outbox_size, (Event,))
        self.emitted = 0
        self.host: ActorHost | None = None

    async def _publish(self, event: Event) -> None:
        self.emitted += 1
        await self.outbox.put(event)

    async def start(self) -> int:
        name = self.actor_cls.name
        run = RunContext(self.run_id, self.config, self.run_dir, self.transport.name, self.plan)
        context = host_context(run, self.transport, name, self._publish)
        actor = self.actor_cls(self.config, context)
        await actor.start()
        inbox = Mailbox(name, 1, tuple(actor.handlers()))
        self.host = ActorHost(actor, inbox, context.publish)
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
    ) -> None:
        self.bus = bus
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
                self.emitted = await self.handle.deliver.remote(encode_batch(batch))
            except Exception as error:
                await self._died(error, batch[0])
            finally:
                self.in_flight = False

    async def _collect(self) -> None:
        while not self.dead:
            try:
                payload = await self.handle.poll.remote(self.max_batch)
            except Exception as error:
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

    async def _died(self, error: BaseException, event: Event | None) -> None:
        if self.dead:
            return
        self.dead = True
        logger.error("actor %s is gone: %s", self.name, error)
        if not self.bus.closed:
            await self.bus.publish(
                ActorFailed(
                    actor=self.name,
                    error=f"actor process died: {describe_error(error)}",
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


def placement_bundles(
    actor_classes: list[type[Actor]], config: Config
) -> dict[str, tuple[list[dict[str, float]], list[tuple[type[Actor], WorkerGroup, int]]]]:
    """Placement group per role: its bundles, and each actor with its group and first bundle.

    A worker group of N ranks gets N bundles of its per-rank CPUs and GPUs. With
    ``ray.colocate`` the rollout and actor roles share one group, rank by rank (the seed's
    colocated mode: a bundle holds both, so its size is their sum). Driver actors are not
    placed.
    """
    groups: dict[str, tuple[list[dict[str, float]], list[tuple[type[Actor], WorkerGroup, int]]]] = {}
    for cls in actor_classes:
        group = cls.resources(config)
        if group.role == "driver":
            continue
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

    def __init__(self, run: RunContext, transport: Transport) -> None:
        self.run = run
        self.proxies: list[RemoteActorProxy] = []
        self.driver = InProcessHosts(run, transport)
        self._placement_groups: list[Any] = []
        self._pids: dict[str, int] = {}
        self._started_ray = False

    def _init_ray(self, bundles: list[dict[str, float]]) -> None:
        import ray

        ray_config = self.run.config.ray
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
        if ray_config.address is None:
            needed = math.ceil(sum(b.get("CPU", 0.0) for b in bundles))
            kwargs["num_cpus"] = ray_config.num_cpus or max(needed, os.cpu_count() or 1)
            num_gpus = math.ceil(sum(b.get("GPU", 0.0) for b in bundles))
            if num_gpus:
                kwargs["num_gpus"] = num_gpus
            kwargs["_node_ip_address"] = "127.0.0.1"
            # A cluster of this host only: every Ray server (GCS, raylet, agents, workers)
            # binds the loopback address, not every interface. Ray takes the node address
            # from the loopback only when it believes clusters are disabled; the variable
            # reaches the processes it starts, the constant this one.
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        else:
            kwargs["address"] = ray_config.address
        ray.init(**kwargs)
        self._started_ray = True

    async def _place(self, groups: dict[str, Any]) -> dict[str, Any]:
        from ray.util.placement_group import placement_group

        config = self.run.config
        placed = {}
        for role, (bundles, _) in groups.items():
            group = placement_group(bundles, strategy=config.ray.placement_strategy, name=f"miles-{self.run.run_id}-{role}")
            self._placement_groups.append(group)
            placed[role] = group
        timeout = config.ray.actor_start_timeout
        try:
            await wait_for(asyncio.gather(*(g.ready() for g in placed.values())), timeout, self.run.clock)
        except TimeoutError:
            import ray

            wanted = {role: bundles for role, (bundles, _) in groups.items()}
            raise RuntimeError(
                f"ray could not place the actors' bundles {wanted} within {timeout:g}s "
                f"(cluster resources: {ray.cluster_resources()})"
            ) from None
        return placed

    async def start(self, bus: EventBus, actor_classes: list[type[Actor]]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = self.run.config
        groups = placement_bundles(actor_classes, config)
        self._init_ray([b for bundles, _ in groups.values() for b in bundles])
        self._record_processes()
        placed = await self._place(groups)
        remote_cls = ray.remote(RemoteActorHost)
        config_json = msgspec.json.encode(config)
        plan_json = msgspec.json.encode(self.run.plan)
        remote: list[tuple[type[Actor], Any]] = []
        for role, (_, members) in groups.items():
            for cls, group, first in members:
                handle = remote_cls.options(
                    name=f"miles-{self.run.run_id}-{cls.name}",
                    num_cpus=group.cpus_per_rank,
                    num_gpus=group.gpus_per_rank,
                    max_concurrency=16,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=placed[role], placement_group_bundle_index=first
                    ),
                ).remote(
                    cls,
                    config_json,
                    plan_json,
                    self.run.run_id,
                    str(self.run.run_dir),
                    self.run.transport,
                    config.bus.mailbox_size,
                )
                remote.append((cls, handle))
        timeout = config.ray.actor_start_timeout
        # Start them all at once: model loading overlaps across processes.
        starts = [h.start.remote() for _, h in remote]
        try:
            pids = await wait_for(asyncio.gather(*starts, return_exceptions=True), timeout, self.run.clock)
        except TimeoutError:
            raise RuntimeError(f"actors did not start within {timeout:g}s") from None
        self._raise_start_errors([cls for cls, _ in remote], pids)
        self._record_processes()  # now with the actors' worker processes
        # Every remote actor is told all have started before any event reaches it.
        readies = [h.ready.remote() for _, h in remote]
        try:
            done = await wait_for(asyncio.gather(*readies, return_exceptions=True), timeout, self.run.clock)
        except TimeoutError:
            raise RuntimeError(f"actors were not ready within {timeout:g}s") from None
        self._raise_start_errors([cls for cls, _ in remote], done)
        for (cls, handle), pid in zip(remote, pids, strict=True):
            mailbox = bus.subscribe(cls.name, tuple(cls.handlers()))
            interrupts = bus.subscribe(f"{cls.name}/interrupt", (StopRequested,)) if cls.interruptible() else None
            self.proxies.append(
                RemoteActorProxy(bus, cls.name, handle, mailbox, config.bus.max_batch, self.run.clock, interrupts)
            )
            self._pids[cls.name] = pid
            logger.info("started %s (ray actor, pid %d)", cls.name, pid)
        for cls in actor_classes:
            if cls.resources(config).role == "driver":
                await self.driver.start(bus, cls)
                logger.info("started %s (driver)", cls.name)
        await self.driver.ready()

    def _record_processes(self) -> None:
        """So that a run after a ``kill -9`` of this driver can kill what is left of the
        cluster this run started (``miles_events.runtime.leftovers``)."""
        if self._started_ray:
            record_processes(self.run.run_dir)

    @staticmethod
    def _raise_start_errors(classes: list[type[Actor]], results: list[Any]) -> None:
        for cls, result in zip(classes, results, strict=True):
            if isinstance(result, BaseException):
                # Ray wraps the actor's own exception; the user needs that one, and whose it was.
                cause = getattr(result, "cause", None)
                raise ActorStartError(f"{cls.name}: {describe_error(cause or result)}") from None

    def idle(self) -> bool:
        return self.driver.idle() and all(proxy.idle for proxy in self.proxies)

    def processes(self) -> list[tuple[str, int]]:
        return [(proxy.name, self._pids[proxy.name]) for proxy in self.proxies if not proxy.dead]

    async def stop(self) -> None:
        try:
            await self.driver.stop()
            for proxy in self.proxies:
                await proxy.stop()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for proxy in self.proxies:
            try:
                ray.kill(proxy.handle)
            except Exception:
                pass
        from ray.util.placement_group import remove_placement_group

        for group in self._placement_groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()
            forget_processes(self.run.run_dir)
