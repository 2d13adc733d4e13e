"""SGLang's own request classes, in a process of their own.

Importing SGLang patches ``transformers`` process-wide (``sglang.srt.utils.hf_transformers_patches``),
so the tests never import it themselves: ``validate`` and ``call`` send one JSON line to
``python -m tests.sglang_validator`` (started once, on first use) and read one back. The
process validates a body as SGLang's HTTP server does (pydantic over the ``io_struct``
class, as FastAPI does; for ``/generate`` also ``normalize_batch_and_arguments``, SGLang's
JSON contract gate and ``SamplingParams(**sp).normalize`` / ``.verify``) and, stricter than
SGLang, refuses a field the class does not know: SGLang ignores it, which hides a misspelt
field.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import pydantic

from actors.engine import sglang_api as api

VOCAB_SIZE = 1000
REPO = Path(__file__).resolve().parents[1]


def available() -> bool:
    """Whether SGLang is installed (without importing it)."""
    return importlib.util.find_spec("sglang") is not None


class _CharTokenizer:
    """What ``SamplingParams.normalize`` asks of the server's tokenizer: one id per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB_SIZE for c in text]


class Refused(ValueError):
    """A request body SGLang's classes (or this server's strictness) refuse."""


_IO_CLASS = {
    api.UPDATE_WEIGHTS_FROM_DISK: "UpdateWeightFromDiskReqInput",
    api.INIT_WEIGHTS_UPDATE_GROUP: "InitWeightsUpdateGroupReqInput",
    api.UPDATE_WEIGHTS_FROM_DISTRIBUTED: "UpdateWeightsFromDistributedReqInput",
    api.DESTROY_WEIGHTS_UPDATE_GROUP: "DestroyWeightsUpdateGroupReqInput",
    api.UPDATE_WEIGHT_VERSION: "UpdateWeightVersionReqInput",
    api.PAUSE_GENERATION: "PauseGenerationReqInput",
    api.CONTINUE_GENERATION: "ContinueGenerationReqInput",
    api.RELEASE_MEMORY_OCCUPATION: "ReleaseMemoryOccupationReqInput",
    api.RESUME_MEMORY_OCCUPATION: "ResumeMemoryOccupationReqInput",
    api.WEIGHTS_CHECKER: "CheckWeightsReqInput",
    api.BEGIN_WEIGHT_UPDATE: "BeginWeightUpdateReqInput",
    api.END_WEIGHT_UPDATE: "EndWeightUpdateReqInput",
    api.ABORT_REQUEST: "AbortReq",
}
"""Endpoint -> its request class in ``sglang.srt.managers.io_struct``."""


def validate_here(path: str, body: Any) -> Any:
    """Validate one request body as SGLang does, in this process, returning SGLang's object;
    raise ``Refused`` with SGLang's error otherwise."""
    classes = _classes()
    if not isinstance(body, dict):
        raise Refused(f"{path}: the body must be a JSON object, got {type(body).__name__}")
    if path == api.GENERATE:
        return _validate_generate(classes, body)
    cls = getattr(classes.io_struct, _IO_CLASS[path])
    known = {f.name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise Refused(f"{path}: {cls.__name__} has no field {', '.join(unknown)}")
    try:
        return pydantic.TypeAdapter(cls).validate_python(body)
    except (pydantic.ValidationError, TypeError, ValueError) as error:
        raise Refused(f"{path}: {cls.__name__} refuses the body: {error}") from error


def _validate_generate(classes: Any, body: dict[str, Any]) -> Any:
    io = classes.io_struct
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    known = {f.name for f in dataclasses.fields(io.GenerateReqInput)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise Refused(f"/generate: GenerateReqInput has no field {', '.join(unknown)}")
    contract = generate_contract_error(body)
    if contract is not None:
        raise Refused(f"/generate: SGLang's contract gate refuses the body: {contract}")
    try:
        request = pydantic.TypeAdapter(io.GenerateReqInput).validate_python(body)
        request.normalize_batch_and_arguments()
        params = request.sampling_params
        for sp in params if isinstance(params, list) else [params]:
            sp_known = {f.name for f in msgspec.structs.fields(classes.sampling_params.SamplingParams)}
            sp_unknown = sorted(set(sp) - sp_known)
            if sp_unknown:
                raise Refused(f"/generate: SamplingParams has no field {', '.join(sp_unknown)}")
            sampling = classes.sampling_params.SamplingParams(**sp)
            sampling.normalize(_CharTokenizer())
            sampling.verify(VOCAB_SIZE)
    except Refused:
        raise
    except (pydantic.ValidationError, TypeError, ValueError) as error:
        raise Refused(f"/generate: SGLang refuses the body: {error}") from error
    return request


def _classes() -> Any:
    from tests import sglang_classes

    loaded = sglang_classes.load()
    if loaded is None:
        raise RuntimeError("SGLang is not installed: its request classes validate every body")
    return loaded


def _plain(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return {f: _plain(getattr(value, f)) for f in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


_GENERATE_FIELDS = ("input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream")


def _launch_args(argv: list[str]) -> dict[str, Any]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        return vars(parser.parse_args(argv))
    except (argparse.ArgumentError, SystemExit) as error:
        raise Refused(f"ServerArgs refuses {argv}: {error}") from error


def _pause_statuses(bodies: list[str]) -> list[int]:
    """What SGLang's ``/pause_generation`` signature (a required ``PauseGenerationReqInput``
    body) answers to each body, through FastAPI."""
    from typing import Annotated

    from fastapi import Body, FastAPI
    from fastapi.testclient import TestClient

    io = _classes().io_struct

    async def pause(obj):  # type: ignore[no-untyped-def]
        return {"mode": obj.mode}

    # Set here, not written: this module's annotations are strings FastAPI cannot resolve.
    pause.__annotations__ = {"obj": Annotated[io.PauseGenerationReqInput, Body()]}
    app = FastAPI()
    app.post(api.PAUSE_GENERATION)(pause)
    client = TestClient(app)
    return [
        client.post(
            api.PAUSE_GENERATION, content=body.encode(), headers={"Content-Type": "application/json"}
        ).status_code
        for body in bodies
    ]


def _serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "validate":
                obj = validate_here(request["path"], request["body"])
                if request["path"] == api.GENERATE:
                    value = {name: _plain(getattr(obj, name)) for name in _GENERATE_FIELDS}
                else:
                    value = _plain(obj)
            elif request["op"] == "launch_args":
                value = _plain(_launch_args(request["argv"]))
            elif request["op"] == "pause_statuses":
                value = _pause_statuses(request["bodies"])
            else:
                raise ValueError(f"unknown op {request['op']!r}")
            reply = {"ok": True, "value": value}
        except Refused as error:
            reply = {"ok": False, "refused": str(error)}
        except Exception as error:
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class _Client:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen[str] | None = None

    def call(self, request: dict[str, Any]) -> Any:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self.process = subprocess.Popen(
                    [sys.executable, "-W", "ignore", "-m", "tests.sglang_validator"],
                    cwd=REPO,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the SGLang validator process exited")
        reply = json.loads(line)
        if reply["ok"]:
            return reply["value"]
        if "refused" in reply:
            raise Refused(reply["refused"])
        raise RuntimeError(f"the SGLang validator failed: {reply['error']}")


_client = _Client()


def validate(path: str, body: Any) -> dict[str, Any]:
    """SGLang's reading of ``body`` at ``path`` as plain data; ``Refused`` if SGLang refuses it."""
    return _client.call({"op": "validate", "path": path, "body": body})  # type: ignore[no-any-return]


def launch_args(argv: list[str]) -> dict[str, Any]:
    """``ServerArgs``' CLI parser's reading of ``argv`` (``Refused`` if it refuses them)."""
    return _client.call({"op": "launch_args", "argv": argv})  # type: ignore[no-any-return]


def pause_statuses(bodies: list[str]) -> list[int]:
    return _client.call({"op": "pause_statuses", "bodies": bodies})  # type: ignore[no-any-return]


if __name__ == "__main__":
    _serve()
