"""One run from start to finish: take the run directory, resolve the config and plan the
run, start the bus, the sinks and the actors on the chosen runtime, wait for
``RunFinished``, then let the run settle, drain and stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from actors.coordinator import Coordinator
from actors.publisher import Publisher
from miles_events.app.config import dump_config
from miles_events.app.plan import base_model_preparation, set_aside_all
from miles_events.app.pyspy import PeriodicPySpyDump
from miles_events.app.run_dir import new_run_id, open_event_log, run_config_path
from miles_events.app.signals import StopOnSignal
from miles_events.app.start_checks import check_start
from miles_events.bus.actor import Actor
from miles_events.bus.clock import SYSTEM_CLOCK, Clock
from miles_events.bus.errors import describe_error
from miles_events.bus.event_bus import EventBus, Mailbox
from miles_events.runtime.base import ActorStartError, RunContext, Runtime
from miles_events.runtime.heap import freeze_start_up, thaw
from miles_events.runtime.leftovers import claim, clean_dead_run, remove_dead_owners
from miles_events.runtime.local import LocalRuntime
from miles_events.runtime.ray_cluster import RayCluster
from miles_events.sinks.base import Sink, SinkContext, SinkHost
from miles_events.sinks.event_log import EventLogSink
from miles_events.transport.base import FilesTransport, Transport, open_transport
from miles_events.transport.shm import SHM_PREFIX, ShmFiles, shm_root
from schemas.config import Config
from schemas.events import ActorFailed, RunFinished

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    finished: RunFinished
    run_dir: Path
    seconds: float


SHARED_MEMORY_TRANSPORTS = frozenset({"shm", "cuda_ipc", "collective"})
"""The transports whose files live in shared memory (CUDA IPC keeps all but GPU buckets there)."""


def make_runtime(context: RunContext, transport: Transport, cluster: RayCluster | None = None) -> Runtime:
    if context.config.run.runtime == "local":
        return LocalRuntime(context, transport)
    from miles_events.runtime.ray import RayRuntime

    return RayRuntime(context, transport, cluster)


def start_cluster(config: Config, actor_classes: list[type[Actor]]) -> RayCluster | None:
    """For the ray runtime, Ray starting now, beside the driver's planning of the run."""
    if config.run.runtime != "ray":
        return None
    from miles_events.runtime.ray import start_cluster

    return start_cluster(config, actor_classes)


class Session:
    def __init__(
        self,
        config: Config,
        actor_classes: list[type[Actor]],
        run_id: str | None = None,
        sinks: list[Sink] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``actor_classes`` must include the Coordinator (the loop); ``sinks`` observe the
        run beside the event log: each is prepared among the start-up checks, started
        before any actor, in order, and closed at the end. Every start-up check
        (``check_start``) passes before the run directory is touched: one that fails raises
        with nothing written."""
        if Coordinator not in actor_classes:
            raise ValueError("a run needs the Coordinator among its actors: nothing else runs the loop")
        actor_classes = [cls for cls in actor_classes if cls.wanted(config)]
        self.run_id = run_id or new_run_id()
        checked = check_start(config, sinks or [], self.run_id)
        self.config = checked.config
        self.plan = checked.planned.plan
        self.pyspy_interval = checked.pyspy_interval
        self.run_dir = Path(self.config.run.dir)
        self.cluster: RayCluster | None = None
        try:
            self.log_writer = open_event_log(self.run_dir)
        except BaseException:
            checked.release()
            raise
        try:
            # The directory is this run's now: kill what a run whose driver died left running,
            # then move aside what the plan replaces.
            clean_dead_run(self.run_dir)
            set_aside_all(checked.planned.moves)
            self.cluster = start_cluster(self.config, actor_classes)
            self.preparation = base_model_preparation(config)
        except BaseException:
            checked.release()
            self._give_back()
            raise
        self.actor_classes = actor_classes
        self.sinks = [EventLogSink(self.log_writer), *checked.sinks]
        self.clock = clock
        self.bus: EventBus | None = None

    async def run(self) -> RunResult:
        started = time.monotonic()
        config = self.config
        plan = self.plan
        try:
            # The resolved config of every run beside the log, so the log can be re-driven.
            config_path = run_config_path(self.run_dir, self.run_id)
            config_path.parent.mkdir(parents=True, exist_ok=True)
            config_path.write_text(dump_config(config))
            transport_name = Publisher.data_plane(config)
            if transport_name in SHARED_MEMORY_TRANSPORTS:
                remove_dead_owners(shm_root(), SHM_PREFIX)  # what runs whose driver died left
            transport = open_transport(transport_name, self.run_id, self.run_dir, config)
            if isinstance(transport, FilesTransport) and isinstance(transport.files, ShmFiles):
                claim(transport.root)  # this run's directory in shared memory is this driver's
        except BaseException:
            # No actor has started: give the run directory, the sinks' holds and Ray back.
            for sink in self.sinks:
                sink.release()
            self._give_back()
            raise
        bus = self.bus = EventBus(
            self.run_id, config.bus.mailbox_size, config.bus.stall_warning_seconds, self.clock
        )
        watch = bus.subscribe("session", (RunFinished, ActorFailed))
        context = RunContext(
            self.run_id, config, self.run_dir, transport_name, plan, self.clock, self.preparation
        )
        runtime = make_runtime(context, transport, self.cluster)
        self.cluster = None  # the runtime's now
        hosts: list[SinkHost] = []
        opened: list[Sink] = []
        signals: StopOnSignal | None = None
        dumps: asyncio.Task[None] | None = None
        frozen = False
        try:
            await self._start_sinks(bus, opened, hosts)
            try:
                await runtime.start(bus, self.actor_classes)
            except Exception as error:
                logger.debug("startup failed", exc_info=True)
                detail = str(error) if isinstance(error, ActorStartError) else describe_error(error)
                finished = await self._fail(f"an actor failed to start: {detail}")
            else:
                freeze_start_up()
                frozen = True
                signals = StopOnSignal(bus)
                dumps = self._start_pyspy(runtime)
                finished = await self._wait_finished(watch)
                await self._wait_quiet(runtime)
        finally:
            if dumps is not None:
                dumps.cancel()
            if signals is not None:
                signals.remove()
            bus.close()
            await self._shutdown(runtime, hosts, opened, transport)
            if frozen:
                thaw()
        return RunResult(self.run_id, finished, self.run_dir, time.monotonic() - started)

    def _give_back(self) -> None:
        self.log_writer.close()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None

    async def _start_sinks(self, bus: EventBus, opened: list[Sink], hosts: list[SinkHost]) -> None:
        """Start each sink in order (the event log first). One that cannot start ends the
        run before any actor starts: the log records why, every sink opened so far (the
        failing one too) is closed, and its error goes to the caller."""
        context = SinkContext(self.run_id, self.run_dir, self.config, bus, self._sink_failed)
        for sink in self.sinks:
            opened.append(sink)
            try:
                await sink.start(context)
            except Exception as error:
                await self._fail(f"sink {sink.name} failed to start: {describe_error(error)}")
                raise
            if sink.handlers():  # a sink that only starts and closes needs no mailbox
                hosts.append(SinkHost(sink, bus, self.config.bus.max_batch))

    def _start_pyspy(self, runtime: Runtime) -> asyncio.Task[None] | None:
        """``MILES_DEBUG_PYSPY_DUMP_INTERVAL``: periodic stack dumps of every process."""
        if self.pyspy_interval is None:
            return None
        dumper = PeriodicPySpyDump(
            self.pyspy_interval,
            lambda: [("driver", os.getpid()), *runtime.processes()],
            self.run_dir / "pyspy",
            self.clock,
        )
        return asyncio.get_running_loop().create_task(dumper.run(), name="pyspy")

    async def _sink_failed(self, reason: str) -> None:
        # A sink can fail while its last batch is flushed at shutdown: nobody hears it then.
        if self.bus is not None and not self.bus.closed:
            await self._fail(reason)
        else:
            logger.error("after the run ended: %s", reason)

    async def _fail(self, reason: str) -> RunFinished:
        """The session ends the run as failed (a start-up failure, a dead event log, a broken
        loop): the stamped ``RunFinished``."""
        assert self.bus is not None and not self.bus.closed
        return await self.bus.publish(RunFinished(status="failed", reason=reason), source="session")  # type: ignore[return-value]

    @staticmethod
    async def _shutdown(
        runtime: Runtime, hosts: list[SinkHost], sinks: list[Sink], transport: Transport
    ) -> None:
        """Each step runs even when an earlier one fails: the actors stopped, every sink
        drained and closed (the event log first) and the run's shared memory removed."""
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("stopping the actors", runtime.stop),
            *((f"draining {host.sink.name}", host.join) for host in hosts),
            *((f"closing {sink.name}", sink.close) for sink in sinks),
        ]
        try:
            for what, step in steps:
                try:
                    await step()
                except Exception as error:
                    logger.warning("%s failed: %s", what, describe_error(error))
        finally:
            transport.close()

    async def _wait_finished(self, watch: Mailbox) -> RunFinished:
        while (event := await watch.get()) is not None:
            if isinstance(event, RunFinished):
                return event
            if isinstance(event, ActorFailed) and event.actor == Coordinator.name:
                # The loop itself broke: nobody else will say the run is over.
                return await self._fail(f"coordinator failed: {event.error}")
        raise RuntimeError("bus closed before the run finished")

    async def _wait_quiet(self, runtime: Runtime, timeout: float = 60.0) -> None:
        """Let in-flight work settle (frees, last saves) before closing the bus: every
        actor idle with an empty mailbox, three checks in a row."""
        deadline = self.clock.monotonic() + timeout
        quiet_checks = 0
        while self.clock.monotonic() < deadline:
            quiet_checks = quiet_checks + 1 if runtime.idle() else 0
            if quiet_checks >= 3:
                return
            await self.clock.sleep(0.02)
        logger.warning("run did not go quiet within %.0fs; stopping anyway", timeout)
