"""A contract server for the SGLang backend: FastAPI answering SGLang's documented reply
shapes (``actors/engine/sglang_api.py`` types the contract), in the variant of an older or
a newer server, and refusing every request body that SGLang's own
request classes refuse.

Each body is validated (in a process of its own, ``tests/sglang_validator.py``, since importing
SGLang patches ``transformers``) as SGLang's HTTP server validates it (pydantic over the installed
``io_struct`` class, as FastAPI does), and, stricter than SGLang, a field the class does not
know is refused too: SGLang would ignore it silently, which hides a misspelt field.
``/generate`` also goes through ``GenerateReqInput.normalize_batch_and_arguments``, SGLang's
JSON contract gate and ``SamplingParams(**sp).normalize`` / ``.verify(vocab_size)``.

The served "model" is a few named byte strings whose fingerprints are SGLang's CPU tensor
hash (first 8 bytes of sha256); their content is derived from the files of the directory a
``/update_weights_from_disk`` names, so loading the same directory again restores what it
served (the snapshot / reset / publish / compare protocol passes only then).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from actors.engine import sglang_api as api
from miles_events.rl.checksum import per_engine_checksum, per_gpu_checksum
from tests import sglang_validator

ALWAYS_SKIPPED = ("cos_sin_cache", "inv_freq", "freqs_cis", "_weight_fp32")
TENSOR_NAMES = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.rotary_emb.inv_freq",
    "lm_head.weight",
)
VOCAB_SIZE = 1000


@dataclass(frozen=True)
class Variant:
    """Which server version the contract server plays (SGLANG.md's version differences)."""

    name: str
    health: bool
    """``GET /health`` exists (newer); ``/health_generate`` always does."""
    model_info_path: str
    """``/model_info`` (newer) or only ``/get_model_info`` (older)."""
    get_weight_version: bool
    """``/get_weight_version`` answers; False: 404."""
    server_info_path: str
    pause_mode: bool
    """``/pause_generation`` takes ``{"mode"}`` (newer); older servers read no body."""
    flush_timeout: bool
    """``/flush_cache?timeout=`` is read (newer)."""
    selector: bool
    """``/update_weights_from_distributed`` knows ``selector``; an older server refuses it here."""
    weight_version_spans: bool
    """``meta_info.weight_versions`` spans (newer)."""
    require_begin_end: bool
    """Weight updates only between ``/begin_weight_update`` and ``/end_weight_update``."""
    parallelism_info_list: bool
    """``parallelism_info`` a list of dicts with a role (else one dict)."""


OLDER = Variant(
    name="older",
    health=False,
    model_info_path="/get_model_info",
    get_weight_version=False,
    server_info_path="/get_server_info",
    pause_mode=False,
    flush_timeout=False,
    selector=False,
    weight_version_spans=False,
    require_begin_end=False,
    parallelism_info_list=False,
)
NEWER = Variant(
    name="newer",
    health=True,
    model_info_path="/model_info",
    get_weight_version=False,
    server_info_path="/server_info",
    pause_mode=True,
    flush_timeout=True,
    selector=True,
    weight_version_spans=True,
    require_begin_end=True,
    parallelism_info_list=True,
)
VARIANTS = (OLDER, NEWER)


Refused = sglang_validator.Refused


def validate_request(path: str, body: Any) -> Any:
    """SGLang's reading of one request body (its fields, as attributes), validated by SGLang's
    own classes in the validator process; raises ``Refused`` with SGLang's error."""
    return types.SimpleNamespace(**sglang_validator.validate(path, body))


def _content(seed: str, name: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{name}".encode()).digest() * 4


def _directory_seed(path: str) -> str:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model path {path} is not a directory")
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def fingerprint(content: bytes) -> str:
    """SGLang's CPU tensor hash: the first 8 bytes of sha256, big-endian, as 16 hex digits."""
    return hashlib.sha256(content).digest()[:8].hex()


@dataclass
class ServerState:
    variant: Variant
    model_path: str
    tp_size: int = 1
    weight_version: str = "default"
    tensors: dict[str, bytes] = field(default_factory=dict)
    snapshot: dict[str, bytes] | None = None
    paused: str | None = None
    """The pause mode while paused."""
    busy_flushes: int = 0
    """The next this many ``/flush_cache`` calls answer 400 (requests still running)."""
    released: set[str] = field(default_factory=set)
    updating: bool = False
    """Between ``/begin_weight_update`` and ``/end_weight_update``."""
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    """(method, path with query, body) of every call, in order."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(path, reason) of every refused body."""
    receive_broadcasts: bool = False
    """Join each weight update group and take every tensor of ``/update_weights_from_distributed``
    from its broadcast, as SGLang's ranks do (``join_as_sglang``, ``receive_as_sglang``);
    unset, the distributed update only records the names."""
    process_groups: dict[str, Any] = field(default_factory=dict)
    received: dict[str, Any] = field(default_factory=dict)
    """name -> the last tensor received for it."""

    def load(self, seed: str) -> None:
        self.tensors = {name: _content(seed, name) for name in TENSOR_NAMES}

    def selected(self, skip: list[str]) -> dict[str, bytes]:
        return {
            name: value
            for name, value in self.tensors.items()
            if not any(part in name for part in ALWAYS_SKIPPED) and not any(part in name for part in skip)
        }


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "code": status}, status_code=status)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI()
    variant = state.variant

    async def body_of(request: Request, path: str, *, optional: bool = False) -> Any:
        raw = await request.body()
        query = f"?{request.url.query}" if request.url.query else ""
        body = json.loads(raw) if raw else None
        state.requests.append((request.method, path + query, body))
        if body is None and optional:
            return None
        try:
            return validate_request(path, body if body is not None else {})
        except Refused as error:
            state.refused.append((path, str(error)))
            raise

    def refusal(error: Refused) -> JSONResponse:
        return _error(str(error))

    @app.get(api.HEALTH_GENERATE)
    async def health_generate() -> Response:
        return Response(status_code=503 if "weights" in state.released else 200)

    if variant.health:

        @app.get(api.HEALTH)
        async def health() -> Response:
            return Response(status_code=200)

    @app.get(variant.model_info_path)
    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": state.model_path,
                "tokenizer_path": state.model_path,
                "is_generation": True,
                "weight_version": state.weight_version,
                "preferred_sampling_params": None,
            }
        )

    @app.get(variant.server_info_path)
    async def server_info() -> JSONResponse:
        return JSONResponse({"model_path": state.model_path, "tp_size": state.tp_size, "internal_states": []})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        if not variant.get_weight_version:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"weight_version": state.weight_version})

    @app.post(api.GENERATE)
    async def generate(request: Request) -> Response:
        try:
            obj = await body_of(request, api.GENERATE)
        except Refused as error:
            return refusal(error)
        if "weights" in state.released or "kv_cache" in state.released:
            return _error("the server's memory is released")
        batch = isinstance(obj.input_ids[0], list)
        prompts = obj.input_ids if batch else [obj.input_ids]
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        rids = obj.rid if isinstance(obj.rid, list) else [obj.rid] * len(prompts)
        replies = [
            _completion(state, ids, params[i % len(params)], rids[i], obj.return_logprob)
            for i, ids in enumerate(prompts)
        ]
        return JSONResponse(replies if batch else replies[0])

    def update_gate() -> JSONResponse | None:
        if variant.require_begin_end and not state.updating:
            return JSONResponse(
                {"success": False, "message": "no weight-update session: call /begin_weight_update first"},
                status_code=400,
            )
        return None

    @app.post(api.UPDATE_WEIGHTS_FROM_DISK)
    async def update_weights_from_disk(request: Request) -> Response:
        try:
            obj = await body_of(request, api.UPDATE_WEIGHTS_FROM_DISK)
        except Refused as error:
            return refusal(error)
        if (gate := update_gate()) is not None:
            return gate
        try:
            seed = _directory_seed(obj.model_path)
        except FileNotFoundError as error:
            return JSONResponse({"success": False, "message": str(error), "num_paused_requests": 0}, 400)
        state.load(seed)
        state.model_path = obj.model_path
        if obj.weight_version is not None:
            state.weight_version = obj.weight_version
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    @app.post(api.INIT_WEIGHTS_UPDATE_GROUP)
    async def init_weights_update_group(request: Request) -> Response:
        try:
            obj = await body_of(request, api.INIT_WEIGHTS_UPDATE_GROUP)
        except Refused as error:
            return refusal(error)
        if not 0 < obj.rank_offset < obj.world_size:
            return JSONResponse({"success": False, "message": "rank_offset outside the group"}, 400)
        if state.receive_broadcasts:
            try:
                state.process_groups[obj.group_name] = await anyio.to_thread.run_sync(
                    join_as_sglang, obj.master_address, obj.master_port, obj.rank_offset, obj.world_size,
                    obj.group_name, obj.backend,
                )  # fmt: skip
            except Exception as error:
                return JSONResponse(
                    {"success": False, "message": f"Failed to initialize custom process group: {error}."}
                )
        state.groups[obj.group_name] = {"rank_offset": obj.rank_offset, "world_size": obj.world_size}
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    @app.post(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    async def update_weights_from_distributed(request: Request) -> Response:
        raw = await request.body()
        if not variant.selector and "selector" in (json.loads(raw) if raw else {}):
            state.requests.append((request.method, api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, json.loads(raw)))
            state.refused.append((api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, "selector sent to an older server"))
            return _error("selector: this server version does not know the field")
        try:
            obj = await body_of(request, api.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
        except Refused as error:
            return refusal(error)
        if (gate := update_gate()) is not None:
            return gate
        if obj.group_name not in state.groups:
            return JSONResponse({"success": False, "message": f"no group {obj.group_name}"}, 400)
        if not len(obj.names) == len(obj.dtypes) == len(obj.shapes):
            return JSONResponse(
                {"success": False, "message": "names, dtypes and shapes differ in length"}, 400
            )
        if state.receive_broadcasts:
            group = state.process_groups[obj.group_name]
            received = await anyio.to_thread.run_sync(
                receive_as_sglang, group, obj.names, obj.dtypes, obj.shapes
            )
            state.received.update(received)
        for name in obj.names:
            state.tensors[name] = _content(f"distributed:{obj.group_name}", name)
        if obj.weight_version is not None:
            state.weight_version = obj.weight_version
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online."})

    @app.post(api.DESTROY_WEIGHTS_UPDATE_GROUP)
    async def destroy_weights_update_group(request: Request) -> Response:
        try:
            obj = await body_of(request, api.DESTROY_WEIGHTS_UPDATE_GROUP)
        except Refused as error:
            return refusal(error)
        state.groups.pop(obj.group_name, None)
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    @app.post(api.UPDATE_WEIGHT_VERSION)
    async def update_weight_version(request: Request) -> Response:
        try:
            obj = await body_of(request, api.UPDATE_WEIGHT_VERSION)
        except Refused as error:
            return refusal(error)
        state.weight_version = obj.new_version
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {obj.new_version}",
                "new_version": obj.new_version,
            }
        )

    @app.post(api.PAUSE_GENERATION)
    async def pause_generation(request: Request) -> Response:
        if variant.pause_mode:
            if not await request.body():  # FastAPI's answer to a missing required body
                state.requests.append((request.method, api.PAUSE_GENERATION, None))
                state.refused.append((api.PAUSE_GENERATION, "no body"))
                return JSONResponse(
                    {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required"}]}, 422
                )
            try:
                obj = await body_of(request, api.PAUSE_GENERATION)
            except Refused as error:
                return refusal(error)
            state.paused = obj.mode
        else:
            raw = await request.body()  # an older server reads no body
            state.requests.append((request.method, api.PAUSE_GENERATION, json.loads(raw) if raw else None))
            state.paused = "abort"
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post(api.CONTINUE_GENERATION)
    async def continue_generation(request: Request) -> Response:
        try:
            await body_of(request, api.CONTINUE_GENERATION)
        except Refused as error:
            return refusal(error)
        state.paused = None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route(api.FLUSH_CACHE, methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        query = f"?{request.url.query}" if request.url.query else ""
        state.requests.append((request.method, api.FLUSH_CACHE + query, None))
        if "timeout" in request.query_params and variant.flush_timeout:
            if float(request.query_params["timeout"]) < 0:
                return _error("timeout must be >= 0", 422)
        if state.busy_flushes > 0:
            state.busy_flushes -= 1
            return PlainTextResponse("Flush cache failed: there are running or waiting requests.\n", 400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.\n")

    @app.api_route(api.RELEASE_MEMORY_OCCUPATION, methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Response:
        try:
            obj = await body_of(request, api.RELEASE_MEMORY_OCCUPATION)
        except Refused as error:
            return refusal(error)
        state.released |= set(obj.tags or ("weights", "kv_cache", "cuda_graph"))
        return JSONResponse(None)

    @app.api_route(api.RESUME_MEMORY_OCCUPATION, methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Response:
        try:
            obj = await body_of(request, api.RESUME_MEMORY_OCCUPATION)
        except Refused as error:
            return refusal(error)
        state.released -= set(obj.tags or ("weights", "kv_cache", "cuda_graph"))
        return JSONResponse(None)

    @app.post(api.ABORT_REQUEST)
    async def abort_request(request: Request) -> Response:
        try:
            await body_of(request, api.ABORT_REQUEST)
        except Refused as error:
            return refusal(error)
        return Response(status_code=200)

    if variant.require_begin_end:

        @app.post(api.BEGIN_WEIGHT_UPDATE)
        async def begin_weight_update(request: Request) -> Response:
            try:
                await body_of(request, api.BEGIN_WEIGHT_UPDATE)
            except Refused as error:
                return refusal(error)
            state.updating = True
            return JSONResponse({"success": True, "message": "weight update session opened"})

        @app.post(api.END_WEIGHT_UPDATE)
        async def end_weight_update(request: Request) -> Response:
            try:
                await body_of(request, api.END_WEIGHT_UPDATE)
            except Refused as error:
                return refusal(error)
            state.updating = False
            return JSONResponse({"success": True, "message": "weight update session closed"})

    @app.api_route(api.WEIGHTS_CHECKER, methods=["GET", "POST"])
    async def weights_checker(request: Request) -> Response:
        try:
            obj = await body_of(request, api.WEIGHTS_CHECKER)
        except Refused as error:
            return refusal(error)
        return _check(state, obj.action, list(obj.skip_tensor_list or []))

    return app


def join_as_sglang(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> Any:
    """Rank ``rank_offset`` (tensor-parallel rank 0) joins the group as SGLang 0.5.23's
    ``WeightUpdater.init_weights_update_group`` does, through its ``init_custom_process_group``
    (``sglang.srt.utils.common``): torch's rendezvous at ``tcp://address:port``, its store
    behind a ``PrefixStore`` of the group's name, torch's ``_new_process_group_helper``.
    (SGLang itself is not imported into this process: it patches ``transformers``.)"""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    store, rank, world_size = next(
        rendezvous(
            f"tcp://{master_address}:{master_port}", rank_offset, world_size, timeout=default_pg_timeout
        )
    )
    store.set_timeout(default_pg_timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=default_pg_timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def receive_as_sglang(
    group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> dict[str, Any]:
    """Every tensor of one request, each from a broadcast of its own from rank 0, as SGLang
    0.5.23's ``WeightUpdater.receive_weights_from_distributed`` takes them."""
    import torch
    import torch.distributed

    weights, handles = {}, []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(torch.distributed.broadcast(weight, src=0, group=group, async_op=True))
        weights[name] = weight
    for handle in handles:
        handle.wait()
    return weights


def _completion(
    state: ServerState, ids: list[int], sp: dict[str, Any], rid: str | None, logprob: bool
) -> dict:
    max_new = sp.get("max_new_tokens", 128)
    stops = set(sp.get("stop_token_ids") or ())
    output: list[int] = []
    finish: dict[str, Any] = {"type": "length", "length": max_new}
    if state.paused == "abort":
        finish = {"type": "abort", "message": "Abort before prefill"}
    else:
        for step in range(max_new):
            token = (ids[-1] + 7 * (step + 1)) % VOCAB_SIZE
            output.append(token)
            if token in stops:
                finish = {"type": "stop", "matched": token}
                break
    meta: dict[str, Any] = {
        "id": rid or hashlib.sha256(repr(ids).encode()).hexdigest()[:32],
        "finish_reason": finish,
        "prompt_tokens": len(ids),
        "completion_tokens": len(output),
        "cached_tokens": 0,
        "weight_version": state.weight_version,
        "e2e_latency": 0.001,
    }
    if state.variant.weight_version_spans:
        meta["weight_versions"] = [{"version": state.weight_version, "start": 0, "end": len(output)}]
    if logprob:
        meta["output_token_logprobs"] = [[-0.25 - 0.001 * i, t, None] for i, t in enumerate(output)]
        meta["input_token_logprobs"] = []
    return {"text": " ".join(map(str, output)), "output_ids": output, "meta_info": meta}


def _check(state: ServerState, action: str, skip: list[str]) -> Response:
    selected = state.selected(skip)
    if action == "checksum":
        ranks = []
        for tp_rank in range(state.tp_size):
            checksums = {name: fingerprint(value + bytes([tp_rank])) for name, value in selected.items()}
            info = {
                "tp_rank": tp_rank,
                "tp_size": state.tp_size,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": tp_rank,
                "size": state.tp_size,
            }
            parallelism = [{**info, "role": "target"}] if state.variant.parallelism_info_list else info
            ranks.append(
                {
                    "checksums": checksums,
                    "per_gpu_checksum": per_gpu_checksum(checksums),
                    "parallelism_info": parallelism,
                }
            )
        return JSONResponse(
            {
                "success": True,
                "message": "Success.",
                "ranks": ranks,
                "per_engine_checksum": per_engine_checksum(r["per_gpu_checksum"] for r in ranks),
            }
        )
    if action == "snapshot":
        state.snapshot = dict(state.tensors)
    elif action == "reset_tensors":
        for name in selected:
            state.tensors[name] = _content(f"random:{time.time_ns()}", name)
    elif action == "compare":
        if state.snapshot is None:
            return JSONResponse({"success": False, "message": "no snapshot to compare against"}, 400)
        differ = [name for name in selected if state.snapshot.get(name) != state.tensors[name]]
        if differ:
            lines = "\n".join(f"name={name} max_abs_err=1.0" for name in differ)
            return JSONResponse({"success": False, "message": f"check tensor equality failed:\n{lines}"}, 400)
    else:
        return JSONResponse({"success": False, "message": f"Unsupported action={action!r}"}, 400)
    return JSONResponse({"success": True, "message": "Success."})


@dataclass
class ContractServer:
    state: ServerState
    url: str


@contextmanager
def serve(variant: Variant, model_path: str, *, tp_size: int = 1, port: int = 0) -> Iterator[ContractServer]:
    """Run a contract server on 127.0.0.1 (``port``, or a free one) in a thread; its model
    starts from ``model_path`` (a directory) as version ``"default"``."""
    state = ServerState(variant=variant, model_path=model_path, tp_size=tp_size)
    state.load(_directory_seed(model_path))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the contract server did not start")
        time.sleep(0.01)
    try:
        yield ContractServer(state=state, url=f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
