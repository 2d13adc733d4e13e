"""The control server (``run.control_server_port``): miles' cells API, plus save and stop,
served by FastAPI under uvicorn in the driver's event loop.

Each request that asks for something becomes an event on the run's bus (published as
``control``): ``PATCH /api/v1/cells/{name}`` a ``CellSuspendRequested``,
``inject-fault`` a ``FaultInjectionRequested``, ``POST /api/v1/save`` a
``CheckpointRequested``, ``POST /api/v1/stop`` a ``StopRequested`` (after the current step).
The answer says the command is on the bus; the actors' facts follow in the event log, and
the cells (``GET``) show them.

Safe by default: the server binds loopback (``control.host``), every route but the health
check needs ``Authorization: Bearer <token>`` (``control.token``, else
``MILES_CONTROL_TOKEN``, else a token generated and written to ``<run.dir>/control-token``,
mode 0600), a body over ``control.max_request_bytes`` is refused before it is read whole,
and every failure, a malformed body included, is a Kubernetes ``Status`` with its 4xx or
5xx code, never a crash of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from miles_events.bus.handlers import handles
from miles_events.sinks.base import Sink, SinkContext
from miles_events.sinks.control.cells import CellBook, CellRecord
from miles_events.sinks.control.models import Cell, CellList, CellPatch, InjectFault, Ok, Status
from schemas.config import Config
from schemas.events import (
    CellFailed,
    CellHealth,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CellSuspendRequested,
    CheckpointRequested,
    Event,
    FaultInjectionRequested,
    RunStarted,
    StopRequested,
)

logger = logging.getLogger(__name__)

TOKEN_ENV = "MILES_CONTROL_TOKEN"
TOKEN_FILE = "control-token"
API = "/api/v1"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ControlError(ValueError):
    """The control server cannot start as configured (one line; the run exits with 2)."""


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return Status(code=code, reason=reason, message=message).model_dump()  # type: ignore[arg-type]


REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 before it is
    read whole (by its ``Content-Length``, or as it streams in)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        too_large = JSONResponse(
            status_body(413, "RequestEntityTooLarge", f"the request body exceeds {self.limit} bytes"),
            status_code=413,
        )
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await too_large(scope, receive, send)
            return
        # No length given (a chunked body): read it here, at most ``limit`` bytes, and hand
        # the route what was read.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def build_app(
    book: CellBook, publish: Callable[[Event], Awaitable[object]], token: str, limit: int
) -> ASGIApp:
    """The FastAPI application: miles' routes over ``book``, commands through ``publish``."""
    from fastapi import Depends, FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(
        title="miles-events control server",
        version="1",
        description="miles' cells API (miles.io/v1) plus save and stop; every route but the health "
        "check needs a bearer token.",
        docs_url=None,
        redoc_url=None,
    )
    bearer = HTTPBearer(auto_error=False)
    failure: dict[int | str, dict[str, Any]] = {
        code: {"model": Status, "description": REASONS[code]} for code in (400, 401, 404, 409, 413, 500)
    }

    def fail(code: int, message: str) -> HTTPException:
        return HTTPException(status_code=code, detail=message)

    async def authorized(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (FastAPI's way)
    ) -> None:
        if credentials is None or not secrets.compare_digest(
            credentials.credentials.encode(), token.encode()
        ):
            raise HTTPException(
                status_code=401,
                detail="a valid bearer token is required (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        reason = REASONS.get(error.status_code, "BadRequest" if error.status_code < 500 else "InternalError")
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        return JSONResponse(
            status_body(error.status_code, reason, message),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg', '')}"
            for e in error.errors()[:5]
        )
        return JSONResponse(status_body(400, "BadRequest", problems or "malformed request"), status_code=400)

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        logger.exception("control server: %s %s failed", request.method, request.url.path)
        return JSONResponse(status_body(500, "InternalError", type(error).__name__), status_code=500)

    def record_of(name: str) -> CellRecord:
        record = book.get(name)
        if record is None:
            raise fail(404, f"Cell '{name}' not found")
        return record

    guarded = [Depends(authorized)]

    @app.get(f"{API}/health", response_model=Ok)
    async def health() -> Ok:
        return Ok()

    @app.get(f"{API}/cells", response_model=CellList, dependencies=guarded, responses=failure)
    async def list_cells() -> CellList:
        return CellList(items=[record.render() for record in book.cells.values()])

    @app.get(f"{API}/cells/{{name}}", response_model=Cell, dependencies=guarded, responses=failure)
    async def get_cell(name: str) -> Cell:
        return record_of(name).render()

    @app.patch(f"{API}/cells/{{name}}", response_model=Cell, dependencies=guarded, responses=failure)
    async def patch_cell(name: str, patch: CellPatch) -> Cell:
        record = record_of(name)
        suspend = patch.spec.suspend if patch.spec is not None else None
        if suspend is None or suspend == record.suspend:
            return record.render()
        # A trainer rank's cell suspends the trainer's group: training pauses until it is
        # resumed (then from the latest checkpoint); the last engine would stop the run.
        others = [r for r in book.running_of_type(record.cell_type) if r.name != name]
        if suspend and record.cell_type == "rollout" and not others:
            raise fail(
                409, f"{name} is the last running {record.cell_type} cell: suspending it would stop the run"
            )
        if suspend:
            record.suspend = True
        else:
            book.resuming(name)
        await publish(CellSuspendRequested(cell=name, suspend=suspend))
        return record.render()

    @app.post(
        f"{API}/cells/{{name}}/inject-fault", response_model=Ok, dependencies=guarded, responses=failure
    )
    async def inject_fault(name: str, fault: InjectFault) -> Ok:
        record_of(name)
        await publish(FaultInjectionRequested(cell=name, mode=fault.mode, sub_index=fault.sub_index))
        return Ok()

    @app.post(f"{API}/save", response_model=Ok, dependencies=guarded, responses=failure)
    async def save() -> Ok:
        await publish(CheckpointRequested(reason="asked for by the control server"))
        return Ok()

    @app.post(f"{API}/stop", response_model=Ok, dependencies=guarded, responses=failure)
    async def stop() -> Ok:
        await publish(StopRequested(reason="asked for by the control server"))
        return Ok()

    return BodyLimit(app, limit)


def resolve_token(config: Config) -> tuple[str, bool]:
    """The bearer token, and whether it was generated here (to be written to the run dir)."""
    token = config.control.token or os.environ.get(TOKEN_ENV, "")
    if token:
        return token, False
    return secrets.token_urlsafe(32), True


def write_token(run_dir: Path, token: str) -> Path:
    """``<run_dir>/control-token``, mode 0600 from its creation."""
    path = run_dir / TOKEN_FILE
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(token + "\n")
    return path


class ControlServer(Sink):
    """The control server, a sink: it folds the cells' facts into what ``GET`` answers and
    publishes the commands it is sent."""

    name = "control"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.book = CellBook(config)
        self.token, self.generated = resolve_token(config)
        self.socket: socket.socket | None = None
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        assert self.socket is not None, "the server holds its port once prepared"
        port: int = self.socket.getsockname()[1]
        return port

    @property
    def url(self) -> str:
        host = self.config.control.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def prepare(self, config: Config) -> None:
        """Take the port now: a busy one is refused before the run writes anything."""
        if self.socket is not None:
            return
        host, port = config.control.host, config.run.control_server_port
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except (OSError, OverflowError) as error:
            reason = getattr(error, "strerror", None) or str(error)
            raise ControlError(
                f"run.control_server_port: cannot serve on {host}:{port}: {reason}; choose another port "
                "(or control.host)"
            ) from None
        sock.setblocking(False)
        self.socket = sock

    def release(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    async def start(self, context: SinkContext) -> None:
        import uvicorn

        self.prepare(context.config)
        assert self.socket is not None
        if self.generated:
            path = write_token(context.run_dir, self.token)
            logger.info("control server token written to %s", path)
        bus = context.bus

        async def publish(event: Event) -> None:
            await bus.publish(event, source="control")

        app = build_app(self.book, publish, self.token, self.config.control.max_request_bytes)
        server_config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(server_config)
        self._server.install_signal_handlers = lambda: None  # the session owns the signals
        self._task = asyncio.create_task(self._server.serve(sockets=[self.socket]), name="control-server")
        logger.info("control server at %s", self.url)

    async def close(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5.0)
        self.release()

    # -- the cells' facts ------------------------------------------------------------------

    @handles(RunStarted)
    def _run_started(self, event: RunStarted) -> None:
        self.book.started()

    @handles(CellFailed)
    def _cell_failed(self, event: CellFailed) -> None:
        self.book.failed(event.cell, event.reason, event.hung)

    @handles(CellRestarted)
    def _cell_restarted(self, event: CellRestarted) -> None:
        self.book.running(event.cell, "Restarted")

    @handles(CellResumed)
    def _cell_resumed(self, event: CellResumed) -> None:
        self.book.running(event.cell, "Resumed")

    @handles(CellSuspended)
    def _cell_suspended(self, event: CellSuspended) -> None:
        self.book.suspended(event.cell)

    @handles(CellHealth)
    def _cell_health(self, event: CellHealth) -> None:
        self.book.health(event.cell, event.healthy, event.reason)


def control_server(config: Config) -> ControlServer | None:
    """The control server ``run.control_server_port`` asks for, or None (0: off)."""
    return ControlServer(config) if config.run.control_server_port else None
