"""SGLang's HTTP contract, typed: every request an SGLang backend sends and every reply it
reads, as msgspec Structs and pure functions (no process, no socket, no torch).

The shapes follow SGLang's own request classes (``srt/managers/io_struct.py``,
``srt/sampling/sampling_params.py``) and how slime and miles drive a server. Where server
versions differ, every variant parses:

- ``/health_generate`` (always) or the cheaper ``/health`` (newer);
- ``/model_info`` or ``/get_model_info``, ``/server_info`` or ``/get_server_info``;
- ``meta_info.weight_version`` alone, or with ``weight_versions`` spans (newer);
- ``/pause_generation`` with a ``mode`` (newer) or no body (older);
- ``/flush_cache`` with ``?timeout=`` (newer) or without; 400 while requests run;
- ``/update_weights_from_distributed`` with a ``selector`` (newer) or without;
- ``/begin_weight_update`` and ``/end_weight_update`` around an update (newer only);
- ``parallelism_info`` of a ``checksum`` rank as one dict or a list of dicts with a role.

A request sends every field that has a value, defaults included (server defaults differ
between versions: ``flush_cache`` of ``/update_weights_from_distributed``, ``abort_all_requests``
of ``/update_weight_version``), and leaves out those that are None, so an older server never
sees a field it does not know; unknown reply fields are ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from miles_events.rl.checksum import ChecksumReplyError, ordered_ranks
from schemas.checksums import EngineChecksumReport, WeightsCheckResult

# --- endpoints ----------------------------------------------------------------------------------

HEALTH_GENERATE = "/health_generate"
HEALTH = "/health"
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
"""Tried in order; an older server answers 404 to the first."""
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
GENERATE = "/generate"
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
FLUSH_CACHE = "/flush_cache"
RELEASE_MEMORY_OCCUPATION = "/release_memory_occupation"
RESUME_MEMORY_OCCUPATION = "/resume_memory_occupation"
ABORT_REQUEST = "/abort_request"
WEIGHTS_CHECKER = "/weights_checker"
BEGIN_WEIGHT_UPDATE = "/begin_weight_update"
END_WEIGHT_UPDATE = "/end_weight_update"

WEIGHT_UPDATE_GROUP = "weight_update_group"
"""slime's and miles' ``group_name``."""
MAX_BUCKET_BYTES = 512 * 1024**2
"""slime's and miles' bucket size for ``update_weights_from_distributed``."""

_encoder = msgspec.json.Encoder()


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value


class Request(msgspec.Struct, kw_only=True):
    """A JSON request body: every field with a value is sent, None fields are not."""

    def to_dict(self) -> dict[str, Any]:
        return _without_none(msgspec.to_builtins(self))  # type: ignore[no-any-return]

    def body(self) -> bytes:
        return _encoder.encode(self.to_dict())


class Reply(msgspec.Struct, kw_only=True):
    """A JSON reply; fields SGLang adds later are ignored."""


# --- launch -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchArgs:
    """What ``python -m sglang.launch_server`` is started with, for one engine."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    nccl_port: int | None = None
    base_gpu_id: int | None = None
    """The first of the server's GPUs among those its process sees (several servers of one
    process's engines on one host)."""
    random_seed: int | None = None
    enable_memory_saver: bool = False
    """Needed for ``/release_memory_occupation`` (offload)."""
    enable_metrics: bool = False
    skip_server_warmup: bool = False
    extra_args: tuple[str, ...] = ()
    """Appended as they are (any other ``ServerArgs`` flag)."""


def launch_argv(args: LaunchArgs, python: str = "python") -> list[str]:
    """The command line that starts one SGLang server for ``args``."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", args.model_path, "--host", args.host]
    argv += ["--port", str(args.port), "--tp-size", str(args.tp_size), "--dp-size", str(args.dp_size)]
    if args.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", repr(args.mem_fraction_static)]
    if args.nccl_port is not None:
        argv += ["--nccl-port", str(args.nccl_port)]
    if args.base_gpu_id is not None:
        argv += ["--base-gpu-id", str(args.base_gpu_id)]
    if args.random_seed is not None:
        argv += ["--random-seed", str(args.random_seed)]
    for flag, on in (
        ("--enable-memory-saver", args.enable_memory_saver),
        ("--enable-metrics", args.enable_metrics),
        ("--skip-server-warmup", args.skip_server_warmup),
    ):
        if on:
            argv.append(flag)
    return [*argv, *args.extra_args]


# --- health, info, errors -------------------------------------------------------------------------


def is_ready(status: int) -> bool:
    """``GET /health_generate`` (or ``/health``): 200 once the server generates; 503 while it
    cannot (a one-token generation timed out), or a connection error before it listens."""
    return status == 200


class ModelInfo(Reply):
    """``GET /model_info`` (alias ``/get_model_info``)."""

    model_path: str = ""
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | None = None
    """The served version; None where the server does not report it."""


class ErrorReply(Reply):
    """HTTP 400 on a request that fails validation."""

    object: str = "error"
    message: str = ""
    code: int = 400


def error_message(status: int, body: bytes) -> str:
    """One line for a failed call: the server's message where it gave one."""
    try:
        reply = msgspec.json.decode(body, type=ErrorReply)
        message = reply.message
    except (msgspec.DecodeError, msgspec.ValidationError):
        message = body.decode(errors="replace").strip()
    return f"HTTP {status}: {message or 'no message'}"


# --- generation -----------------------------------------------------------------------------------


class SamplingParamsBody(Request):
    """``sampling_params`` of ``/generate`` (SGLang's ``SamplingParams``)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """Below 1e-6 is greedy."""
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    """True keeps a matched stop string in ``text`` (slime sends true)."""
    n: int = 1
    sampling_seed: int | None = None


class GenerateRequest(Request):
    """``POST /generate`` with token ids: one prompt, or a batch (the reply is then a list)."""

    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] = msgspec.field(
        default_factory=SamplingParamsBody
    )
    return_logprob: bool = False
    logprob_start_len: int = -1
    """-1: logprobs of the output tokens only."""
    top_logprobs_num: int = 0
    rid: str | list[str] | None = None
    stream: bool = False


def generate_request(
    input_ids: Sequence[Sequence[int]],
    sampling: SamplingParamsBody,
    *,
    return_logprob: bool = True,
    rids: Sequence[str] | None = None,
) -> GenerateRequest:
    """One ``/generate`` call for a batch of tokenized prompts, all sampled alike."""
    if not input_ids:
        raise ValueError("a /generate batch needs at least one prompt")
    if rids is not None and len(rids) != len(input_ids):
        raise ValueError(f"{len(rids)} request ids for {len(input_ids)} prompts")
    return GenerateRequest(
        input_ids=[list(ids) for ids in input_ids],
        sampling_params=sampling,
        return_logprob=return_logprob,
        rid=list(rids) if rids is not None else None,
    )


class FinishReason(Reply):
    """``{"type":"stop","matched":...}``, ``{"type":"length","length":...}`` or
    ``{"type":"abort","message":...}``."""

    type: str
    matched: int | str | None = None
    """``stop``: the token id (EOS or a stop token) or the stop string that matched."""
    length: int | None = None
    message: str | None = None


class WeightVersionSpan(Reply):
    """Newer servers: which weight version produced output tokens ``start`` to ``end``."""

    version: str
    start: int
    end: int


class MetaInfo(Reply):
    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    """The version the server held when the request finished."""
    weight_versions: list[WeightVersionSpan] | None = None
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    """``[logprob, token_id, text_or_null]`` per output token, with ``return_logprob``."""


class GenerateReply(Reply):
    text: str = ""
    output_ids: list[int] = []
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)

    @property
    def finish(self) -> Literal["stop", "length", "abort"]:
        """slime's COMPLETED / TRUNCATED / ABORTED, as ``stop`` / ``length`` / ``abort``."""
        reason = self.meta_info.finish_reason
        if reason is None:
            raise ValueError(f"request {self.meta_info.id!r} has no finish_reason (not finished)")
        if reason.type not in ("stop", "length", "abort"):
            raise ValueError(f"request {self.meta_info.id!r}: unknown finish_reason type {reason.type!r}")
        return reason.type  # type: ignore[return-value]

    @property
    def output_logprobs(self) -> list[float]:
        """The logprob of each output token, in order (requires ``return_logprob``)."""
        entries = self.meta_info.output_token_logprobs
        if entries is None:
            raise ValueError(f"request {self.meta_info.id!r} has no output_token_logprobs (return_logprob?)")
        if len(entries) != len(self.output_ids):
            raise ValueError(
                f"request {self.meta_info.id!r}: {len(entries)} output logprobs for {len(self.output_ids)} tokens"
            )
        for (logprob, token, _), expected in zip(entries, self.output_ids, strict=True):
            if logprob is None or token != expected:
                raise ValueError(
                    f"request {self.meta_info.id!r}: logprob entry for token {token} does not match"
                )
        return [float(logprob) for logprob, _, _ in entries]  # type: ignore[arg-type]

    @property
    def weight_version(self) -> str:
        """The version of the weights that finished the request (the last span's on newer
        servers, which must agree with ``meta_info.weight_version`` where both are given)."""
        spans = self.meta_info.weight_versions
        version = self.meta_info.weight_version
        if spans:
            if version is not None and spans[-1].version != version:
                raise ValueError(
                    f"weight_version {version!r} disagrees with its last span {spans[-1].version!r}"
                )
            return spans[-1].version
        if version is None:
            raise ValueError(f"request {self.meta_info.id!r} reports no weight_version")
        return version

    @property
    def weight_version_spans(self) -> list[WeightVersionSpan]:
        """The spans where given; else one span of ``weight_version`` over every output token."""
        if self.meta_info.weight_versions:
            return list(self.meta_info.weight_versions)
        return [WeightVersionSpan(version=self.weight_version, start=0, end=len(self.output_ids))]


_one_reply = msgspec.json.Decoder(GenerateReply)
_many_replies = msgspec.json.Decoder(list[GenerateReply])


def parse_generate_reply(body: bytes) -> list[GenerateReply]:
    """A ``/generate`` reply: one object for one prompt, a list for a batch."""
    stripped = body.lstrip()
    if stripped.startswith(b"["):
        return _many_replies.decode(body)
    return [_one_reply.decode(body)]


# --- weight publication ----------------------------------------------------------------------------


class SuccessReply(Reply):
    """``{"success", "message"}``, the reply of every weight-update endpoint."""

    success: bool
    message: str = ""


def parse_success_reply(status: int, body: bytes, reply: type[SuccessReply] = SuccessReply) -> SuccessReply:
    """A weight-update reply: ``{"success", "message", ...}`` with 200, or with 400 when the
    update failed; any other failure (a validation error, a crash) is an unsuccessful reply
    carrying the server's message."""
    try:
        parsed = msgspec.json.decode(body, type=reply)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return reply(success=False, message=error_message(status, body))
    if status != 200 and parsed.success:
        return reply(success=False, message=error_message(status, body))
    return parsed


class UpdateWeightsFromDiskRequest(Request):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateWeightsFromDiskReply(SuccessReply):
    num_paused_requests: int = 0


class InitWeightsUpdateGroupRequest(Request):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = WEIGHT_UPDATE_GROUP
    backend: str = "nccl"


def init_weights_update_group_requests(
    engine_gpus: Sequence[int], master_address: str, master_port: int, group_name: str = WEIGHT_UPDATE_GROUP
) -> list[InitWeightsUpdateGroupRequest]:
    """One request per engine: the trainer's source rank is rank 0 of the group, engine i's
    GPUs follow those of the engines before it (``rank_offset = 1 + sum(gpus[:i])``), and the
    group is every engine GPU plus that rank."""
    if not engine_gpus or any(gpus < 1 for gpus in engine_gpus):
        raise ValueError(f"every engine needs at least one GPU, got {list(engine_gpus)}")
    world_size = sum(engine_gpus) + 1
    offsets = [1 + sum(engine_gpus[:i]) for i in range(len(engine_gpus))]
    return [
        InitWeightsUpdateGroupRequest(
            master_address=master_address,
            master_port=master_port,
            rank_offset=offset,
            world_size=world_size,
            group_name=group_name,
        )
        for offset in offsets
    ]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a broadcast: its name, dtype name as SGLang spells it (``"bfloat16"``)
    and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * dtype_size(self.dtype)


_DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype named as SGLang names it (torch's name less ``torch.``)."""
    name = dtype.removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPE_SIZES[name]


def bucket_tensors(specs: Iterable[TensorSpec], max_bytes: int = MAX_BUCKET_BYTES) -> list[list[TensorSpec]]:
    """The tensors in order, cut into consecutive buckets of at most ``max_bytes`` each; a
    tensor larger than that is a bucket of its own (it cannot be split)."""
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.num_bytes > max_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.num_bytes
    if current:
        buckets.append(current)
    return buckets


class UpdateWeightsFromDistributedRequest(Request):
    """One bucket, sent while the trainer broadcasts its tensors in the same order; the
    reply comes when the broadcasts end."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = WEIGHT_UPDATE_GROUP
    flush_cache: bool = False
    weight_version: str | None = None
    selector: str | None = None
    """Newer servers only; left out when unset."""


def update_weights_from_distributed_requests(
    specs: Iterable[TensorSpec],
    weight_version: str,
    *,
    max_bytes: int = MAX_BUCKET_BYTES,
    group_name: str = WEIGHT_UPDATE_GROUP,
    selector: str | None = None,
) -> list[UpdateWeightsFromDistributedRequest]:
    """One request per bucket. Only the last carries ``flush_cache`` and the new
    ``weight_version``, so the server switches version once every bucket is in."""
    buckets = bucket_tensors(specs, max_bytes)
    return [
        UpdateWeightsFromDistributedRequest(
            names=[s.name for s in bucket],
            dtypes=[s.dtype.removeprefix("torch.") for s in bucket],
            shapes=[list(s.shape) for s in bucket],
            group_name=group_name,
            flush_cache=last,
            weight_version=weight_version if last else None,
            selector=selector,
        )
        for last, bucket in ((i == len(buckets) - 1, b) for i, b in enumerate(buckets))
    ]


class DestroyWeightsUpdateGroupRequest(Request):
    group_name: str = WEIGHT_UPDATE_GROUP


class UpdateWeightVersionRequest(Request):
    new_version: str
    abort_all_requests: bool = False
    """SGLang's default is true (abort everything running); a publication sends false."""


class UpdateWeightVersionReply(SuccessReply):
    new_version: str | None = None


PauseMode = Literal["abort", "retract", "in_place"]


class PauseGenerationRequest(Request):
    """Newer servers: how running requests pause (default ``abort``; miles: ``retract``)."""

    mode: PauseMode = "abort"


def pause_generation_body(mode: PauseMode | None) -> bytes:
    """The body of ``/pause_generation``: ``{"mode": ...}``, or none when ``mode`` is None.
    Older servers read no body (and ignore one); newer ones require a JSON object, so a
    client sends a mode unless it knows the server predates them."""
    return b"" if mode is None else PauseGenerationRequest(mode=mode).body()


class ContinueGenerationRequest(Request):
    torch_empty_cache: bool = False


class StatusReply(Reply):
    """``/pause_generation`` and ``/continue_generation``: ``{"status":"ok", ...}``."""

    status: str = "ok"
    message: str = ""


def flush_cache_path(timeout: float | None = None) -> str:
    """``/flush_cache``, with ``?timeout=`` for newer servers (how long the server itself waits
    for running requests before it answers 400)."""
    return FLUSH_CACHE if timeout is None else f"{FLUSH_CACHE}?timeout={timeout:g}"


class FlushCacheBusy(RuntimeError):
    """``/flush_cache`` kept answering 400 (requests still running) until the deadline."""


def flush_cache_with_retry(
    send: Callable[[], tuple[int, bytes]],
    *,
    timeout: float = 60.0,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Call ``send`` (one ``/flush_cache``, returning status and body) until it answers 200;
    400 means requests are still running, so it is retried every ``interval`` seconds for
    up to ``timeout``. Returns the attempts made. Raises ``FlushCacheBusy`` at the deadline
    and ``RuntimeError`` on any other status."""
    deadline = clock() + timeout
    attempts = 0
    while True:
        attempts += 1
        status, body = send()
        if status == 200:
            return attempts
        if status != 400:
            raise RuntimeError(f"/flush_cache failed: {error_message(status, body)}")
        if clock() + interval > deadline:
            raise FlushCacheBusy(
                f"/flush_cache still busy after {attempts} attempts in {timeout:g} s: {error_message(status, body)}"
            )
        sleep(interval)


MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]


def memory_tags(tags: Iterable[str]) -> list[MemoryTag]:
    """``tags`` checked against SGLang's memory kinds (``ValueError`` naming an unknown one)."""
    return msgspec.convert(list(tags), list[MemoryTag])


class ReleaseMemoryOccupationRequest(Request):
    """``tags`` None: everything. The server must be idle (flush its cache first)."""

    tags: list[MemoryTag] | None = None


class ResumeMemoryOccupationRequest(ReleaseMemoryOccupationRequest):
    pass


class AbortRequest(Request):
    rid: str = ""
    abort_all: bool = False


class EndWeightUpdateRequest(Request):
    """Sent as ``{}``."""


class BeginWeightUpdateRequest(Request):
    """Newer servers only, and required around an update by some."""

    selector: str = "all"


# --- the weights checker ---------------------------------------------------------------------------

CheckerAction = Literal["checksum", "snapshot", "reset_tensors", "compare"]
CHECKER_ACTIONS: tuple[str, ...] = ("checksum", "snapshot", "reset_tensors", "compare")


class WeightsCheckerRequest(Request):
    action: CheckerAction
    allow_quant_error: bool = False
    selector: Literal["all", "target", "draft"] = "all"
    skip_tensor_list: list[str] = []


_checksum_reply = msgspec.json.Decoder(EngineChecksumReport)


def parse_checksum_reply(status: int, body: bytes) -> EngineChecksumReport:
    """The ``checksum`` action's reply (either ``parallelism_info`` shape), its ranks in rank
    order; a failed call is an unsuccessful report carrying the server's message.

    Raises ``ChecksumReplyError`` for a body that does not decode as the reply, and for a
    successful one whose ranks ``ordered_ranks`` refuses (a rank reported twice, a rank
    without tensors, roles naming different GPU ranks, no ranks at all).
    """
    if status != 200:
        return EngineChecksumReport(success=False, message=error_message(status, body))
    try:
        report = _checksum_reply.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ChecksumReplyError(f"the checksum reply is malformed: {' '.join(str(error).split())}") from None
    if not report.success:
        return report
    return msgspec.structs.replace(report, ranks=[rank for _, rank in ordered_ranks(report)])


def parse_check_reply(
    action: str, status: int, body: bytes, *, weight_version: str = "default", num_tensors: int = 0
) -> WeightsCheckResult:
    """The reply to ``snapshot``, ``reset_tensors`` or ``compare``. A failed compare is HTTP
    400 ``check tensor equality failed: ...``; the server names no tensor counts, so
    ``weight_version`` and ``num_tensors`` are the caller's."""
    if status != 200:
        return WeightsCheckResult(
            success=False, message=error_message(status, body), action=action, weight_version=weight_version
        )
    try:
        reply = msgspec.json.decode(body, type=SuccessReply)
        success, message = reply.success, reply.message
    except (msgspec.DecodeError, msgspec.ValidationError):
        success, message = True, body.decode(errors="replace").strip()
    return WeightsCheckResult(
        success=success,
        message=message,
        action=action,
        weight_version=weight_version,
        num_tensors=num_tensors,
    )


def decode(body: bytes, reply: type[Any]) -> Any:
    """A reply body as ``reply`` (one of the Structs here)."""
    return msgspec.json.decode(body, type=reply)
