"""The control server: miles' cells API (paths, bodies, status codes, Kubernetes ``Status``
errors), its bearer token, its limits, and each command an event on the bus; served for real
by uvicorn and checked by schemathesis against its own OpenAPI document; the mini FT
controller healing through it."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from miles_events.app.reference_docs import control_api_document
from miles_events.bus.event_bus import EventBus
from miles_events.sinks.base import SinkContext
from miles_events.sinks.control.cells import CellBook
from miles_events.sinks.control.controller import MiniFtController, unhealthy
from miles_events.sinks.control.server import (
    TOKEN_ENV,
    ControlError,
    ControlServer,
    build_app,
    resolve_token,
)
from schemas.config import Config, ControlConfig
from schemas.events import (
    CellFailed,
    CellHealing,
    CellHealth,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CellSuspendRequested,
    CheckpointRequested,
    Event,
    FaultInjectionRequested,
    StopRequested,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token"


def config(**run: Any) -> Config:
    raw = {
        "run": {"control_server_port": 0, "ft_components": ["rollout"], **run},
        "generator": {"num_engines": 2},
    }
    return msgspec.convert(raw, Config)


class Served:
    """The app over a fresh cell book, its commands recorded."""

    def __init__(self, cfg: Config | None = None, limit: int = 65536) -> None:
        self.book = CellBook(cfg or config())
        self.book.started()
        self.published: list[Event] = []

        async def publish(event: Event) -> None:
            self.published.append(event)

        self.app = build_app(self.book, publish, TOKEN, limit)

    def client(self, token: str | None = TOKEN) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://control", headers=headers
        )


def is_status(body: dict[str, Any], code: int, reason: str) -> None:
    assert body["apiVersion"] == "v1" and body["kind"] == "Status" and body["status"] == "Failure", body
    assert body["code"] == code and body["reason"] == reason, body
    assert body["message"], body


async def test_health_needs_no_token_and_answers_ok() -> None:
    async with Served().client(token=None) as client:
        response = await client.get("/api/v1/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.parametrize("token", [None, "wrong"])
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/cells"),
        ("GET", "/api/v1/cells/rollout-0"),
        ("PATCH", "/api/v1/cells/rollout-0"),
        ("POST", "/api/v1/cells/rollout-0/inject-fault"),
        ("POST", "/api/v1/save"),
        ("POST", "/api/v1/stop"),
    ],
)
async def test_every_other_route_needs_the_bearer_token(method: str, path: str, token: str | None) -> None:
    served = Served()
    async with served.client(token=token) as client:
        response = await client.request(method, path, json={"spec": {"suspend": True}, "mode": "sigkill"})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    is_status(response.json(), 401, "Unauthorized")
    assert served.published == [], "nothing reaches the bus unauthenticated"


async def test_cells_are_listed_as_miles_names_and_labels_them() -> None:
    async with Served().client() as client:
        listed = (await client.get("/api/v1/cells")).json()
        one = (await client.get("/api/v1/cells/rollout-1")).json()
    assert listed["apiVersion"] == "miles.io/v1" and listed["kind"] == "CellList"
    assert [c["metadata"]["name"] for c in listed["items"]] == ["rollout-0", "rollout-1"]
    assert one["kind"] == "Cell" and one["spec"] == {"suspend": False}
    assert one["metadata"]["labels"] == {"miles.io/cell-type": "rollout", "miles.io/cell-index": "1"}
    assert one["status"]["phase"] == "Running"
    conditions = {c["type"]: c for c in one["status"]["conditions"]}
    assert conditions["Allocated"]["status"] == "True" and conditions["Healthy"]["status"] == "True"
    assert conditions["Healthy"]["lastTransitionTime"].endswith("Z")


async def test_an_unknown_cell_is_a_not_found_status() -> None:
    async with Served().client() as client:
        for response in (
            await client.get("/api/v1/cells/rollout-9"),
            await client.patch("/api/v1/cells/rollout-9", json={"spec": {"suspend": True}}),
            await client.post("/api/v1/cells/rollout-9/inject-fault", json={"mode": "sigkill"}),
        ):
            assert response.status_code == 404
            is_status(response.json(), 404, "NotFound")
            assert response.json()["message"] == "Cell 'rollout-9' not found"


async def test_suspend_and_resume_are_events_and_the_cell_follows_the_facts() -> None:
    served = Served()
    async with served.client() as client:
        patched = (await client.patch("/api/v1/cells/rollout-1", json={"spec": {"suspend": True}})).json()
        assert patched["spec"]["suspend"] is True
        assert served.published == [CellSuspendRequested(cell="rollout-1", suspend=True)]
        served.book.suspended("rollout-1")  # the Generator's CellSuspended
        assert (await client.get("/api/v1/cells/rollout-1")).json()["status"]["phase"] == "Suspended"
        # The last running engine cannot be suspended: the run would stop.
        refused = await client.patch("/api/v1/cells/rollout-0", json={"spec": {"suspend": True}})
        assert refused.status_code == 409
        is_status(refused.json(), 409, "Conflict")
        resumed = (await client.patch("/api/v1/cells/rollout-1", json={"spec": {"suspend": False}})).json()
        assert resumed["status"]["phase"] == "Pending", "starting again until CellResumed"
        # An empty patch, or one that asks for what is, changes nothing and says nothing.
        assert (await client.patch("/api/v1/cells/rollout-0", json={})).status_code == 200
        assert (
            await client.patch("/api/v1/cells/rollout-0", json={"spec": {"suspend": False}})
        ).status_code == 200
    assert served.published[1:] == [CellSuspendRequested(cell="rollout-1", suspend=False)]


async def test_inject_fault_save_and_stop_put_their_command_on_the_bus() -> None:
    served = Served()
    async with served.client() as client:
        injected = await client.post(
            "/api/v1/cells/rollout-0/inject-fault", json={"mode": "deadlock", "sub_index": 0}
        )
        saved = await client.post("/api/v1/save")
        stopped = await client.post("/api/v1/stop")
    assert [r.json() for r in (injected, saved, stopped)] == [{"status": "ok"}] * 3
    kinds = [type(e) for e in served.published]
    assert kinds == [FaultInjectionRequested, CheckpointRequested, StopRequested]
    assert served.published[0] == FaultInjectionRequested(cell="rollout-0", mode="deadlock", sub_index=0)
    stop = served.published[2]
    assert isinstance(stop, StopRequested) and not stop.now, "after the current step"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/cells/rollout-0/inject-fault", {"mode": "meltdown"}),
        ("/api/v1/cells/rollout-0/inject-fault", {"mode": "sigkill", "sub_index": -1}),
        ("/api/v1/cells/rollout-0/inject-fault", {"mode": "sigkill", "extra": 1}),
        ("/api/v1/cells/rollout-0", {"spec": {"suspend": "yes please"}}),
        ("/api/v1/cells/rollout-0", {"spec": {"suspend": True, "replicas": 3}}),
    ],
)
async def test_a_malformed_body_is_a_bad_request_status(path: str, body: dict[str, Any]) -> None:
    served = Served()
    async with served.client() as client:
        method = "PATCH" if path.endswith("rollout-0") else "POST"
        response = await client.request(method, path, json=body)
    assert response.status_code == 400, response.text
    is_status(response.json(), 400, "BadRequest")
    assert served.published == []


async def test_a_body_that_is_not_json_is_a_bad_request_status() -> None:
    async with Served().client() as client:
        response = await client.post(
            "/api/v1/cells/rollout-0/inject-fault",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    is_status(response.json(), 400, "BadRequest")


async def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    served = Served(limit=64)
    async with served.client() as client:
        large = await client.post(
            "/api/v1/cells/rollout-0/inject-fault", json={"mode": "sigkill", "pad": "x" * 200}
        )

        async def stream():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"x" * 32

        streamed = await client.post("/api/v1/stop", content=stream())
    for response in (large, streamed):
        assert response.status_code == 413
        is_status(response.json(), 413, "RequestEntityTooLarge")
    assert served.published == []


async def test_unknown_routes_and_methods_are_statuses_too() -> None:
    async with Served().client() as client:
        missing = await client.get("/api/v1/nothing")
        wrong = await client.delete("/api/v1/cells/rollout-0")
    is_status(missing.json(), 404, "NotFound")
    is_status(wrong.json(), 405, "MethodNotAllowed")


def test_the_cells_conditions_follow_the_facts() -> None:
    book = CellBook(config())
    assert book.cells["rollout-0"].render().status.phase == "Pending", "before the run starts"
    book.started()
    book.failed("rollout-1", "engine-1 (pid 7) died: killed by SIGKILL", hung=False)
    failed = book.cells["rollout-1"].render().status
    conditions = {c.type: c for c in failed.conditions}
    assert failed.phase == "Pending"
    # Being restarted by the Generator: not for the mini FT controller to heal meanwhile.
    assert (conditions["Healthy"].status, conditions["Healthy"].reason) == ("Unknown", "Died")
    assert conditions["Allocated"].status == "False"
    book.running("rollout-1", "Restarted")
    assert {c.type: c.status for c in book.cells["rollout-1"].render().status.conditions} == {
        "Allocated": "True",
        "Healthy": "True",
    }
    # A missed health check below the limit keeps the status and says why (miles' checker).
    book.health("rollout-0", False, "engine-0: /health answered 503")
    healthy = {c.type: c for c in book.cells["rollout-0"].render().status.conditions}["Healthy"]
    assert (healthy.status, healthy.reason, healthy.message) == (
        "True",
        "HealthCheckFailed",
        "engine-0: /health answered 503",
    )


def test_only_the_components_that_heal_have_cells() -> None:
    assert CellBook(config(ft_components=[])).cells == {}


def test_the_token_comes_from_config_then_the_environment_then_is_generated(monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve_token(msgspec.convert({"control": {"token": "abc"}}, Config)) == ("abc", False)
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert resolve_token(Config()) == ("from-env", False)
    monkeypatch.delenv(TOKEN_ENV)
    token, generated = resolve_token(Config())
    assert generated and len(token) >= 32 and token != resolve_token(Config())[0]


def test_a_port_in_use_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    server = ControlServer(config(control_server_port=port))
    with pytest.raises(ControlError, match=rf"run.control_server_port: cannot serve on 127.0.0.1:{port}"):
        server.prepare(server.config)
    taken.close()
    assert list(tmp_path.iterdir()) == []


def test_the_openapi_document_in_docs_is_the_servers() -> None:
    document = json.loads((ROOT / "docs" / "control-api.json").read_text())
    assert document == control_api_document(), "regenerate: python -m miles_events.app.reference_docs"
    paths = set(document["paths"])
    assert paths == {
        "/api/v1/health",
        "/api/v1/cells",
        "/api/v1/cells/{name}",
        "/api/v1/cells/{name}/inject-fault",
        "/api/v1/save",
        "/api/v1/stop",
    }


async def _running_server(tmp_path: Path, cfg: Config) -> tuple[ControlServer, EventBus, Any]:
    bus = EventBus("control-test")
    seen = bus.subscribe(
        "test",
        (CellSuspendRequested, FaultInjectionRequested, CheckpointRequested, StopRequested, CellHealing),
    )
    server = ControlServer(cfg)

    async def fail(reason: str) -> None:
        raise AssertionError(reason)

    await server.start(SinkContext("control-test", tmp_path, cfg, bus, fail))
    return server, bus, seen


async def test_the_real_server_writes_its_token_0600_and_serves_on_loopback(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    server, bus, _ = await _running_server(tmp_path, config())
    try:
        token_file = tmp_path / "control-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        url = server.url
        assert url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(base_url=server.url) as client:
            assert (await client.get("/api/v1/health")).json() == {"status": "ok"}
            assert (await client.get("/api/v1/cells")).status_code == 401
            listed = await client.get("/api/v1/cells", headers={"Authorization": f"Bearer {token}"})
            assert listed.status_code == 200
    finally:
        await server.close()
        bus.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/api/v1/health", timeout=1.0)


async def test_schemathesis_finds_no_failure_against_the_running_server(tmp_path: Path) -> None:
    """Every route with generated valid and invalid bodies, paths and tokens: no 5xx, every
    answer conforms to the OpenAPI document (its schema, its status codes, its content type)."""
    cfg = msgspec.structs.replace(config(), control=msgspec.convert({"token": TOKEN}, ControlConfig))
    server, bus, _ = await _running_server(tmp_path, cfg)
    try:
        await asyncio.get_running_loop().run_in_executor(None, _schemathesis, server.url, TOKEN)
    finally:
        await server.close()
        bus.close()


def _schemathesis(url: str, token: str) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_dict(control_api_document())
    schema.config.update(base_url=url)
    failures: list[str] = []
    for operation in schema.get_all_operations():
        op = operation.ok()

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case: Any) -> None:
            headers = {"Authorization": f"Bearer {token}"}
            response = case.call(headers=headers, timeout=10)
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code}"
            case.validate_response(response)

        try:
            check()
        except Exception as error:  # collect every operation's failure
            failures.append(f"{op.method.upper()} {op.path}: {error}")
    assert not failures, "\n".join(failures)


async def test_the_mini_ft_controller_heals_a_suspended_cell_through_the_api() -> None:
    """An unhealthy cell (here suspended) is suspended, left, resumed; each step an event;
    one that is healthy or unknown is left alone."""
    cfg = msgspec.convert(
        {
            "run": {"control_server_port": 1, "ft_components": ["rollout"], "mini_ft_controller": True},
            "generator": {"num_engines": 2},
            "control": {"controller_suspend_seconds": 0.01},
        },
        Config,
    )
    served = Served(cfg)
    served.book.suspended("rollout-1")
    controller = MiniFtController(cfg, lambda: "http://control", TOKEN)

    async def publish(event: Event) -> None:
        served.published.append(event)

    controller._publish = publish
    async with served.client() as client:
        await controller.poll_and_heal(client)
    steps = [(e.cell, e.step) for e in served.published if isinstance(e, CellHealing)]
    assert steps == [("rollout-1", "suspend"), ("rollout-1", "resume"), ("rollout-1", "done")]
    assert CellSuspendRequested(cell="rollout-1", suspend=False) in served.published
    assert not any(isinstance(e, CellHealing) and e.cell == "rollout-0" for e in served.published)


def test_miles_verdict_on_a_cell() -> None:
    def cell(phase: str, healthy: str | None) -> dict[str, Any]:
        conditions = [] if healthy is None else [{"type": "Healthy", "status": healthy}]
        return {"status": {"phase": phase, "conditions": conditions}}

    assert unhealthy(cell("Running", "False"))
    assert unhealthy(cell("Suspended", "Unknown"))
    assert not unhealthy(cell("Running", "Unknown"))
    assert not unhealthy(cell("Pending", None))
    assert not unhealthy(cell("Running", "True"))


def test_facts_the_server_folds_are_the_generators_events() -> None:
    """The sink's handlers cover every cell fact the Generator publishes."""
    handled = set(ControlServer(config()).handlers())
    assert {CellFailed, CellRestarted, CellSuspended, CellResumed, CellHealth} <= handled
