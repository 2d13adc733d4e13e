"""The inference-engine seam the Generator is written against.

An engine serves one copy of the policy: it samples completions, loads published weights
from a data-plane handle under a version, fingerprints what it serves, and answers SGLang's
four ``/weights_checker`` actions with typed replies (``schemas.checksums``). The embedded
``TorchEngine`` implements it in process; ``SglangEngine`` (``sglang_engine.py``) implements
it over an SGLang server's HTTP API (``/generate``, ``/update_weights_from_disk``,
``/weights_checker``) and ``VllmEngine`` (``vllm_engine.py``) over a vLLM server's.

The module also holds the engine-independent pieces of those contracts: stop-string
matching and the snapshot comparison (bitwise, or within one ULP).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miles_events.bus.cancel import Cancellation
from miles_events.rl.checksum import per_engine_checksum, per_gpu_checksum
from miles_events.transport.base import Transport
from schemas.checksums import (
    EngineChecksumReport,
    ParallelismInfo,
    RankChecksums,
    Selector,
    TensorCheckAction,
    WeightsCheckResult,
)
from schemas.config import Config
from schemas.data import DataRef

if TYPE_CHECKING:
    import torch

TENSOR_CHECK_ACTIONS: tuple[str, ...] = ("snapshot", "reset_tensors", "compare")
"""The weight-checker actions besides ``checksum``."""

_SIGNED_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
MAX_NAMES_IN_MESSAGE = 10
"""Tensor names listed in a message at most; the rest are counted."""

GenerateRequest = str | Sequence[int]
"""A prompt: text (tokenized by the engine) or token ids used as they are."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of completions.

    ``temperature == 0`` is greedy decoding. ``top_p`` keeps the smallest set of most
    likely tokens whose probability reaches ``top_p``. Generation stops at an EOS token,
    at one of the ``stop`` strings, or after ``max_new_tokens`` tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """Keep sampling past EOS tokens (until a stop string or the length), as SGLang's and
    vLLM's ``ignore_eos``: for benchmarks of a fixed number of tokens."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """One sampled completion.

    ``response_ids`` are every token the engine sampled, including a final EOS token and
    the token(s) that completed a stop string, so that the trainer learns to stop.
    ``response`` is the text the reward function sees: EOS and other special tokens are
    left out, and the text is cut just before a matched stop string (SGLang's default).
    ``response_logprobs[i]`` is the log-probability of ``response_ids[i]``: see
    ``TorchEngine.generate`` for which distribution.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response: str
    finish_reason: Literal["stop", "length"]
    weight_version: str
    matched_stop: str | None = None
    """The stop string that ended the completion; None for EOS or length."""
    version_spans: list[tuple[int, str]] = field(default_factory=list)
    """(first response token, weight version) of each version the completion was sampled
    with, in order, when a load landed while it was generated (``rollout.partial``); empty:
    every token is of ``weight_version``."""


class Engine(ABC):
    """One inference engine (one served copy of the policy)."""

    name: str

    @classmethod
    @abstractmethod
    def from_config(cls, config: Config, *, index: int, name: str, transport: Transport) -> Engine:
        """Engine ``index`` of a run, called ``name``, bootstrapped from ``model.path``;
        publications reach it through ``transport`` (the run's data plane)."""

    @property
    @abstractmethod
    def weight_version(self) -> str:
        """The version of the weights served now: ``"default"`` until the first load."""

    @abstractmethod
    def generate(
        self,
        requests: Sequence[GenerateRequest],
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        cancel: Cancellation | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample one completion per request, in request order.

        ``cancel`` is checked at every decode step: once cancelled, ``Cancelled`` is raised
        there and nothing is returned.

        Given the same weights, requests, sampling parameters and generator state, the
        result is identical: the Generator seeds ``generator`` per rollout and engine so
        that a resumed run regenerates the same samples. ``seeds`` (one per request), where
        the engine takes them (the embedded engine), seed each sample on its own: its draws
        do not depend on the engine, the batch or the chunk it is decoded in.
        """

    def in_flight_load(self) -> AbstractContextManager[None]:
        """Held around a load (and the fingerprint after it) that may come while a
        generation runs (``rollout.partial``): the embedded engine's waits for a decode step
        boundary. Engines without one take no load mid-generation (the config refuses)."""
        return nullcontext()

    @abstractmethod
    def load_weights(self, weights: DataRef, weight_version: str) -> int:
        """Serve the published tensors (Hugging Face names) behind ``weights`` from now on,
        as ``weight_version``; returns the bytes loaded.

        The engine resolves the handle itself (an in-process engine reads the transport, a
        server is sent the path of a ``disk`` handle), so no tensor passes through the
        Generator. The payload carries the publication canary (``CANARY_TENSOR``), which is
        not a model tensor: an engine that ``holds_canary`` keeps it, others drop it. Raises ``ValueError`` naming the unknown or missing tensors, or those of
        the wrong shape; nothing is loaded then.
        """

    @abstractmethod
    def checksums(
        self, skip_tensor_list: Iterable[str] = (), selector: Selector = "all"
    ) -> EngineChecksumReport:
        """SGLang's ``checksum`` action: the fingerprint of every served tensor not skipped,
        per rank, with the per-GPU and per-engine digests. An engine that reads the reply
        from elsewhere (a server) raises ``ChecksumReplyError`` for one it cannot use; the
        worker turns that into a failed check or publication naming the engine."""

    @abstractmethod
    def weights_check(
        self,
        action: TensorCheckAction,
        selector: Selector = "all",
        skip_tensor_list: Iterable[str] = (),
        allow_quant_error: bool = False,
    ) -> WeightsCheckResult:
        """SGLang's ``snapshot``, ``reset_tensors`` or ``compare`` action (``checksum`` is
        ``checksums``); an unknown action is an unsuccessful result, not an exception."""

    def check_result(
        self,
        action: str,
        success: bool,
        message: str,
        *,
        num_tensors: int = 0,
        mismatched: Sequence[str] = (),
        missing: Sequence[str] = (),
    ) -> WeightsCheckResult:
        """A ``weights_check`` answer at the version served now."""
        return WeightsCheckResult(
            success=success,
            message=message,
            action=action,
            weight_version=self.weight_version,
            num_tensors=num_tensors,
            mismatched=list(mismatched),
            missing=list(missing),
        )

    def unreadable_tensors(self) -> list[str]:
        """The served tensors this engine cannot read back in the trainer's layout, which its
        ``checksums`` leave out (backends in ``PARTIAL_READBACK``); none by default."""
        return []

    def probe_logprobs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """The served weights' log-probability of each response token after its prompt
        (teacher-forced): the engine's half of the publication probe
        (``miles_events.rl.probe``). Backends in ``PROBING`` implement it."""
        raise NotImplementedError(f"engine {self.name} has no behavioural probe")

    starts_concurrently: ClassVar[bool] = False
    """Whether several engines of this backend may be built at once in one process: a
    server engine's start is a launch and a wait; an embedded engine's builds a model with
    transformers, whose loading patches process-wide state, so those are built one by one."""

    metrics_url: str | None = None
    """The URL of the server's own Prometheus metrics; None for an engine without a server."""

    holds_canary: bool = False
    """Whether the engine keeps the publication canary of the payload it loaded
    (``miles_events.rl.canary``) and reports it in ``served_canary``."""

    def served_canary(self) -> str:
        """The fingerprint of the canary of the payload loaded last; "" before any."""
        return ""

    def release_memory(self, tags: Sequence[str]) -> int:
        """SGLang's ``release_memory_occupation``: free the device memory of kinds ``tags``
        (``cuda_graph``, ``kv_cache``, ``weights``) until ``resume_memory`` takes it back; the
        engine refuses to generate, load or fingerprint meanwhile. Returns the tensor bytes
        released where the engine knows them (0 for a server). An engine that cannot
        raises ``NotImplementedError``."""
        raise NotImplementedError(f"{self.name} cannot release its device memory (run.offload_rollout)")

    def resume_memory(self, tags: Sequence[str]) -> int:
        """SGLang's ``resume_memory_occupation`` of kinds ``tags``; the weights come back as
        they were released (a host copy) until the next load overwrites them. Returns the
        tensor bytes taken back where the engine knows them."""
        raise NotImplementedError(f"{self.name} cannot resume its device memory (run.offload_rollout)")

    memory_device: str = "server"
    """Where the memory ``release_memory`` frees is: ``cuda:0``, ``cpu``, or ``server`` for
    a server engine (its own process and device)."""

    health_url: str | None = None
    """Where the engine's server answers its health check (vLLM's ``/health``, SGLang's
    ``/health_generate``); None for an engine without a server (its rank's heartbeat is
    its check)."""

    def process_ids(self) -> list[int]:
        """The processes that make up the engine, the one a fault is injected into first
        (``inject-fault``'s ``sub_index``): the engine's own process, or its server's
        process group leader; none for a server it only connects to."""
        return [os.getpid()]

    def close(self) -> None:
        """Release the engine's memory."""


def single_rank_report(checksums: dict[str, str], message: str) -> EngineChecksumReport:
    """A successful ``checksum`` report of an engine without tensor parallelism: one rank
    holding ``checksums``, with its per-GPU and per-engine digests."""
    per_gpu = per_gpu_checksum(checksums)
    return EngineChecksumReport(
        success=True,
        message=message,
        ranks=[
            RankChecksums(checksums=checksums, per_gpu_checksum=per_gpu, parallelism_info=ParallelismInfo())
        ],
        per_engine_checksum=per_engine_checksum([per_gpu]),
    )


def encode_prompt(request: GenerateRequest, tokenizer: Callable[[], Any]) -> list[int]:
    """Token ids of one prompt: text through ``tokenizer()`` (called only for text), ids as
    they are; a prompt with no tokens is refused."""
    ids = (
        list(tokenizer()(request, add_special_tokens=True)["input_ids"])
        if isinstance(request, str)
        else [int(t) for t in request]
    )
    if not ids:
        raise ValueError(f"prompt {request!r} has no tokens")
    return ids


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str | None]:
    """Index of the earliest stop string in ``text`` and which one (None if none)."""
    best, which = len(text), None
    for stop in stops:
        index = text.find(stop) if stop else -1
        if index != -1 and index < best:
            best, which = index, stop
    return best, which


def _ordered_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Float bits mapped to int64 so that neighbouring floats differ by exactly 1."""
    import torch

    bits = tensor.reshape(-1).view(getattr(torch, _SIGNED_OF_WIDTH[tensor.element_size()])).to(torch.int64)
    magnitude = bits & ((1 << (8 * tensor.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def tensors_match(served: torch.Tensor, snapshot: torch.Tensor, allow_quant_error: bool) -> bool:
    """Whether ``served`` equals ``snapshot`` bitwise, or within one ULP of their float dtype
    when ``allow_quant_error`` (dtype and shape must match either way)."""
    import torch

    served = served.detach().to("cpu").contiguous()
    snapshot = snapshot.contiguous()
    if served.dtype != snapshot.dtype or served.shape != snapshot.shape:
        return False
    if torch.equal(served.reshape(-1).view(torch.uint8), snapshot.reshape(-1).view(torch.uint8)):
        return True
    if not allow_quant_error or not served.is_floating_point():
        return False
    distance = (_ordered_bits(served) - _ordered_bits(snapshot)).abs()
    return bool((distance <= 1).all())


def name_list(names: Sequence[str], limit: int = MAX_NAMES_IN_MESSAGE) -> str:
    """Names for a message: the first ``limit``, then how many more."""
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return f"{shown} (+{more} more)" if more > 0 else shown
