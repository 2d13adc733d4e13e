"""An inference server in a child process: started, waited for, and stopped whole.

Server engines (vLLM here, SGLang alike) launch their server with ``ServerProcess.start``:
the command runs in a new process group on 127.0.0.1, on a free port or a configured one,
with stdout and stderr in one log file under the run directory, and ``start`` returns once
its health URL answers 200. Every way a start can fail ends in ``ServerStartError``, one
line that names the cause and the log: the port is taken, the process exited during start
(with the gist of its last log lines), or the health URL did not answer in time. A start
never hangs, and a failed start leaves no process behind. A server that dies later is
reported by ``exit_note``: how it exited, and what its log says of why after the last
request it answered, or nothing more when it says nothing (a kill from outside). The log is
read for errors only: lines logged as DEBUG, INFO or WARNING, traceback frames and access
lines are never quoted. ``close`` ends the whole process
group (a server's worker processes included): SIGTERM, then SIGKILL after a grace period.
Servers still open when the interpreter exits are closed then.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from miles_events.util.exit_status import exit_status

HOST = "127.0.0.1"
LOG_TAIL_BYTES = 64 * 1024
"""How much of the log's end is read for the gist of a failed start."""
_EXCEPTION_LINE = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception|Exit): \S")
"""A Python exception with its message (``RuntimeError: ...``)."""
_ERROR_LINE = re.compile(r"(Error|Exception|error:|ERROR|No such file|not found|does not exist|Killed)")
_WRAPPER = re.compile(r"stack trace \(above\)")
"""Exceptions that only point at another one (vLLM's ``EngineDeadError``)."""
_ACCESS = re.compile(r"HTTP/1\.[01]\" \d{3}")
"""An access-log line (a request and its status)."""
_ANSWERED = re.compile(r"HTTP/1\.[01]\" 2\d\d")
"""An access-log line of a request the server answered."""
_TRACEBACK = re.compile(
    r"^(Traceback \(most recent call last\)|During handling of the above|The above exception)"
)
_LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\)\s+)?(\w+\s+\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\s+\[[^\]]*\] ?)?")
"""vLLM's ``(Worker pid=1) ERROR 12-01 18:47:27 [file.py:12]`` line prefix."""
_LEVEL = re.compile(r"^(\(\S+ pid=\d+\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
"""The level of a vLLM (``INFO 12-01 ...``) or uvicorn (``INFO:     ...``) log line."""
_QUIET_LEVELS = ("DEBUG", "INFO", "WARNING")
"""Levels whose lines never say why a server stopped (vLLM warns at every start of a
ulimit in words that read like an error)."""

logger = logging.getLogger(__name__)

_OPEN: set[ServerProcess] = set()
_OPEN_LOCK = threading.Lock()


class ServerStartError(RuntimeError):
    """A server did not start; the message is one line naming the cause and the log."""


class PortTaken(ServerStartError):
    """The server's port was taken, before the launch or by the time the server bound it."""


_HANDED_OUT: set[int] = set()
"""Ports ``free_port`` has returned in this process: servers launched at once must not be
given the same one (the kernel may pick a just-released port again)."""
_PORTS_LOCK = threading.Lock()


def free_port(host: str = HOST) -> int:
    """A port nobody listens on now (the kernel's pick), never one this process was given
    before."""
    with _PORTS_LOCK:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((host, 0))
                port = int(probe.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def port_is_free(port: int, host: str = HOST) -> bool:
    """Whether ``port`` can be bound on ``host`` now."""
    with _PORTS_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class _Line:
    """One line of a server log: its level (None when it has none), whether it is part of a
    traceback (the header or a frame), and its text without the prefix, spaces collapsed."""

    __slots__ = ("frame", "level", "text")

    def __init__(self, raw: str) -> None:
        level = _LEVEL.match(raw.lstrip())
        self.level = level.group(2) if level else None
        body = _LOG_PREFIX.sub("", raw)
        self.frame = body[:1].isspace() or bool(_TRACEBACK.match(body))
        self.text = " ".join(body.split())


def _log_lines(log_path: Path) -> list[_Line] | None:
    """The non-empty lines of the end of the log (``LOG_TAIL_BYTES``); None without a log."""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - LOG_TAIL_BYTES))
            tail = log.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [_Line(raw) for raw in tail.splitlines()]
    return [line for line in lines if line.text]


def _why(lines: list[_Line]) -> str | None:
    """What the lines say of why the server stopped, in one line, or None when they say
    nothing: the last exception with its message (a traceback's last line); where that only
    points at a root cause the log does not hold, the error line it came with and it; else
    the last error line. Lines logged below ERROR, traceback frames and access lines are
    never quoted."""
    said = [
        i
        for i, line in enumerate(lines)
        if line.level not in _QUIET_LEVELS and not line.frame and not _ACCESS.search(line.text)
    ]
    exceptions = [i for i in said if _EXCEPTION_LINE.search(lines[i].text)]
    causes = [i for i in exceptions if not _WRAPPER.search(lines[i].text)]
    if causes:
        at = causes[-1]
        gist = lines[at].text
        if "validation error" in gist and at + 1 < len(lines):
            gist = f"{gist}: {lines[at + 1].text}"  # pydantic puts what failed on the next line
        return gist
    if exceptions:
        at = exceptions[-1]
        before = [i for i in said if i < at]
        if before and lines[before[-1]].level in ("ERROR", "CRITICAL") and before[-1] not in exceptions:
            return f"{lines[before[-1]].text} {lines[at].text}"
        return lines[at].text
    errors = [lines[i].text for i in said if _ERROR_LINE.search(lines[i].text)]
    return errors[-1] if errors else None


def _shorten(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def log_gist(log_path: Path, max_chars: int = 300) -> str:
    """One line from the end of a server log that says why it stopped (``_why``), else its
    last non-empty line."""
    lines = _log_lines(log_path)
    if lines is None:
        return "no log"
    if not lines:
        return "the log is empty"
    return _shorten(_why(lines) or lines[-1].text, max_chars)


def death_gist(log_path: Path, max_chars: int = 300) -> str | None:
    """Why a server that was answering requests stopped, as its log says it after the last
    request it answered (``_why``); None when it says nothing there (a server killed from
    outside)."""
    lines = _log_lines(log_path) or []
    answered = [i for i, line in enumerate(lines) if _ANSWERED.search(line.text)]
    why = _why(lines[answered[-1] + 1 :] if answered else lines)
    return None if why is None else _shorten(why, max_chars)


class ServerProcess:
    """One running server: its process group, port, base URL and log."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.name = name
        self.process = process
        self.port = port
        self.log_path = log_path
        self.url = f"http://{HOST}:{port}"
        self.ready_seconds = 0.0
        """Seconds from the launch until the health URL answered."""
        self._files: list[Path] = []
        """Files that describe this server, named in its record (``record_file``)."""

    @classmethod
    def start(
        cls,
        name: str,
        command: Sequence[str],
        *,
        port: int,
        log_path: Path,
        health_path: str = "/health",
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        poll_interval: float = 0.5,
    ) -> ServerProcess:
        """Run ``command`` (which must make the server listen on ``HOST:port``) and wait
        until ``health_path`` answers 200, at most ``timeout`` seconds.

        ``env`` is added to this process's environment. Raises ``ServerStartError``; the
        process group is gone then.
        """
        if not port_is_free(port):
            raise PortTaken(
                f"{name}: port {port} on {HOST} is taken by another process; "
                f"choose another port or leave it unset for a free one (log {log_path} not started)"
            )
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {})}
        started = time.monotonic()
        with open(log_path, "ab") as log:
            try:
                process = subprocess.Popen(
                    list(command),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=full_env,
                    start_new_session=True,  # its own process group: close() ends every child
                )
            except OSError as error:
                raise ServerStartError(
                    f"{name}: cannot run {command[0]}: {error.strerror} (log {log_path})"
                ) from None
        server = cls(name, process, port, log_path)
        with _OPEN_LOCK:
            _OPEN.add(server)
        server._record()
        try:
            server._wait_ready(health_path, started + timeout, timeout, poll_interval)
        except BaseException:
            server.close(grace=5.0)
            raise
        server.ready_seconds = time.monotonic() - started
        return server

    def _wait_ready(self, health_path: str, deadline: float, timeout: float, poll_interval: float) -> None:
        health = self.url + health_path
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=1.0)) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    gist = log_gist(self.log_path)
                    error = PortTaken if "address already in use" in gist.lower() else ServerStartError
                    raise error(
                        f"{self.name}: the server exited during start ({exit_status(code)}): "
                        f"{gist} (log {self.log_path})"
                    )
                try:
                    if client.get(health).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name}: {health} did not answer within {timeout:g} s; last log line: "
                        f"{log_gist(self.log_path)} (log {self.log_path})"
                    )
                time.sleep(poll_interval)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def record_path(self) -> Path:
        """``<log>.processes.json`` beside the log: who launched the server and its process
        group, so that the next run in the directory can end a server whose launcher was
        killed with no chance to close it (``miles_events.runtime.leftovers``)."""
        return self.log_path.with_name(self.log_path.stem + RECORD_SUFFIX)

    def _record(self, files: Sequence[Path] = ()) -> None:
        leader = self.process.pid
        record = {
            "driver": [os.getpid(), _start_time(os.getpid())],
            "processes": [[leader, _start_time(leader)]],
            "group": leader,
            "files": [str(f) for f in files],
        }
        self.record_path.write_text(json.dumps(record))

    def record_file(self, path: Path) -> None:
        """Name ``path`` (a file that describes this server, e.g. its Prometheus target) in
        the server's record, so that the cleanup after a killed launcher removes it too."""
        self._files.append(path)
        self._record(self._files)

    def exit_note(self, wait: float = 2.0) -> str:
        """For a request that failed at the transport: ", the server process has exited
        (<how>): <why>" once it has (waiting up to ``wait`` s for a dying process to be
        reaped), the why quoted from its log (``death_gist``) when the log says it, else
        "" (the server lives; the failure was the connection's)."""
        try:
            code = self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return ""
        why = death_gist(self.log_path)
        return f", the server process has exited ({exit_status(code)})" + (f": {why}" if why else "")

    def close(self, grace: float = 10.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``grace`` s.
        Closing twice is allowed."""
        self.record_path.unlink(missing_ok=True)
        with _OPEN_LOCK:
            _OPEN.discard(self)
        pgid = self.process.pid  # the session leader: its pid is the group's id
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            self.process.poll()
            return
        # The leader's children may outlive it: wait for the whole group, then kill it.
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader, or the group never empties
            if not _group_alive(pgid):
                return
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


PORT_ATTEMPTS = 3
"""Free ports tried for a server whose port is picked (another process may take a free
port between the pick and the server's bind)."""


def start_on_a_port(
    name: str,
    command_for: Callable[[int], Sequence[str]],
    *,
    port: int,
    log_path: Path,
    **start: Any,
) -> ServerProcess:
    """``ServerProcess.start`` of ``command_for(port)``; with ``port`` 0, on a free port,
    picked again (up to ``PORT_ATTEMPTS`` times) when another process takes it first."""
    attempts = PORT_ATTEMPTS if port == 0 else 1
    for attempt in range(attempts):
        chosen = port or free_port()
        try:
            return ServerProcess.start(name, command_for(chosen), port=chosen, log_path=log_path, **start)
        except PortTaken:
            if attempt == attempts - 1:
                raise
            logger.warning("%s: port %d was taken before the server bound it; trying another", name, chosen)
    raise AssertionError("unreachable")


RECORD_SUFFIX = ".processes.json"


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), as
    ``miles_events.runtime.leftovers`` compares it; 0 when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[19])


@atexit.register
def _close_open_servers() -> None:
    with _OPEN_LOCK:
        servers = list(_OPEN)
    for server in servers:
        server.close(grace=5.0)
