"""The control server's HTTP bodies: miles' cells API (``apiVersion: miles.io/v1``, shaped
as Kubernetes objects), plus the save and stop commands. Pydantic models, so that FastAPI
validates every body and the OpenAPI document (``docs/control-api.json``) says exactly what
each route takes and answers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

API_VERSION = "miles.io/v1"
CELL_TYPE_LABEL = "miles.io/cell-type"
CELL_INDEX_LABEL = "miles.io/cell-index"

CellPhase = Literal["Pending", "Running", "Suspended"]
ConditionType = Literal["Allocated", "Healthy"]
ConditionStatus = Literal["True", "False", "Unknown"]


class _Strict(BaseModel):
    """A request body: unknown fields are refused (a typo is a 400, not a no-op)."""

    model_config = ConfigDict(extra="forbid")


class Condition(BaseModel):
    type: ConditionType
    status: ConditionStatus
    reason: str | None = None
    message: str | None = None
    lastTransitionTime: str | None = None
    """RFC 3339, UTC: when ``status`` last changed."""


class ObjectMeta(BaseModel):
    name: str
    labels: dict[str, str]


class CellSpec(BaseModel):
    suspend: bool = False


class CellStatus(BaseModel):
    phase: CellPhase
    conditions: list[Condition] = Field(default_factory=list)


class Cell(BaseModel):
    apiVersion: Literal["miles.io/v1"] = "miles.io/v1"
    kind: Literal["Cell"] = "Cell"
    metadata: ObjectMeta
    spec: CellSpec
    status: CellStatus


class CellList(BaseModel):
    apiVersion: Literal["miles.io/v1"] = "miles.io/v1"
    kind: Literal["CellList"] = "CellList"
    items: list[Cell]


class CellSpecPatch(_Strict):
    suspend: bool | None = None


class CellPatch(_Strict):
    """``PATCH /api/v1/cells/{name}``: ``{"spec": {"suspend": true}}`` (``{}`` changes nothing)."""

    spec: CellSpecPatch | None = None


class InjectFault(_Strict):
    """``POST /api/v1/cells/{name}/inject-fault``."""

    mode: Literal["sigkill", "exit", "segfault", "deadlock"]
    sub_index: int = Field(default=0, ge=0, le=1023)


class Ok(BaseModel):
    """miles' ``{"status": "ok"}``: the health check, and a command put on the run's bus
    (what follows is in the event log)."""

    status: Literal["ok"] = "ok"


class Status(BaseModel):
    """A failure, as Kubernetes' ``Status``."""

    apiVersion: Literal["v1"] = "v1"
    kind: Literal["Status"] = "Status"
    status: Literal["Failure"] = "Failure"
    message: str
    reason: Literal[
        "BadRequest",
        "Unauthorized",
        "NotFound",
        "MethodNotAllowed",
        "Conflict",
        "RequestEntityTooLarge",
        "UnsupportedMediaType",
        "InternalError",
        "ServiceUnavailable",
    ]
    code: int
