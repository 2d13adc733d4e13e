"""An engine served by an SGLang server, driven over its HTTP API (``sglang_api``).

Engine ``i`` talks to ``sglang.urls[i]``, a server already running; starting one is the
server-process helper's job (``actors/engine/server_process.py``), which builds its command
line with ``SglangEngine.launch_args`` and passes the URL here. A run without a URL for an
engine is refused with one line.

- ``generate``: prompts are tokenized here (the tokenizer of ``model.path``) and sent as
  ``input_ids``, in batches of ``rollout.max_batch_size``, one ``sampling_seed`` per request
  drawn from the Generator's ``torch.Generator`` (so a resumed run asks for the same
  samples); the cancellation is checked between batches.
- ``load_weights``: pause (``sglang.pause_mode``), flush the cache (retried while busy),
  ``/update_weights_from_disk`` with the directory of a ``disk`` handle, or, over the
  ``collective`` transport, ``/update_weights_from_distributed`` per bucket while the
  trainer's publishing rank broadcasts each tensor (the server's ranks join the channel's
  group at the first load: ``/init_weights_update_group``), all between
  ``/begin_weight_update`` and ``/end_weight_update`` where ``sglang.weight_update_session``;
  then ``/update_weight_version`` (``abort_all_requests`` false), continue.
- ``checksums`` and ``weights_check``: ``/weights_checker``.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from actors.engine import sglang_api as api
from actors.engine.base import (
    Completion,
    Engine,
    GenerateRequest,
    SamplingParams,
    encode_prompt,
)
from actors.engine.server_process import ServerProcess, ServerStartError, start_on_a_port
from miles_events.bus.cancel import Cancellation
from miles_events.rl.canary import CANARY_TENSOR
from miles_events.rl.hf_model import generation_eos_ids
from miles_events.transport.base import Transport
from miles_events.transport.collective import CollectiveSettings, DrivenReceivers
from schemas.checksums import (
    CheckAction,
    EngineChecksumReport,
    Selector,
    TensorCheckAction,
    WeightsCheckResult,
)
from schemas.config import Config
from schemas.data import DataRef

_SEED_BOUND = 2**63 - 1


class SglangError(RuntimeError):
    """A call the server failed, or could not be reached for."""


class _Http:
    """JSON over HTTP to one server; every call has a timeout."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def call(self, path: str, body: bytes | None = None, method: str = "POST") -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.url + path, data=body, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except (urllib.error.URLError, OSError) as error:
            raise SglangError(f"{self.url}{path}: {getattr(error, 'reason', error)}") from error

    def ok(self, path: str, body: bytes | None = None, method: str = "POST") -> bytes:
        status, reply = self.call(path, body, method)
        if status != 200:
            raise SglangError(f"{self.url}{path}: {api.error_message(status, reply)}")
        return reply

    def success(
        self, path: str, request: api.Request, reply: type[api.SuccessReply] = api.SuccessReply
    ) -> Any:
        parsed = api.parse_success_reply(*self.call(path, request.body()), reply)
        if not parsed.success:
            raise SglangError(f"{self.url}{path}: {parsed.message or 'failed'}")
        return parsed


class SglangEngine(Engine):
    """One SGLang server serving one copy of the policy."""

    starts_concurrently = True

    def __init__(
        self,
        url: str,
        *,
        name: str,
        config: Config,
        transport: Transport,
        tokenizer: Any = None,
        server: ServerProcess | None = None,
    ) -> None:
        self.name = name
        self.server = server
        """The launched server; None when connected to ``sglang.urls``."""
        self.config = config
        self.settings = config.sglang
        self.http = _Http(url, self.settings.request_timeout)
        self.metrics_url = f"{self.http.url}/metrics"
        self.health_url = f"{self.http.url}{api.HEALTH_GENERATE}"
        self.transport = transport
        self._tokenizer = tokenizer
        self._stop_token_ids = generation_eos_ids(config.model.path) if config.model.path else []
        """The generation config's EOS ids, sent with each request (``stop_token_ids``)."""
        self._weight_version = self._served_version()
        self._receivers = DrivenReceivers(CollectiveSettings.of(config))
        """``publisher.transport = "collective"``: this engine's channel to the publishing rank."""
        self._update_group: str | None = None
        """The server's weight update group, once formed."""

    @classmethod
    def from_config(cls, config: Config, *, index: int, name: str, transport: Transport) -> SglangEngine:
        """Connect to ``sglang.urls[index]``, or without ``urls`` launch server ``index``
        (``launch_server``) and wait until it generates."""
        urls = config.sglang.urls
        if not urls:
            server = launch_server(config, index=index, name=name)
            try:
                return cls(server.url, name=name, config=config, transport=transport, server=server)
            except BaseException:
                server.close()
                raise
        if index >= len(urls):
            raise ValueError(
                f"sglang.urls: {name} needs the URL of a running SGLang server, {len(urls)} given for "
                f"{config.generator.num_engines} engines (or give none to launch them)"
            )
        return cls(urls[index], name=name, config=config, transport=transport)

    def process_ids(self) -> list[int]:
        return [self.server.process.pid] if self.server is not None else []

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    @staticmethod
    def launch_args(
        config: Config, *, port: int, nccl_port: int | None = None, base_gpu_id: int | None = None
    ) -> api.LaunchArgs:
        """What the server-process helper starts one server with, for ``port``."""
        if config.model.path is None:
            raise ValueError("model.path is unset: an SGLang server needs a model directory")
        settings = config.sglang
        return api.LaunchArgs(
            model_path=config.model.path,
            port=port,
            tp_size=settings.tp_size,
            mem_fraction_static=settings.mem_fraction_static,
            nccl_port=nccl_port,
            base_gpu_id=base_gpu_id,
            random_seed=config.run.seed,
            enable_memory_saver=config.run.offload_rollout,
            extra_args=tuple(settings.extra_args),
        )

    # --- state ---------------------------------------------------------------------------------

    def _served_version(self) -> str:
        for path in api.MODEL_INFO_PATHS:
            status, body = self.http.call(path, method="GET")
            if status == 200:
                version = api.decode(body, api.ModelInfo).weight_version
                return version if version is not None else "default"
            if status != 404:
                raise SglangError(f"{self.http.url}{path}: {api.error_message(status, body)}")
        raise SglangError(f"{self.http.url}: neither of {', '.join(api.MODEL_INFO_PATHS)} answers")

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def ready(self) -> bool:
        """Whether ``/health_generate`` answers 200 now."""
        try:
            return api.is_ready(self.http.call(api.HEALTH_GENERATE, method="GET")[0])
        except SglangError:
            return False

    # --- generation ----------------------------------------------------------------------------

    def _encode(self, request: GenerateRequest) -> list[int]:
        return encode_prompt(request, self._text_tokenizer)

    def _text_tokenizer(self) -> Any:
        """The model's tokenizer, loaded when a text prompt first needs it."""
        if self._tokenizer is None:
            if self.config.model.path is None:
                raise ValueError("a text prompt needs a tokenizer: model.path is unset")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model.path)
        return self._tokenizer

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        cancel: Cancellation | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        prompts = [self._encode(r) for r in requests]
        # The server's ``sampling_seed`` per request: each sample's own seed where given (the
        # same samples whatever engine serves them), else drawn from ``generator``.
        request_seeds: list[int | None]
        if seeds is not None:
            request_seeds = [seed % _SEED_BOUND for seed in seeds]
        elif generator is not None:
            request_seeds = torch.randint(0, _SEED_BOUND, (len(prompts),), generator=generator).tolist()
        else:
            request_seeds = [None] * len(prompts)
        size = self.config.rollout.max_batch_size
        completions: list[Completion] = []
        for start in range(0, len(prompts), size):
            if cancel is not None:
                cancel.check()
            batch = prompts[start : start + size]
            body = api.GenerateRequest(
                input_ids=batch,
                sampling_params=[
                    self._sampling(sampling, seed) for seed in request_seeds[start : start + size]
                ],
                return_logprob=True,
            )
            replies = api.parse_generate_reply(self.http.ok(api.GENERATE, body.body()))
            if len(replies) != len(batch):
                raise SglangError(
                    f"{self.http.url}/generate: {len(replies)} replies for {len(batch)} prompts"
                )
            completions += [self._completion(ids, reply) for ids, reply in zip(batch, replies, strict=True)]
        return completions

    def _sampling(self, sampling: SamplingParams, seed: int | None) -> api.SamplingParamsBody:
        return api.SamplingParamsBody(
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop) or None,
            stop_token_ids=None if sampling.ignore_eos else self._stop_token_ids or None,
            ignore_eos=sampling.ignore_eos,
            sampling_seed=seed,
        )

    def _completion(self, prompt_ids: list[int], reply: api.GenerateReply) -> Completion:
        finish = reply.finish
        if finish == "abort":
            reason = reply.meta_info.finish_reason
            raise SglangError(
                f"{self.name}: request {reply.meta_info.id} aborted: {reason and reason.message}"
            )
        matched = reply.meta_info.finish_reason.matched if reply.meta_info.finish_reason else None
        # A load while the request ran (``rollout.partial``: paused, the weights updated, then
        # continued): the server's spans say which version sampled which output tokens.
        spans = [(span.start, span.version) for span in reply.weight_version_spans]
        return Completion(
            prompt_ids=prompt_ids,
            response_ids=list(reply.output_ids),
            response_logprobs=reply.output_logprobs,
            response=reply.text,
            finish_reason=finish,
            weight_version=spans[0][1] if spans else reply.weight_version,
            matched_stop=matched if isinstance(matched, str) else None,
            version_spans=spans if len({version for _, version in spans}) > 1 else [],
        )

    # --- weights -------------------------------------------------------------------------------

    def _flush_cache(self) -> None:
        settings = self.settings
        api.flush_cache_with_retry(
            lambda: self.http.call(api.flush_cache_path(settings.flush_cache_server_timeout)),
            timeout=settings.flush_cache_timeout,
        )

    def load_weights(self, weights: DataRef, weight_version: str) -> int:
        if weights.transport == "collective":
            self._join_update_group(weights)
        elif weights.transport != "disk":
            raise ValueError(
                f"{self.name}: an SGLang server loads published weights from disk "
                f"(publisher.transport = 'disk') or over a collective ('collective'), not from "
                f"{weights.transport!r}"
            )
        settings = self.settings
        self.http.ok(api.PAUSE_GENERATION, api.pause_generation_body(settings.pause_mode))
        try:
            self._flush_cache()
            if settings.weight_update_session:
                self.http.success(api.BEGIN_WEIGHT_UPDATE, api.BeginWeightUpdateRequest())
            if weights.transport == "collective":
                self._update_from_distributed(weights, weight_version)
            else:
                path = Path(self.transport.reader.path(weights))  # type: ignore[attr-defined]
                self.http.success(
                    api.UPDATE_WEIGHTS_FROM_DISK,
                    api.UpdateWeightsFromDiskRequest(model_path=str(path), weight_version=weight_version),
                    api.UpdateWeightsFromDiskReply,
                )
            if settings.weight_update_session:
                self.http.success(api.END_WEIGHT_UPDATE, api.EndWeightUpdateRequest())
            self.http.success(
                api.UPDATE_WEIGHT_VERSION,
                api.UpdateWeightVersionRequest(new_version=weight_version),
                api.UpdateWeightVersionReply,
            )
            self._weight_version = weight_version
        finally:
            self.http.ok(api.CONTINUE_GENERATION, api.ContinueGenerationRequest().body())
        return weights.num_bytes

    def _join_update_group(self, weights: DataRef) -> None:
        """At this engine's first collective load (or after a failed one): join its channel
        to the trainer's publishing rank and have the server's ranks form the group with it
        (``/init_weights_update_group``, rank 0 the publisher's, the server's ``tp_size``
        ranks from 1), the old group destroyed first."""
        rendezvous, joined = self._receivers.join(weights.address, self.name, self.settings.tp_size, "cuda")
        if not joined:
            return
        try:
            if self._update_group is not None:
                self.http.call(
                    api.DESTROY_WEIGHTS_UPDATE_GROUP,
                    api.DestroyWeightsUpdateGroupRequest(group_name=self._update_group).body(),
                )  # a group whose publisher is gone: refusing is fine
            self.http.success(
                api.INIT_WEIGHTS_UPDATE_GROUP,
                api.InitWeightsUpdateGroupRequest(
                    master_address=rendezvous.host, master_port=rendezvous.port, rank_offset=1,
                    world_size=rendezvous.world_size, group_name=rendezvous.group_name, backend=rendezvous.backend,
                ),
            )  # fmt: skip
        except BaseException:  # not formed: the next load joins anew
            self._receivers.drop(weights.address, self.name)
            raise
        self._update_group = rendezvous.group_name

    def _update_from_distributed(self, weights: DataRef, weight_version: str) -> None:
        """Ask for ``weights`` on the channel and post its tensors, in buckets of at most
        ``publisher.bucket_bytes``, as ``/update_weights_from_distributed`` while the publishing
        rank broadcasts them one by one; each post returns once its broadcasts are in. The
        canary is not sent: SGLang knows only the model's names."""
        assert self._update_group is not None
        try:
            header = self._receivers.ask(weights.address, self.name, weights.key, skip=(CANARY_TENSOR,))
            specs = [
                api.TensorSpec(slot.name, layout.dtype, slot.shape)
                for layout in header.layouts
                for slot in layout.slots
                if slot.name != CANARY_TENSOR
            ]
            for request in api.update_weights_from_distributed_requests(
                specs,
                weight_version,
                max_bytes=self.config.publisher.bucket_bytes,
                group_name=self._update_group,
            ):
                self.http.success(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, request)
        except BaseException:
            self._receivers.drop(weights.address, self.name)  # the next load forms the group anew
            raise

    # --- offload and onload ------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str]) -> int:
        """``/release_memory_occupation`` of ``tags``, once the server is idle (its cache
        flushed); the server, launched with ``--enable-memory-saver``, keeps the weights'
        host copy itself."""
        self._flush_cache()
        self.http.ok(
            api.RELEASE_MEMORY_OCCUPATION,
            api.ReleaseMemoryOccupationRequest(tags=api.memory_tags(tags)).body(),
        )
        return 0

    def resume_memory(self, tags: Sequence[str]) -> int:
        """``/resume_memory_occupation`` of ``tags``."""
        self.http.ok(
            api.RESUME_MEMORY_OCCUPATION, api.ResumeMemoryOccupationRequest(tags=api.memory_tags(tags)).body()
        )
        return 0

    # --- the weights checker -------------------------------------------------------------------

    def _checker(
        self, action: CheckAction, selector: Selector, skip: Iterable[str], allow_quant_error: bool
    ) -> tuple[int, bytes]:
        request = api.WeightsCheckerRequest(
            action=action,
            selector=selector,
            skip_tensor_list=list(skip),
            allow_quant_error=allow_quant_error,
        )
        return self.http.call(api.WEIGHTS_CHECKER, request.body())

    def checksums(
        self, skip_tensor_list: Iterable[str] = (), selector: Selector = "all"
    ) -> EngineChecksumReport:
        return api.parse_checksum_reply(*self._checker("checksum", selector, skip_tensor_list, False))

    def weights_check(
        self,
        action: TensorCheckAction,
        selector: Selector = "all",
        skip_tensor_list: Iterable[str] = (),
        allow_quant_error: bool = False,
    ) -> WeightsCheckResult:
        if action not in ("snapshot", "reset_tensors", "compare"):
            return WeightsCheckResult(
                success=False,
                message=f"unknown action {action!r}",
                action=action,
                weight_version=self.weight_version,
            )
        status, body = self._checker(action, selector, skip_tensor_list, allow_quant_error)
        return api.parse_check_reply(action, status, body, weight_version=self.weight_version)


def first_gpu(index: int, tp_size: int, visible: int | None = None) -> int | None:
    """The first GPU of engine ``index``'s server among the GPUs this process sees: its own
    ``tp_size`` of them when the process sees every engine's (several engines launched from
    one process, the local runtime); None (the server's first) when it sees fewer (a Ray
    rank process, which sees its bundle's GPUs only)."""
    count = torch.cuda.device_count() if visible is None else visible
    return index * tp_size if count >= (index + 1) * tp_size and index > 0 else None


LOG_DIR = "sglang"
"""Launched servers log to ``<run.dir>/sglang/<engine>.log``."""


def launch_server(config: Config, *, index: int, name: str) -> ServerProcess:
    """Start server ``index`` with ``sglang.python -m sglang.launch_server`` and the arguments
    of ``SglangEngine.launch_args``; ready once ``/health_generate`` answers (the server can
    generate, not merely listen). ``ServerStartError`` (one line naming the log) otherwise."""
    settings = config.sglang
    if config.model.path is None or not Path(config.model.path).is_dir():
        raise ServerStartError(
            f"{name}: model path {config.model.path} is not a directory (server not started)"
        )
    base_gpu_id = first_gpu(index, settings.tp_size)

    def command(port: int) -> list[str]:
        launch = SglangEngine.launch_args(config, port=port, base_gpu_id=base_gpu_id)
        return api.launch_argv(launch, python=settings.python)

    return start_on_a_port(
        name,
        command,
        port=settings.port + index if settings.port else 0,
        log_path=Path(config.run.dir) / LOG_DIR / f"{name}.log",
        health_path=api.HEALTH_GENERATE,
        timeout=settings.startup_timeout,
    )
