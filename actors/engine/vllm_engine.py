"""The ``vllm`` engine: one vLLM server per engine, driven over HTTP.

The engine launches ``python -m vllm.entrypoints.openai.api_server`` with vLLM's own
environment (``[vllm] python``, by default ``.venv-vllm``) through ``ServerProcess``, or
connects to a running server (``[vllm] urls``). The server is started with
``--enable-scale-out`` (the token-in/token-out ``/inference/v1/generate`` route, whose
replies say which weight version sampled each token), ``VLLM_SERVER_DEV_MODE=1`` (pause,
resume, ``/collective_rpc``, weight versions) and the project's worker extension
(``vllm_worker_extension.py``).

Generation: prompts are tokenized here (text with the model's tokenizer, as ``TorchEngine``
does; token ids are sent as they are), one request per prompt's group of samples (``n``,
sample k seeded with seed + k) with its own seed, drawn
from the ``torch.Generator`` passed in, so a run with the same generator state asks for the
same samples. ``response_ids`` are every sampled token (a final EOS and the tokens that
completed a stop string included) and the text is vLLM's detokenization, cut before a
matched stop string. ``response_logprobs`` are vLLM's default ``raw_logprobs``: log-softmax
of the unscaled logits, which is ``TorchEngine``'s distribution at temperature 1 and in
greedy decoding (at other temperatures ``TorchEngine`` reports the tempered one). A
completion's ``weight_version`` is the one the server reports for its first token.

Publication (``load_weights``): the payload is checked against the base model's tensor
names and shapes, then the server is paused (``/pause?mode=wait``: running requests
finish first), loads it (``publication = "disk"``: vLLM's ``reload_weights`` reads a
safetensors directory written under ``<run.dir>/vllm/<engine>/``; ``"push"``: the bytes go
over ``/collective_rpc`` to the worker extension, which also keeps the canary), is told
the new version (``/update_weight_version``), drops its prefix cache and resumes. The
engine's ``weight_version`` is then read back from the server, never assumed.

Verification: on CPU vLLM repacks every linear layer's weight into a kernel layout and
fuses q/k/v and gate/up projections, so those tensors cannot be read back in the
trainer's layout. ``checksums`` fingerprints the tensors that can (the embeddings and LM
head, their real vocabulary rows; the norms; the q/k/v biases, split out of the fused
bias: 13 of the built-in 2-layer model's 27) and names the rest in its message;
``weights_check`` snapshots and compares those same fingerprints, and cannot reset
tensors. A behavioural check (the logprobs of a fixed probe batch against the
trainer's) is what proves the other tensors; ``probe_logprobs`` is the engine's half of it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import torch
from safetensors import safe_open
from safetensors.torch import save, save_file

from actors.engine.base import (
    TENSOR_CHECK_ACTIONS,
    Completion,
    Engine,
    GenerateRequest,
    SamplingParams,
    encode_prompt,
    name_list,
    single_rank_report,
)
from actors.engine.server_process import HOST, ServerProcess, ServerStartError, log_gist, start_on_a_port
from actors.engine.vllm_cpu import CPU_HEAD_SIZES, DEFAULT_PYTHON, REPO_ROOT, is_cpu_build, model_head_size
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.rl.canary import CANARY_TENSOR, split_canary
from miles_events.rl.checksum import ChecksumReplyError, is_skipped
from miles_events.rl.hf_model import generation_eos_ids, load_tokenizer
from miles_events.transport.base import Transport
from schemas.checksums import EngineChecksumReport, Selector, TensorCheckAction, WeightsCheckResult
from schemas.config import Config, VllmConfig
from schemas.data import DataRef

WORKER_EXTENSION = "actors.engine.vllm_worker_extension.MilesWorkerExtension"
MAX_SEED = 2**31 - 1
WEIGHTS_DIR = "vllm"
"""Under the run directory: the disk publications and server logs of the vllm engines."""


MAX_SAMPLES_PER_REQUEST = 64
"""Samples of one prompt asked for in one request at most (a server's ``max_num_seqs``
bounds ``n``; vLLM's CPU default is 256)."""


class VllmError(RuntimeError):
    """A vLLM server refused or failed a request; one line naming the engine and route."""


def server_command(
    python: str | Path,
    model_path: str | Path,
    port: int,
    config: VllmConfig,
    *,
    dtype: str,
    max_model_len: int,
    sleep_mode: bool = False,
) -> list[str]:
    """The command line of one launched server (with ``sleep_mode``, ``--enable-sleep-mode``:
    ``run.offload_rollout``)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-scale-out",
        "--generation-config",
        "vllm",  # sampling defaults come from the request, not the model's generation_config
        "--worker-extension-cls",
        WORKER_EXTENSION,
        *(["--enable-sleep-mode"] if sleep_mode else []),
        *config.extra_args,
    ]


def server_env(config: VllmConfig, index: int) -> dict[str, str]:
    """The environment added for server ``index``."""
    bind = config.cpu_threads_bind
    if not bind:
        cpus = sorted(os.sched_getaffinity(0))
        bind = str(cpus[index % len(cpus)])
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "PYTHONPATH": python_path,  # the worker extension is this repository's module
    }


def base_model_tensors(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a Hugging Face directory's safetensors files."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


class WorkerChecksums(msgspec.Struct, frozen=True):
    """The worker extension's answer to ``miles_checksums`` (one per worker): the readable
    tensors' fingerprints, and the names of the tensors it cannot read back."""

    checksums: dict[str, str]
    unreadable: list[str]


def worker_checksums(results: list[Any]) -> WorkerChecksums:
    """The readable tensors' fingerprints and the unreadable tensors' names, from the
    ``/collective_rpc`` results of ``miles_checksums``: the answer of the server's one worker.

    Raises ``ChecksumReplyError`` when no worker answered, more than one did (the engine
    reports one rank: a second worker's tensors would go unchecked), or the answer is not
    that shape.
    """
    if not results:
        raise ChecksumReplyError("the worker extension gave no checksums (0 answers)")
    if len(results) > 1:
        raise ChecksumReplyError(
            f"the worker extension answered from {len(results)} workers, one was expected"
        )
    try:
        return msgspec.convert(results[0], WorkerChecksums)
    except msgspec.ValidationError as error:
        raise ChecksumReplyError(f"the worker extension's checksum answer is malformed: {error}") from None


class VllmEngine(Engine):
    """One vLLM server serving one copy of the policy."""

    starts_concurrently = True

    def __init__(
        self,
        *,
        name: str,
        url: str,
        model_path: str | Path,
        run_dir: Path,
        config: VllmConfig,
        transport: Transport | None = None,
        server: ServerProcess | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.metrics_url = f"{self.url}/metrics"
        self.health_url = f"{self.url}/health"
        self.model_path = Path(model_path)
        self.run_dir = run_dir
        self.config = config
        self.transport = transport
        self.server = server
        """The launched server; None when connected to ``urls``."""
        self.holds_canary = config.publication == "push" or (
            transport is not None and transport.name == "collective"
        )
        """The worker extension keeps the canary of what it loaded: pushed, or received over
        the collective transport."""
        self.tokenizer = load_tokenizer(self.model_path)
        self._stop_token_ids = generation_eos_ids(self.model_path)
        """The generation config's EOS ids: the server is told them (its sampling defaults
        come from the request, not the model's generation config)."""
        self._tensor_shapes = base_model_tensors(self.model_path)
        self._client = httpx.Client(base_url=self.url, timeout=config.request_timeout)
        self._snapshot: dict[str, str] | None = None
        self._weights_dir: Path | None = None
        self.last_load_seconds = 0.0
        """Seconds the server took for the last load (pause to resume)."""
        served = self._get("/weight_info").get("weight_version")
        if served is None:
            # A fresh server has no version yet; the seam's bootstrap version is "default".
            self._post("/update_weight_version", json={"new_version": "default"})
            served = self._get("/weight_info").get("weight_version")
        self._weight_version = str(served)

    @classmethod
    def from_config(cls, config: Config, *, index: int, name: str, transport: Transport) -> VllmEngine:
        """Launch server ``index`` (or connect to ``vllm.urls[index]``), warm it up, and
        serve ``model.path`` as version ``"default"``."""
        if config.model.path is None:
            raise ValueError("model.path is unset: the session sets it to the base model before actors start")
        vllm = config.vllm
        run_dir = Path(config.run.dir)
        if vllm.urls:
            if index >= len(vllm.urls):
                raise ValueError(
                    f"vllm.urls has {len(vllm.urls)} server(s) but generator.num_engines asks for engine {index}"
                )
            engine = cls(
                name=name,
                url=vllm.urls[index],
                model_path=config.model.path,
                run_dir=run_dir,
                config=vllm,
                transport=transport,
            )
            engine.warm_up()
            return engine
        server = launch_server(config, index=index, name=name)
        try:
            engine = cls(
                name=name,
                url=server.url,
                model_path=config.model.path,
                run_dir=run_dir,
                config=vllm,
                transport=transport,
                server=server,
            )
            engine.warm_up()
        except BaseException:
            server.close()
            raise
        return engine

    @property
    def weight_version(self) -> str:
        return self._weight_version

    # --- HTTP ----------------------------------------------------------------------------

    def _check(self, response: httpx.Response, route: str) -> Any:
        if response.status_code != 200:
            body = " ".join(response.text.split())[:300]
            cause = ""
            if response.status_code >= 500 and self.server is not None:
                cause = f"; the log says: {log_gist(self.server.log_path)}"
            raise VllmError(
                f"{self.name}: {route} answered {response.status_code}: {body}{cause}{self._log_hint()}"
            )
        return response.json() if response.content else None

    def _log_hint(self) -> str:
        return f" (log {self.server.log_path})" if self.server is not None else ""

    def _request(self, method: str, route: str, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, route, **kwargs)
        except httpx.TransportError as error:
            alive = "" if self.server is None else self.server.exit_note()
            raise VllmError(f"{self.name}: {route} failed: {error!r}{alive}{self._log_hint()}") from None
        return self._check(response, route)

    def _get(self, route: str) -> Any:
        return self._request("GET", route)

    def _post(self, route: str, **kwargs: Any) -> Any:
        return self._request("POST", route, **kwargs)

    def collective_rpc(self, method: str, *args: str, **kwargs: str) -> list[Any]:
        """Call ``method`` on every worker of the server; one result per worker."""
        reply = self._post("/collective_rpc", json={"method": method, "args": list(args), "kwargs": kwargs})
        return list((reply or {}).get("results", []))

    # --- generation ----------------------------------------------------------------------

    def encode(self, request: GenerateRequest) -> list[int]:
        """Token ids of one prompt: text through the tokenizer, ids as they are."""
        return encode_prompt(request, lambda: self.tokenizer)

    def warm_up(self) -> None:
        """One short request with logprobs, so that the op vLLM compiles for logprobs on
        its first use is compiled before the first rollout (tens of seconds on CPU the
        first time; torch's inductor cache keeps it for later servers)."""
        prompt = self.encode(self.tokenizer.eos_token or "0")
        self.generate(
            [prompt], SamplingParams(temperature=1.0, max_new_tokens=2), torch.Generator().manual_seed(0)
        )

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        cancel: Cancellation | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample one completion per request, all in flight at once (the server batches).

        Consecutive requests for the same prompt go as one HTTP request of ``n`` samples
        (up to ``MAX_SAMPLES_PER_REQUEST``). Seeds come from ``generator`` (one per HTTP
        request; vLLM seeds its k-th sample with seed + k), so the same generator state asks
        for the same samples; vLLM then samples reproducibly given the same weights. A
        cancellation aborts the requests still running on the server and raises
        ``Cancelled``.
        """
        prompt_ids: list[list[int]] = []
        encoded: dict[str, list[int]] = {}
        for request in requests:
            if isinstance(request, str):
                if request not in encoded:
                    encoded[request] = self.encode(request)
                prompt_ids.append(encoded[request])
            else:
                prompt_ids.append(self.encode(request))
        if not prompt_ids:
            return []
        # Consecutive requests for the same prompt (a GRPO group) go as one request of n
        # samples: vLLM computes the prompt once and seeds sample k with seed + k.
        groups: list[tuple[list[int], int]] = []
        for ids in prompt_ids:
            if groups and groups[-1][0] == ids and groups[-1][1] < MAX_SAMPLES_PER_REQUEST:
                groups[-1] = (ids, groups[-1][1] + 1)
            else:
                groups.append((ids, 1))
        # One seed per HTTP request (a group of samples of one prompt), from ``generator``:
        # vLLM seeds a request's k-th sample itself, so per-sample ``seeds`` are not used.
        if generator is not None:
            request_seeds: list[int | None] = torch.randint(
                0, MAX_SEED, (len(groups),), generator=generator
            ).tolist()
        else:
            request_seeds = [None] * len(groups)
        return asyncio.run(self._generate_all(groups, request_seeds, sampling, cancel))

    def _generate_body(
        self, request_id: str, ids: list[int], n: int, seed: int | None, sampling: SamplingParams
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_new_tokens,
            "logprobs": 0,  # the sampled token's only
            "stop": list(sampling.stop),
            "stop_token_ids": [] if sampling.ignore_eos else self._stop_token_ids,
            "ignore_eos": sampling.ignore_eos,
            "skip_special_tokens": True,
            "detokenize": True,
        }
        if seed is not None:
            params["seed"] = seed
        return {"request_id": request_id, "token_ids": ids, "sampling_params": params, "output_mode": "text"}

    async def _generate_all(
        self,
        groups: list[tuple[list[int], int]],
        seeds: list[int | None],
        sampling: SamplingParams,
        cancel: Cancellation | None,
    ) -> list[Completion]:
        batch = f"{self.name}-{uuid.uuid4().hex[:12]}"
        request_ids = [f"{batch}-{i}" for i in range(len(groups))]
        route = "/inference/v1/generate"
        limits = httpx.Limits(max_connections=max(1, len(groups)))
        async with httpx.AsyncClient(
            base_url=self.url, timeout=self.config.request_timeout, limits=limits
        ) as client:

            async def one(i: int) -> list[Completion]:
                ids, n = groups[i]
                body = self._generate_body(request_ids[i], ids, n, seeds[i], sampling)
                try:
                    response = await client.post(route, json=body)
                except httpx.TransportError as error:
                    alive = "" if self.server is None else await asyncio.to_thread(self.server.exit_note)
                    raise VllmError(
                        f"{self.name}: {route} failed: {error!r}{alive}{self._log_hint()}"
                    ) from None
                return self._completions(ids, n, self._check(response, route))

            tasks = [asyncio.create_task(one(i)) for i in range(len(groups))]
            try:
                pending = set(tasks)
                while pending:
                    done, pending = await asyncio.wait(
                        pending, timeout=0.05, return_when=asyncio.FIRST_EXCEPTION
                    )
                    for task in done:
                        if task.exception() is not None:
                            raise task.exception()  # type: ignore[misc]
                    if cancel is not None and cancel.cancelled and pending:
                        await client.post("/inference/v1/abort_requests", json={"request_ids": request_ids})
                        raise Cancelled(cancel.reason)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            if cancel is not None:
                cancel.check()
            return [completion for task in tasks for completion in task.result()]

    def _completions(self, prompt_ids: list[int], n: int, reply: dict[str, Any]) -> list[Completion]:
        choices = sorted(reply["choices"], key=lambda choice: int(choice.get("index", 0)))
        if len(choices) != n:
            raise VllmError(
                f"{self.name}: asked for {n} samples of a prompt, the server returned {len(choices)}"
            )
        return [self._completion(prompt_ids, choice) for choice in choices]

    def _completion(self, prompt_ids: list[int], choice: dict[str, Any]) -> Completion:
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise VllmError(f"{self.name}: a request ended with finish_reason {finish!r}{self._log_hint()}")
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        if len(logprobs) != len(token_ids):
            raise VllmError(
                f"{self.name}: the server returned {len(token_ids)} tokens but {len(logprobs)} logprobs"
            )
        stop_reason = choice.get("stop_reason")
        spans = choice.get("weight_versions") or []
        version = str(spans[0]["version"]) if spans else self._weight_version
        return Completion(
            prompt_ids=list(prompt_ids),
            response_ids=token_ids,
            response_logprobs=logprobs,
            response=choice.get("text") or "",
            finish_reason=finish,
            weight_version=version,
            matched_stop=stop_reason if isinstance(stop_reason, str) else None,
        )

    def probe_logprobs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """The served model's log-probabilities of ``response_ids`` after ``prompt_ids``
        (teacher-forced, one list per sequence): the engine's half of a behavioural check
        of the weights, compared with the trainer's logprobs of the same probe batch."""
        results: list[list[float]] = []
        for prompt, response in zip(prompt_ids, response_ids, strict=True):
            body = {
                "prompt": list(prompt) + list(response),
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            }
            reply = self._post("/v1/completions", json=body)
            entries = reply["choices"][0]["prompt_logprobs"][len(prompt) :]
            results.append(
                [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, response, strict=True)]
            )
        return results

    # --- weights -------------------------------------------------------------------------

    def _check_payload(self, tensors: Mapping[str, torch.Tensor]) -> None:
        known = self._tensor_shapes
        tied = "lm_head.weight" not in known and "model.embed_tokens.weight" in known
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        unknown = sorted(n for n in tensors if n not in known and n not in aliases)
        given = {aliases.get(n, n) for n in tensors}
        missing = sorted(n for n in known if n not in given)
        wrong_shape = [
            f"{n} {tuple(t.shape)} (serves {known[aliases.get(n, n)]})"
            for n, t in tensors.items()
            if aliases.get(n, n) in known and tuple(t.shape) != known[aliases.get(n, n)]
        ]
        problems = [
            f"{label}: {name_list(names)}"
            for label, names in (("unknown", unknown), ("missing", missing), ("wrong shape", wrong_shape))
            if names
        ]
        if problems:
            raise ValueError(f"engine {self.name} cannot load these weights; " + "; ".join(problems))

    def load_weights(self, weights: DataRef, weight_version: str) -> int:
        """Pause, load the tensors behind ``weights``, set the version, drop the prefix
        cache, resume; returns the bytes of model tensors loaded (received, the canary's
        included, over the collective).

        Weights sent on request (``publisher.transport = "collective"``) go straight to the
        server's worker: it joins this engine's channel to the trainer's publishing rank
        (gloo, on vLLM's CPU build) and receives and loads them itself, through the worker
        extension, keeping their canary. Others are read here and pushed or written to disk
        (``vllm.publication``)."""
        if self.transport is None:
            raise ValueError(
                f"engine {self.name} has no transport to read {weights.transport}:{weights.key} from"
            )
        if weights.address:
            num_bytes = weights.num_bytes
            settings = getattr(self.transport.reader, "settings", None)
            timeout = str(getattr(settings, "timeout", 60.0))
            ref_json = msgspec.json.encode(weights).decode()

            def load() -> None:
                self.collective_rpc("miles_receive_weights", ref_json, self.name, timeout)

        else:
            payload = self.transport.reader.get_tensors(weights)
            model_tensors, canary = split_canary(payload)
            self._check_payload(model_tensors)
            contiguous = {n: t.detach().contiguous().cpu() for n, t in model_tensors.items()}
            num_bytes = sum(t.numel() * t.element_size() for t in contiguous.values())

            def load() -> None:
                if self.config.publication == "push":
                    if canary is not None:
                        contiguous[CANARY_TENSOR] = canary.contiguous()
                    encoded = base64.b64encode(save(contiguous)).decode("ascii")
                    self.collective_rpc("miles_push_weights", encoded)
                else:
                    directory = self._write_weights_dir(contiguous, weight_version)
                    self.collective_rpc("reload_weights", weights_path=str(directory))
                    # A tied LM head's packed copy is not redone by the reload (the extension's).
                    self.collective_rpc("miles_refresh_shared_weights")

        started = time.perf_counter()
        self._post("/pause", params={"mode": "wait"})
        try:
            load()
            self._post("/update_weight_version", json={"new_version": str(weight_version)})
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
        self.last_load_seconds = time.perf_counter() - started
        served = self._get("/weight_info").get("weight_version")
        if str(served) != str(weight_version):
            raise VllmError(
                f"{self.name}: after loading version {weight_version} the server reports {served!r}"
            )
        self._weight_version = str(served)
        return num_bytes

    def _write_weights_dir(self, tensors: dict[str, torch.Tensor], weight_version: str) -> Path:
        root = self.run_dir / WEIGHTS_DIR / self.name
        final = root / f"weights-{weight_version}"
        partial = root / f".weights-{weight_version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file(tensors, str(partial / "model.safetensors"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        # vLLM reads later reloads relative to the last path it loaded; keep only that one.
        if self._weights_dir is not None and self._weights_dir != final:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
        self._weights_dir = final
        return final

    def served_canary(self) -> str:
        if not self.holds_canary:
            return ""
        results = self.collective_rpc("miles_canary")
        return str(results[0]) if results else ""

    # --- checksums -------------------------------------------------------------------------

    def readable_checksums(self) -> WorkerChecksums:
        """Fingerprints of the base model's tensors the server holds in the Hugging Face
        layout, and the names of those it does not (repacked or fused on this backend).
        Raises ``ChecksumReplyError`` for an answer ``worker_checksums`` refuses."""
        names = {n: list(shape) for n, shape in self._tensor_shapes.items()}
        results = self.collective_rpc("miles_checksums", json.dumps(names))
        try:
            return worker_checksums(results)
        except ChecksumReplyError as error:
            raise ChecksumReplyError(f"{error}{self._log_hint()}") from None

    def unreadable_tensors(self) -> list[str]:
        """The base model's tensors the server holds repacked or fused (``readable_checksums``)."""
        return sorted(self.readable_checksums().unreadable)

    def checksums(
        self, skip_tensor_list: Iterable[str] = (), selector: Selector = "all"
    ) -> EngineChecksumReport:
        """The fingerprints of the tensors that can be read back (see the module docstring),
        as one rank; the message names those that cannot. ``"draft"`` selects nothing."""
        if selector not in ("all", "target", "draft"):
            raise ValueError(f"unknown selector {selector!r}; known: all, target, draft")
        skip = list(skip_tensor_list)
        if selector == "draft":
            readable: dict[str, str] = {}
            unreadable: list[str] = []
        else:
            answer = self.readable_checksums()
            readable = {n: c for n, c in answer.checksums.items() if not is_skipped(n, skip)}
            unreadable = [n for n in answer.unreadable if not is_skipped(n, skip)]
        message = f"checksums of {len(readable)} tensors"
        if unreadable:
            message += f"; {len(unreadable)} cannot be read back from vLLM (repacked or fused): {name_list(unreadable)}"
        return single_rank_report(readable, message)

    def weights_check(
        self,
        action: TensorCheckAction,
        selector: Selector = "all",
        skip_tensor_list: Iterable[str] = (),
        allow_quant_error: bool = False,
    ) -> WeightsCheckResult:
        """``snapshot`` and ``compare`` on the fingerprints of the readable tensors
        (bitwise: a fingerprint cannot tell one ULP from any other difference);
        ``reset_tensors`` overwrites every tensor not skipped, the unreadable ones included."""
        if action not in TENSOR_CHECK_ACTIONS:
            known = ", ".join(TENSOR_CHECK_ACTIONS)
            return self.check_result(
                action, False, f"unknown action {action!r}; known: {known} (and checksum)"
            )
        if selector == "draft":
            return self.check_result(action, True, f"{action}: no draft model, nothing selected")
        if action == "reset_tensors":
            return self._reset_tensors(list(skip_tensor_list))
        try:
            readable = self.readable_checksums().checksums
        except ChecksumReplyError as error:
            return self.check_result(action, False, f"{action}: {error}")
        skip = list(skip_tensor_list)
        current = {n: c for n, c in readable.items() if not is_skipped(n, skip)}
        if action == "snapshot":
            self._snapshot = current
            return self.check_result(
                action, True, f"snapshot of {len(current)} readable tensors", num_tensors=len(current)
            )
        if self._snapshot is None:
            return self.check_result("compare", False, "compare: no snapshot; run the snapshot action first")
        absent = sorted(n for n in current if n not in self._snapshot)
        differ = sorted(n for n, c in current.items() if n in self._snapshot and self._snapshot[n] != c)
        if absent or differ:
            message = f"{len(differ)} of {len(current)} readable tensors differ from the snapshot: {name_list(differ)}"
            if absent:
                message += f"; not in the snapshot: {name_list(absent)}"
            return self.check_result(
                "compare", False, message, num_tensors=len(current), mismatched=differ, missing=absent
            )
        mode = "fingerprints" + (
            " (one ULP is not told apart from other differences)" if allow_quant_error else ""
        )
        return self.check_result(
            "compare",
            True,
            f"{len(current)} readable tensors equal the snapshot ({mode})",
            num_tensors=len(current),
        )

    def _reset_tensors(self, skip: list[str]) -> WeightsCheckResult:
        """Overwrite every served tensor not skipped with random data, through vLLM's own
        weight loading (so the linears' packed kernel copies are overwritten too), paused as
        a load is; the served version stays."""
        names = {n: list(shape) for n, shape in self._tensor_shapes.items() if not is_skipped(n, skip)}
        self._post("/pause", params={"mode": "wait"})
        try:
            results = self.collective_rpc("miles_reset_tensors", json.dumps(names))
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
        reset = int(results[0]["num_tensors"]) if results and isinstance(results[0], dict) else 0
        return self.check_result(
            "reset_tensors", True, f"reset {reset} tensors to random data", num_tensors=reset
        )

    # --- offload and onload ------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str]) -> int:
        """vLLM's sleep mode (a server started with ``--enable-sleep-mode``; its dev routes,
        ``vllm/entrypoints/serve/dev/sleep/api_router.py``): with ``weights``, ``/sleep``
        at level 1 (the weights to host memory, the KV cache discarded) once running requests
        finish (``mode=wait``); the KV cache alone, ``/release_kv_cache_memory``. vLLM has no
        CUDA graphs of its own to release apart (they live in the KV pool's)."""
        if "weights" in tags:
            self._post("/sleep", params={"level": 1, "mode": "wait"})
        elif "kv_cache" in tags:
            self._post("/release_kv_cache_memory")
        return 0

    def resume_memory(self, tags: Sequence[str]) -> int:
        """``/wake_up`` with vLLM's tags (``weights``, ``kv_cache``) among ``tags``."""
        woken = [tag for tag in ("weights", "kv_cache") if tag in tags]
        if woken:
            self._post("/wake_up", params={"tags": woken})
        return 0

    def process_ids(self) -> list[int]:
        return [self.server.process.pid] if self.server is not None else []

    def close(self) -> None:
        """Close the HTTP client and end a launched server's whole process group."""
        self._client.close()
        if self.server is not None:
            self.server.close()


def launch_server(config: Config, *, index: int, name: str) -> ServerProcess:
    """Start server ``index`` for ``model.path``; ``ServerStartError`` (one line) if it
    does not come up."""
    vllm = config.vllm
    assert config.model.path is not None
    log_path = Path(config.run.dir) / WEIGHTS_DIR / f"{name}.log"
    python = Path(vllm.python) if vllm.python else DEFAULT_PYTHON
    if not python.exists():
        raise ServerStartError(
            f"{name}: no vLLM Python at {python} (run bash .ci/setup-vllm, or set vllm.python)"
        )
    model_path = Path(config.model.path)
    if not model_path.is_dir():
        raise ServerStartError(f"{name}: model path {model_path} is not a directory (server not started)")
    if is_cpu_build(python):
        check_cpu_head_size(model_path, name)
    max_model_len = vllm.max_model_len or _max_positions(model_path)
    return start_on_a_port(
        name,
        lambda port: server_command(
            python,
            model_path,
            port,
            vllm,
            dtype=config.model.dtype,
            max_model_len=max_model_len,
            sleep_mode=config.run.offload_rollout,
        ),
        port=vllm.port + index if vllm.port else 0,
        log_path=log_path,
        env=server_env(vllm, index),
        timeout=vllm.startup_timeout,
    )


def check_cpu_head_size(model_path: Path, name: str) -> None:
    """``ServerStartError`` (one line, before any launch) for a model whose attention head
    size a CPU vLLM server cannot serve (the input checks refuse it before a run already:
    ``miles_events.app.preflight.check_vllm_head_size``)."""
    found = model_head_size(model_path)
    if found is not None and found[0] not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        raise ServerStartError(
            f"{name}: vLLM on CPU has no attention kernel for head size {found[0]} (of {model_path}); "
            f"it serves {sizes} (for the built-in model: model.builtin.num_attention_heads = "
            f"hidden_size / 32) (server not started)"
        )


def _max_positions(model_path: Path) -> int:
    try:
        value = json.loads((model_path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        value = None
    return int(value) if value else 2048
