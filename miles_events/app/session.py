"""One run from start to finish: plan it, start the bus, the event log, the actors (on the
chosen runtime) and the Coordinator, wait for ``RunFinished``, then drain and stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from actors.coordinator import Coordinator, RunPlan
from miles_events.app.config import config_digest, dump_config
from miles_events.bus.actor import Actor
from miles_events.bus.event_bus import EventBus, Mailbox
from miles_events.bus.event_log import EventLogWriter
from miles_events.bus.host import ActorHost, describe_error
from miles_events.rl.checkpoint import latest_checkpoint, verify_checkpoint
from miles_events.rl.hf_model import prepare_base_model
from miles_events.rl.prompts import load_prompts, num_rollout_per_epoch
from miles_events.rl.versions import engine_names
from miles_events.runtime.base import ActorStartError, RunContext, Runtime
from miles_events.runtime.local import LocalRuntime, host_context, start_local_host
from miles_events.transport.base import Transport, open_transport
from schemas.checkpoint import TrainerState
from schemas.config import Config
from schemas.events import ActorFailed, Event, RunFinished, StopRequested

logger = logging.getLogger(__name__)

EVENT_LOG = "events.log"


@dataclass(frozen=True)
class RunResult:
    run_id: str
    finished: RunFinished
    run_dir: Path
    seconds: float


def run_config_path(run_dir: Path, run_id: str) -> Path:
    return run_dir / "configs" / f"{run_id}.toml"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


class RunDirError(ValueError):
    """The run directory cannot be used; one line says why."""


def open_event_log(run_dir: Path) -> EventLogWriter:
    """Create the run directory and take its event log: first, so that a directory that
    cannot be used, or is in use by another run, fails before anything is written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        writer = EventLogWriter(run_dir / EVENT_LOG, repair=True)
    except OSError as error:
        raise RunDirError(f"run.dir {run_dir}: {error.strerror or error}") from None
    except RuntimeError as error:  # the log's lock is held
        raise RunDirError(f"run.dir {run_dir} is in use by another run ({error})") from None
    except ValueError as error:  # not an event log
        raise RunDirError(f"run.dir {run_dir}: {error}") from None
    if writer.torn_copy is not None:
        logger.warning("%s ended in a torn record (a crash?); its bytes are kept in %s", writer.path, writer.torn_copy)
    return writer


def prepare(config: Config) -> Config:
    """Build the model every actor loads (once per run directory); return the resolved config."""
    run_dir = Path(config.run.dir).resolve()
    model_path = prepare_base_model(config.model, run_dir, config.run.seed)
    model = msgspec.structs.replace(config.model, path=str(Path(model_path).resolve()))
    run = msgspec.structs.replace(config.run, dir=str(run_dir))
    return msgspec.structs.replace(config, model=model, run=run)


def make_plan(config: Config, runtime: str) -> RunPlan:
    """The loop's bounds, and where a resumed run picks up."""
    data = config.data
    num_prompts = len(load_prompts(data.prompt_data, data.input_key, data.label_key)) if data.prompt_data else 0
    per_epoch = num_rollout_per_epoch(num_prompts, data.rollout_batch_size) if num_prompts else 1
    num_rollout = config.run.num_rollout if config.run.num_rollout is not None else per_epoch * config.run.num_epoch
    start, weight_version, resumed = 0, "default", False
    if config.run.resume:
        checkpoint = latest_checkpoint(Path(config.run.dir))
        if checkpoint is None:
            logger.info("run.resume: no complete checkpoint under %s; starting fresh", config.run.dir)
        else:
            verify_checkpoint(checkpoint)
            state = msgspec.json.decode((checkpoint / "trainer_state.json").read_bytes(), type=TrainerState)
            start, weight_version, resumed = state.rollout_id + 1, state.weight_version, True
            logger.info("resuming from %s: rollout %d, weight version %s", checkpoint, start, weight_version)
    if config.run.start_rollout_id is not None:
        start = config.run.start_rollout_id
    return RunPlan(
        start_rollout_id=start,
        num_rollout=num_rollout,
        num_rollout_per_epoch=per_epoch,
        resumed=resumed,
        weight_version=weight_version,
        engines=tuple(engine_names(config)),
        runtime=runtime,
        config_digest=config_digest(config),
    )


async def close_sink(sink: object) -> None:
    task = getattr(sink, "task", None)
    if task is not None:
        await task
    aclose = getattr(sink, "aclose", None)
    if aclose is not None:
        await aclose()
        return
    close = getattr(sink, "close", None)
    if close is not None:
        close()


class EventLogSubscriber:
    """Appends every event to ``<run dir>/events.log`` as it is published.

    If the log cannot be written (disk full, say) the run fails with that reason, and the
    mailbox keeps draining so that the bus never backs up behind a dead writer.
    """

    def __init__(self, bus: EventBus, writer: EventLogWriter, max_batch: int) -> None:
        self.bus = bus
        self.writer = writer
        self.mailbox = bus.subscribe("event-log", (Event,), max_size=max(bus.mailbox_size, 4 * max_batch))
        self.max_batch = max_batch
        self.error: BaseException | None = None
        self._failing: asyncio.Task[None] | None = None
        self.task = asyncio.create_task(self._write(), name="event-log")

    async def _write(self) -> None:
        try:
            while batch := await self.mailbox.get_batch(self.max_batch):
                if self.error is not None:
                    continue
                try:
                    self.writer.append_many(batch)
                except Exception as error:
                    self.error = error
                    logger.error("cannot write the event log: %s", describe_error(error))
                    reason = f"cannot write the event log {self.writer.path}: {describe_error(error)}"
                    self._failing = asyncio.get_running_loop().create_task(self._fail(reason))
        finally:
            self.writer.close()

    async def _fail(self, reason: str) -> None:
        if not self.bus.closed:
            await self.bus.publish(RunFinished(status="failed", reason=reason), source="session")


class Session:
    def __init__(
        self,
        config: Config,
        actor_classes: list[type[Actor]],
        run_id: str | None = None,
        on_bus: list[Callable[[EventBus, Session], object]] | None = None,
    ) -> None:
        """``on_bus``: hooks called as ``hook(bus, session)`` before any actor starts, to
        subscribe sinks (console, metrics, tracking). At the end, after the bus is closed,
        a sink's ``task`` is awaited (its mailbox drains), then its ``aclose()`` awaited or
        its ``close()`` called."""
        self.on_bus = on_bus or []
        self.log_writer = open_event_log(Path(config.run.dir).resolve())
        try:
            self.config = prepare(config)
        except BaseException:
            self.log_writer.close()
            raise
        self.actor_classes = actor_classes
        self.run_id = run_id or new_run_id()
        self.run_dir = Path(self.config.run.dir)
        self.runtime_name = self.config.run.runtime
        transport = self.config.publisher.transport
        if transport == "auto":
            transport = "inprocess" if self.runtime_name == "local" else "shm"
        self.transport_name = transport
        self.bus: EventBus | None = None
        self.coordinator: Coordinator | None = None
        self._stop_task: asyncio.Task[Event] | None = None

    async def run(self) -> RunResult:
        started = time.monotonic()
        config = self.config
        plan = make_plan(config, self.runtime_name)
        # The resolved config of every run beside the log, so the log can be re-driven.
        config_path = run_config_path(self.run_dir, self.run_id)
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(dump_config(config))
        bus = self.bus = EventBus(self.run_id, config.bus.mailbox_size, config.bus.stall_warning_seconds)
        log = EventLogSubscriber(bus, self.log_writer, config.bus.max_batch)
        watch = bus.subscribe("session", (RunFinished, ActorFailed))
        transport = open_transport(self.transport_name, self.run_id, self.run_dir)
        context = RunContext(self.run_id, config, self.run_dir, self.transport_name)
        runtime: Runtime
        if self.runtime_name == "local":
            runtime = LocalRuntime(context, transport)
        else:
            from miles_events.runtime.ray import RayRuntime

            runtime = RayRuntime(context)
        sinks: list[object] = []
        try:
            for hook in self.on_bus:
                sinks.append(hook(bus, self))
            try:
                await runtime.start(bus, self.actor_classes)
            except Exception as error:
                logger.debug("startup failed", exc_info=True)
                detail = str(error) if isinstance(error, ActorStartError) else describe_error(error)
                failed = RunFinished(status="failed", reason=f"an actor failed to start: {detail}")
                finished = await bus.publish(failed, source="session")  # type: ignore[assignment]
            else:
                coordinator = self.coordinator = Coordinator(
                    config, host_context(context, transport, bus, Coordinator.name), plan
                )
                coordinator_host = await start_local_host(bus, coordinator, Coordinator.name)
                self._install_signal_handlers(bus)
                await coordinator.begin()
                finished = await self._wait_finished(watch)
                await self._wait_quiet(runtime, coordinator_host)
        finally:
            bus.close()
            await self._shutdown(runtime, log, sinks, transport)
        return RunResult(self.run_id, finished, self.run_dir, time.monotonic() - started)

    @staticmethod
    async def _shutdown(runtime: Runtime, log: EventLogSubscriber, sinks: list[object], transport: Transport) -> None:
        """Each step runs even when an earlier one fails: the event log is completed,
        every sink closed and the run's shared memory removed."""
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("stopping the actors", runtime.stop),
            ("completing the event log", lambda: log.task),
            *((f"closing {type(sink).__name__}", lambda sink=sink: close_sink(sink)) for sink in sinks),
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
                finished = RunFinished(status="failed", reason=f"coordinator failed: {event.error}")
                assert self.bus is not None
                return await self.bus.publish(finished, source="session")  # type: ignore[return-value]
        raise RuntimeError("bus closed before the run finished")

    @staticmethod
    async def _wait_quiet(runtime: Runtime, coordinator: ActorHost, timeout: float = 60.0) -> None:
        """Let in-flight work settle (frees, last saves) before closing the bus: every
        actor idle with an empty mailbox, three checks in a row."""
        deadline = time.monotonic() + timeout
        quiet_checks = 0
        while time.monotonic() < deadline:
            quiet = runtime.idle() and coordinator.idle
            quiet_checks = quiet_checks + 1 if quiet else 0
            if quiet_checks >= 3:
                return
            await asyncio.sleep(0.02)
        logger.warning("run did not go quiet within %.0fs; stopping anyway", timeout)

    def _install_signal_handlers(self, bus: EventBus) -> None:
        loop = asyncio.get_running_loop()
        interrupted = False

        def on_signal() -> None:
            nonlocal interrupted
            if interrupted:
                raise KeyboardInterrupt
            interrupted = True
            logger.warning("interrupted: stopping after the current step (again to abort)")
            self._stop_task = loop.create_task(bus.publish(StopRequested(reason="interrupted by signal"), source="session"))

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):
                pass
