"""A worker-group rank in a spawned process of its own (``miles_events.bus.workers``): how
the local runtime, and an actor hosted in the driver, give each rank but 0 a process when
the actor asks for ``own_processes`` (a rank of a torch.distributed group is a process).

The process is started with multiprocessing's ``spawn`` (a fresh interpreter: nothing of
the actor's threads, locks or CUDA state is inherited) and talks to the actor over one
``multiprocessing`` pipe, whose messages are pickled tuples. It builds the rank's object
with ``factory(config, transport, place)``, logs into the run's log as
``<actor> rank <r>``, and runs each call on a small pool of threads, so that a notification
(a cancellation) runs while a long call of the same rank is in progress.

Nothing waits for a rank forever and no rank outlives its actor: a thread of the actor's
process watches each rank's pipe and process, and when the process ends every pending and
later call raises ``RankDied``, naming the rank, its pid and how it ended. ``close`` asks
the rank to close, then terminates, then kills it, each within a bound. The rank process
dies with its parent, even one killed by SIGKILL: the kernel's parent-death signal
(``prctl(PR_SET_PDEATHSIG)``, Linux) and a thread that watches the parent's pid. The
parent-death signal follows the thread that started the process: ranks are started from
the event loop's thread, which lives as long as the actor's process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Concatenate, Generic, NoReturn, ParamSpec, TypeVar

import msgspec

from miles_events.bus.clock import SYSTEM_CLOCK, wait_for
from miles_events.bus.errors import describe_error
from miles_events.bus.workers import RankDied, RankPlace, WorkerFactory, brief_error, method_name
from miles_events.transport.base import open_transport
from miles_events.util.exit_status import exit_status
from schemas.config import Config

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

RANK_CONCURRENCY = 4
"""Calls one rank process runs at once (a long call, and the notifications beside it)."""
START_TIMEOUT = 120.0
"""Seconds a rank process may take to build its object."""
CLOSE_TIMEOUT = 60.0
"""Seconds a rank's ``close`` may take before its process is terminated."""
STOP_GRACE = 5.0
"""Seconds a rank process is given to end after it closed, and again after SIGTERM."""
PARENT_POLL = 0.5
"""Seconds between two looks of a rank process at its parent's pid."""

LogInto = Callable[[Path, int, str], object]
"""``log_into(run_dir, level, tag)``: makes a rank process log into the run's log."""

_START = 0
"""The id of the start's reply: the rank's pid, or its build's failure."""
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankStart:
    """What a rank process needs to build its object (sent over the pipe once it runs)."""

    factory: WorkerFactory[Any]
    config_json: bytes
    run_id: str
    run_dir: str
    transport: str
    place: RankPlace
    actor: str
    log_level: int
    log_into: LogInto | None


class RankTraceback(Exception):
    """The traceback of an exception raised in a rank process, as its ``__cause__``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Failure:
    """An exception raised in a rank process: the exception itself (or, one that does not
    pickle, its description), and its traceback as the rank saw it."""

    error: BaseException
    traceback: str


def _failure(error: BaseException) -> Failure:
    sent: BaseException = RuntimeError(describe_error(error))
    if isinstance(error, Exception):  # not an exit or an interrupt, which are the rank's
        try:
            pickle.loads(pickle.dumps(error))
            sent = error
        except Exception:  # an exception that does not cross a process: its description does
            pass
    return Failure(sent, "".join(traceback.format_exception(error)))


def _raised(failure: Failure) -> BaseException:
    """The rank's exception, with its traceback in the rank as its cause."""
    error = failure.error
    error.__cause__ = RankTraceback(failure.traceback)
    return error


class ProcessWorker(Generic[T]):
    """The actor's side of a rank in a spawned process: a call sends the method's name and
    its arguments, pickled; the reply carries the result or the exception."""

    def __init__(
        self, actor: str, place: RankPlace, process: BaseProcess, conn: Connection, close_timeout: float
    ) -> None:
        self.rank = place.rank
        assert process.pid is not None, "the process is started"
        self.pid: int = process.pid
        self.name = f"{actor} rank {place.rank}".lstrip()
        self.close_timeout = close_timeout
        self._process = process
        self._conn = conn
        self._ids = itertools.count(_START + 1)
        self._lock = threading.Lock()  # the pending calls and the end
        self._send_lock = threading.Lock()  # the pipe's sending side, and its closing
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ended: str | None = None
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = self._loop.create_future()
        self._started: asyncio.Future[Any] = self._loop.create_future()
        self._pending[_START] = self._started
        self._outbox: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"{self.name} reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name=f"{self.name} writer", daemon=True)
        self._writer.start()

    # The reader: the replies as they come, and the end of the process.

    def _read(self) -> None:
        sentinel = self._process.sentinel
        try:
            while True:
                ready = multiprocessing.connection.wait([self._conn, sentinel])
                if self._conn not in ready:
                    while self._conn.poll():  # what the process sent before it ended
                        self._deliver(self._conn.recv())
                    break
                self._deliver(self._conn.recv())
        except (EOFError, ConnectionResetError):
            pass  # it ended (with what it had not read yet: reset); how is said below
        except Exception as error:  # a reply that cannot be read: the rank is lost
            logger.error("%s (pid %d): a reply could not be read: %s", self.name, self.pid, error)
            self._process.kill()
        self._process.join(STOP_GRACE)  # it closed its end of the pipe: it is ending
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
        how = exit_status(self._process.exitcode)
        if self._closing:
            message = f"{self.name} (pid {self.pid}) was closed"
        else:
            message = f"{self.name} (pid {self.pid}) died: {how}"
            if self._started.done():
                logger.warning("%s", message)
        with self._lock:
            self._ended = message
            pending, self._pending = self._pending, {}
        self._outbox.put(None)
        with self._send_lock:
            self._conn.close()
        for future in pending.values():
            self._settle(future, RankDied(message, self.rank), failed=True)
        self._settle(self._done, None)

    def _deliver(self, message: tuple[int, bool, Any]) -> None:
        call_id, ok, value = message
        with self._lock:
            future = self._pending.pop(call_id, None)
        if future is not None:
            self._settle(future, value if ok else _raised(value), failed=not ok)

    def _settle(self, future: asyncio.Future[Any], value: Any, failed: bool = False) -> None:
        def settle() -> None:
            if future.done():
                return
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the actor's loop is closed: nobody waits for it
            pass

    # The actor's side.

    def _write(self) -> None:
        """The writer: sends what the actor's side queued, in order. A rank whose process is
        stopped reads nothing, and a message larger than the pipe holds then blocks its send:
        here, never on the actor's event loop. Once the process ends the send fails, and the
        reader fails the calls."""
        while (message := self._outbox.get()) is not None:
            try:
                with self._send_lock:
                    self._conn.send_bytes(message)
            except OSError:
                pass  # the process is gone, or going: its reader fails the calls

    def _send(self, message: tuple[Any, ...]) -> None:
        """Queue ``message`` for the writer, pickled here (what does not pickle raises to the
        caller)."""
        self._outbox.put(ForkingPickler.dumps(message))

    async def _request(self, kind: str, *payload: Any) -> Any:
        """Send a request; its reply's value, or its exception raised."""
        future: asyncio.Future[Any] = self._loop.create_future()
        with self._lock:
            if self._ended is not None:
                raise RankDied(self._ended, self.rank)
            call_id = next(self._ids)
            self._pending[call_id] = future
        try:
            self._send((kind, call_id, *payload))
            return await future
        finally:
            with self._lock:
                self._pending.pop(call_id, None)

    async def started(self, timeout: float) -> None:
        """Once the rank's object is built; its build's exception, one line naming the rank,
        if it raised, and ``RuntimeError`` if it is not built within ``timeout`` seconds."""
        try:
            await wait_for(asyncio.shield(self._started), timeout, SYSTEM_CLOCK)
        except TimeoutError:
            self._started.cancel()  # nobody waits for it any more
            await self._stop(wait=False)
            raise RuntimeError(f"{self.name} (pid {self.pid}) did not start within {timeout:g}s") from None
        except RankDied as died:
            raise RuntimeError(f"{self.name} (pid {self.pid}) died while starting: {self._how()}") from died
        except BaseException as error:
            await self._stop()
            raise RuntimeError(f"{self.name} failed to start: {brief_error(error)}") from error

    def _how(self) -> str:
        return exit_status(self._process.exitcode)

    async def call(self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = await self._request("call", method_name(method), args, kwargs)
        return result

    async def call_beside(
        self, method: Callable[Concatenate[T, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        # The rank's process runs RANK_CONCURRENCY calls at once: every call is beside.
        return await self.call(method, *args, **kwargs)

    def notify(self, method: Callable[Concatenate[T, P], object], *args: P.args, **kwargs: P.kwargs) -> None:
        name = method_name(method)
        if self._ended is not None:
            return  # as a notification to a Ray actor that is gone: nothing to tell
        self._send(("notify", 0, name, args, kwargs))

    async def close(self, timeout: float | None = None) -> None:
        """The object's ``close()`` (within ``timeout``, default ``close_timeout``, beside
        any call still running), then the process's end: it exits, or is terminated, then
        killed. The close's exception is raised once the process is gone."""
        timeout = self.close_timeout if timeout is None else timeout
        self._closing = True
        failure: BaseException | None = None
        closed = True  # it exits once closed
        try:
            await wait_for(self._request("close"), timeout, SYSTEM_CLOCK)
        except RankDied:
            pass  # already gone
        except TimeoutError:
            logger.warning("%s (pid %d) did not close within %gs; terminated", self.name, self.pid, timeout)
            closed = False
        except Exception as error:
            failure = error
        finally:
            await self._stop(wait=closed)
        if failure is not None:
            raise failure

    def _terminate(self) -> None:
        """SIGTERM, then SIGCONT: a stopped process (SIGSTOP, a debugger) acts on the SIGTERM
        only once continued, and would otherwise sit out the grace until it is killed."""
        self._process.terminate()
        if self._process.pid is not None:
            os.kill(self._process.pid, signal.SIGCONT)

    async def _stop(self, wait: bool = True) -> None:
        """The process ended: waits for it to exit (if ``wait``), then terminates it, then
        kills it."""
        self._closing = True
        for end in (None, self._terminate, self._process.kill)[0 if wait else 1 :]:
            if self._done.done():
                break
            if end is not None:
                try:
                    end()
                except (OSError, ValueError):
                    pass
            try:
                await wait_for(asyncio.shield(self._done), STOP_GRACE, SYSTEM_CLOCK)
            except TimeoutError:
                continue


async def start_rank_process(
    factory: WorkerFactory[T],
    place: RankPlace,
    *,
    config: Config,
    transport: str,
    actor: str = "",
    log_into: LogInto | None = None,
    start_timeout: float = START_TIMEOUT,
    close_timeout: float = CLOSE_TIMEOUT,
) -> ProcessWorker[T]:
    """Rank ``place.rank`` in a spawned process of its own, built and ready for calls."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=True)
    process = context.Process(
        target=serve_rank,
        args=(theirs, os.getpid()),
        name=f"{actor} rank {place.rank}".lstrip(),
        daemon=True,  # terminated at this process's exit, if never closed
    )
    process.start()  # on the event loop's thread: the parent-death signal follows it
    theirs.close()
    worker: ProcessWorker[T] = ProcessWorker(actor, place, process, ours, close_timeout)
    start = RankStart(
        factory=factory,
        config_json=msgspec.json.encode(config),
        run_id=place.run_id,
        run_dir=str(place.run_dir),
        transport=transport,
        place=place,
        actor=actor,
        log_level=logging.getLogger().getEffectiveLevel(),
        log_into=log_into,
    )
    try:
        worker._send(("start", _START, start))  # if it died already, ``started`` says so
    except BaseException:
        await worker._stop()
        raise
    await worker.started(start_timeout)
    return worker


# The rank process's side.


def _die_with_parent(parent: int) -> None:
    """This process is killed when ``parent`` ends, however it ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watching thread alone
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve_rank(conn: Connection, parent: int) -> None:
    """The rank process: builds the rank's object, then runs what the actor sends until it
    asks the rank to close or goes away."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's; it closes the ranks
    # Spawned as a daemon (ended at its actor's exit); the rank itself may start processes.
    multiprocessing.current_process().daemon = False
    send_lock = threading.Lock()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        with send_lock:
            try:
                conn.send((call_id, ok, value))
            except OSError:
                os._exit(0)  # the actor is gone
            except Exception as error:  # a result that does not pickle
                conn.send((call_id, False, _failure(RuntimeError(f"its reply could not be sent: {error}"))))

    try:
        kind, _, start = conn.recv()
        if kind != "start" or not isinstance(start, RankStart):
            raise RuntimeError(f"a rank process was sent {kind!r} before it started")
        if start.log_into is not None:
            start.log_into(
                Path(start.run_dir), start.log_level, f"{start.actor} rank {start.place.rank}".lstrip()
            )
    except BaseException as error:
        reply(_START, False, _failure(error))
        _exit(1)
    pool = concurrent.futures.ThreadPoolExecutor(
        RANK_CONCURRENCY, thread_name_prefix=f"rank-{start.place.rank}"
    )

    def build() -> Any:
        config = msgspec.json.decode(start.config_json, type=Config)
        transport = open_transport(start.transport, start.run_id, Path(start.run_dir), config)
        return start.factory(config, transport, start.place)

    try:
        target = pool.submit(build).result()
    except BaseException as error:
        logger.debug("rank %d failed to start", start.place.rank, exc_info=True)
        reply(_START, False, _failure(error))
        _exit(1)
    gc.collect()  # what the build left as garbage goes; the rest stays out of full collections
    gc.freeze()
    reply(_START, True, os.getpid())

    def run(call_id: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            result = getattr(target, name)(*args, **kwargs)
        except BaseException as error:
            if call_id:
                reply(call_id, False, _failure(error))
            else:
                logger.warning("rank %d: %s failed: %s", start.place.rank, name, describe_error(error))
            return
        if call_id:
            reply(call_id, True, result)

    while True:
        try:
            kind, call_id, *payload = conn.recv()
        except (EOFError, OSError):
            _exit(0)  # the actor closed the pipe, or is gone
        if kind == "close":
            try:
                close = getattr(target, "close", None)
                if close is not None:
                    close()
            except BaseException as error:
                reply(call_id, False, _failure(error))
            else:
                reply(call_id, True, None)
            _exit(0)  # beside any call still running
        pool.submit(run, call_id if kind == "call" else 0, *payload)


def _exit(code: int) -> NoReturn:
    """Ends the process now, its log written, without waiting for calls still running."""
    logging.shutdown()
    os._exit(code)
