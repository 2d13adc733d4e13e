"""The embedded inference engine: batched KV-cached sampling with a Hugging Face causal LM.

Sampling follows what an RL trainer needs from an engine:

- prompts are left-padded into chunks of at most ``max_batch_size`` sequences; one prefill
  fills the KV cache, then each step decodes one token for the sequences still running
  (finished rows are dropped from the cache, so their cost stops). Identical prompts of a
  chunk (a GRPO group's samples) are prefilled once and their cache rows copied, as a
  prefix cache would serve them; each text is tokenized once per call;
- randomness comes only from the ``torch.Generator`` passed in: one uniform draw per row of
  the chunk per step (inverse-CDF sampling), so identical inputs and generator state give
  identical samples, and a row's sample does not depend on when other rows finish;
- ``response_logprobs`` are log-softmax of the temperature-scaled logits (logits / T),
  taken *before* top-p truncation; at ``T == 0`` (greedy) they are of the unscaled logits.
  At the default T = 1 this is the distribution the trainer recomputes;
- an EOS token or a stop string ends a row with ``finish_reason="stop"``; its tokens stay in
  ``response_ids`` (the trainer learns to stop) while the text leaves out special tokens
  and is cut before the stop string (see ``Completion``); ``max_new_tokens`` gives "length".

Served weights are the model's ``state_dict()`` (so non-persistent buffers such as rotary
``inv_freq`` are not weights), without tied duplicates (``miles_events.rl.weights``): with
tied embeddings only the first name of a shared tensor (``model.embed_tokens.weight``) is
served and checksummed, and a load may name the tensor by either name. The served tensors
live in flat buckets, one per dtype (``miles_events.device.buckets``): a publication staged in
buckets of the same layout loads with one copy per dtype, and ``checksums`` fingerprints
every tensor in one launch per dtype on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import CacheLayerMixin

from actors.engine.base import (
    TENSOR_CHECK_ACTIONS,
    Completion,
    Engine,
    GenerateRequest,
    SamplingParams,
    encode_prompt,
    find_stop,
    name_list,
    single_rank_report,
    tensors_match,
)
from actors.engine.in_flight import InFlightUpdates
from actors.engine.sampling import sample_tokens, sample_uniforms
from actors.engine.static_decode import Decoded, EndCheck, Prefill, RowEnd, StaticDecoder, row_end, supports
from miles_events.bus.cancel import Cancellation
from miles_events.device.buckets import (
    Buckets,
    bucket_parameters,
    byte_view,
    fingerprint_buckets,
    layouts_tensor_bytes,
)
from miles_events.device.fingerprint import tensor_fingerprint
from miles_events.device.offload import HOST, HostCopies, move_buckets
from miles_events.rl.canary import CANARY_BYTES, CANARY_TENSOR, split_canary
from miles_events.rl.checksum import is_skipped
from miles_events.rl.hf_model import cache_kwarg, load_model, load_tokenizer
from miles_events.rl.probe import teacher_forced_logprobs
from miles_events.rl.weights import split_tied
from miles_events.transport.base import BucketStream, Transport
from schemas.checksums import EngineChecksumReport, Selector, TensorCheckAction, WeightsCheckResult
from schemas.config import Config
from schemas.data import BucketLayout, DataRef

DECODE_MODES = ("auto", "eager", "static", "cuda_graph")
"""``eager``: a growing KV cache and a host look at every token (any model, any device);
``static``: ``StaticDecoder`` without graphs; ``cuda_graph``: ``StaticDecoder`` replaying
CUDA graphs; ``auto``: ``cuda_graph`` on CUDA for a model it supports, ``eager`` otherwise."""


class TorchEngine(Engine):
    """One copy of a Hugging Face causal LM serving completions in this process."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str = "engine-0",
        max_batch_size: int = 256,
        transport: Transport | None = None,
        decode: str = "auto",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.name = name
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.transport = transport
        """Where ``load_weights`` reads published weights from."""
        self.device = next(model.parameters()).device
        self._weight_version = "default"
        self.updates = InFlightUpdates()
        """Loads that land between decode steps (``rollout.partial``)."""
        self._canary = torch.zeros(CANARY_BYTES, dtype=torch.uint8, device=self.device)
        """The publication canary of the payload loaded last (``miles_events.rl.canary``)."""
        self._canary_loaded = False
        served, self._aliases = split_tied(model.state_dict())
        self._buckets = bucket_parameters(model, served)
        """The served tensors, each now a view of its dtype's flat bucket."""
        self._last_plan: tuple[tuple[BucketLayout, ...], tuple[list[int], list[int]] | None] | None = None
        """The staged layouts ``_bucket_plan`` saw last, and its answer."""
        self._served = self._buckets.tensors()
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._eos_ids = _eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._eos_ids, default=0)
        self._cache_kwarg = cache_kwarg(model)
        self._decoder = self._decoder_for(decode)
        self.decode_mode = (
            "eager" if self._decoder is None else "cuda_graph" if self._decoder.cuda_graphs else "static"
        )
        """How this engine decodes: ``eager``, ``static`` or ``cuda_graph`` (see ``DECODE_MODES``)."""
        self._host_copies = HostCopies()
        """The weights' pinned host copy, kept from one offload to the next (on a GPU)."""
        self._released: set[str] = set()
        """The kinds of memory released (``release_memory``) and not resumed yet."""
        self.memory_device = str(self.device)

    def _decoder_for(self, decode: str) -> StaticDecoder | None:
        if decode not in DECODE_MODES:
            raise ValueError(f"unknown decode mode {decode!r}; known: {', '.join(DECODE_MODES)}")
        unsupported = supports(self.model)
        if decode == "auto":
            if self.device.type != "cuda" or unsupported is not None:
                return None
            decode = "cuda_graph"
        if decode == "eager":
            return None
        if unsupported is not None:
            raise ValueError(f"decode mode {decode!r} does not support this model: {unsupported}")
        return StaticDecoder(self.model, self._cache_kwarg, cuda_graphs=decode == "cuda_graph")

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        name: str = "engine-0",
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        max_batch_size: int = 256,
        transport: Transport | None = None,
        decode: str = "auto",
    ) -> TorchEngine:
        """Load the model and tokenizer of a Hugging Face directory onto ``device``."""
        model = load_model(path, dtype, torch.device(device))
        return cls(
            model,
            load_tokenizer(path),
            name=name,
            max_batch_size=max_batch_size,
            transport=transport,
            decode=decode,
        )

    @classmethod
    def from_config(cls, config: Config, *, index: int, name: str, transport: Transport) -> TorchEngine:
        """On CUDA when this process sees a GPU (engine ``index`` on GPU ``index`` modulo the
        count), on CPU otherwise."""
        if config.model.path is None:
            raise ValueError("model.path is unset: the session sets it to the base model before actors start")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls.from_pretrained(
            config.model.path,
            name=name,
            dtype=config.model.dtype,
            device=f"cuda:{index % gpus}" if gpus else "cpu",
            max_batch_size=config.rollout.max_batch_size,
            transport=transport,
            decode=config.rollout.decode,
        )

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def served_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this engine serves, by Hugging Face name (views, not copies)."""
        return dict(self._served)

    # --- generation ----------------------------------------------------------------------

    def encode(self, request: GenerateRequest) -> list[int]:
        """Token ids of one prompt: text through the tokenizer, ids as they are."""
        return encode_prompt(request, lambda: self.tokenizer)

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        cancel: Cancellation | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Sample one completion per request (see the module docstring for the semantics);
        with ``seeds``, each request's draws come from its own seed, not from ``generator``."""
        if seeds is not None and len(seeds) != len(requests):
            raise ValueError(f"{len(seeds)} seeds for {len(requests)} requests")
        self._require_resident("generate", ("weights", "kv_cache", "cuda_graph"))
        encoded: dict[str, list[int]] = {}  # a group's samples share one prompt text

        def encode(request: GenerateRequest) -> list[int]:
            if not isinstance(request, str):
                return self.encode(request)
            if request not in encoded:
                encoded[request] = self.encode(request)
            return encoded[request]

        prompt_ids = [encode(request) for request in requests]
        completions: list[Completion] = []
        with torch.inference_mode():
            for start in range(0, len(prompt_ids), self.max_batch_size):
                chunk = prompt_ids[start : start + self.max_batch_size]
                uniforms = None
                if seeds is not None and sampling.temperature > 0:
                    chunk_seeds = list(seeds[start : start + self.max_batch_size])
                    uniforms = sample_uniforms(chunk_seeds, sampling.max_new_tokens).to(self.device)
                with self.updates.generating():  # a waiting load lands between chunks
                    completions.extend(self._generate_chunk(chunk, sampling, generator, cancel, uniforms))
        return completions

    def in_flight_load(self) -> AbstractContextManager[None]:
        return self.updates.loading()

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits of the last position of every row, in float32."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _prefill(self, prompt_ids: list[list[int]]) -> tuple[DynamicCache, Prefill]:
        """One forward over the chunk's distinct prompts, left-padded; their cache rows and
        logits expanded to one row per prompt."""
        rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
        # One prefill row per distinct prompt; ``source[row]`` is the row's prefill row.
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
        unique = [list(ids) for ids in distinct]
        input_rows = [[self._pad_id] * (width - len(ids)) + ids for ids in unique]
        mask_rows = [[0] * (width - len(ids)) + [1] * len(ids) for ids in unique]
        input_ids = torch.tensor(input_rows, dtype=torch.long, device=self.device)
        attention_mask = torch.tensor(mask_rows, dtype=torch.long, device=self.device)
        # Left padding: each prompt's first real token sits at position 0.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        if len(unique) < rows:
            expand = torch.tensor(source, dtype=torch.long, device=self.device)
            cache.batch_select_indices(expand)
            logits, attention_mask, position_ids = (
                logits[expand],
                attention_mask[expand],
                position_ids[expand],
            )
        # What the static decoder copies: it decodes only models whose every layer is full
        # attention (``supports``), each then holding keys and values; the eager loop reads
        # the cache itself.
        layers = [
            (layer.keys, layer.values)
            for layer in cache.layers
            if isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
        ]
        return cache, Prefill(layers, logits, attention_mask, position_ids[:, -1] + 1)

    def _stop_check(self, stops: Sequence[str]) -> EndCheck | None:
        """Whether a row's response so far ends at a stop string (None: no stop strings)."""
        if not stops:
            return None

        def ends(ids: list[int]) -> RowEnd | None:
            text = self._decode(ids)
            cut, stop = find_stop(text, stops)
            return RowEnd(len(ids) - 1, "stop", text[:cut], stop) if stop is not None else None

        return ends

    def _generate_chunk(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        generator: torch.Generator | None,
        cancel: Cancellation | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> list[Completion]:
        """``uniforms`` ([rows, max_new_tokens]): each row's draws, in place of ``generator``'s."""
        version = self._weight_version
        cache, prefill = self._prefill(prompt_ids)
        eos_ids = frozenset() if sampling.ignore_eos else self._eos_ids
        ends = self._stop_check(sampling.stop)
        if self._decoder is not None:
            decoded = self._decoder.decode(
                prefill,
                sampling.max_new_tokens,
                sampling.temperature,
                sampling.top_p,
                generator if uniforms is None else None,
                eos_ids,
                ends,
                cancel.check if cancel is not None else None,
                uniforms,
            )
        else:
            decoded = self._decode_eager(cache, prefill, sampling, generator, eos_ids, ends, cancel, uniforms)

        # Each distinct response is decoded once (short answers repeat within a group), all
        # in one batch call.
        rows = range(len(prompt_ids))
        keys = list({tuple(decoded.response_ids[row]) for row in rows if decoded.ends[row].text is None})
        texts = self.tokenizer.batch_decode([list(k) for k in keys], skip_special_tokens=True)
        decoded_text = dict(zip(keys, texts, strict=True))
        changes = decoded.version_changes
        return [
            Completion(
                prompt_ids=list(prompt_ids[row]),
                response_ids=decoded.response_ids[row],
                response_logprobs=decoded.response_logprobs[row],
                response=end.text if end.text is not None else decoded_text[tuple(decoded.response_ids[row])],
                finish_reason="stop" if end.reason == "stop" else "length",
                weight_version=version,
                matched_stop=end.matched,
                version_spans=(
                    [(0, version)] + [(t, v) for t, v in changes if t < len(decoded.response_ids[row])]
                    if changes
                    else []
                ),
            )
            for row, end in zip(rows, decoded.ends, strict=True)
        ]

    def _decode_eager(
        self,
        cache: DynamicCache,
        prefill: Prefill,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        eos_ids: frozenset[int],
        ends: EndCheck | None,
        cancel: Cancellation | None,
        uniforms: torch.Tensor | None = None,
    ) -> Decoded:
        """The decode loop with a growing cache and a look at every token: one step's
        launches and one host sync per token."""
        logits, attention_mask, next_position = prefill.logits, prefill.attention_mask, prefill.next_position
        rows = logits.shape[0]
        active = list(range(rows))  # chunk rows still running, in cache order
        response_ids: list[list[int]] = [[] for _ in range(rows)]
        response_logprobs: list[list[float]] = [[] for _ in range(rows)]
        ended: dict[int, RowEnd] = {}
        changes: list[tuple[int, str]] = []
        version = self._weight_version

        for step in range(sampling.max_new_tokens):
            if cancel is not None:
                cancel.check()  # a cancellation point: every decode step
            uniform = None
            if sampling.temperature > 0 and uniforms is not None:
                uniform = uniforms[active, step]
            elif sampling.temperature > 0:
                draws = torch.rand(rows, generator=generator, dtype=torch.float32)
                uniform = draws[active].to(self.device)
            tokens, logprobs = sample_tokens(logits, sampling.temperature, sampling.top_p, uniform)
            running: list[int] = []
            for slot, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
                row = active[slot]
                response_ids[row].append(token)
                response_logprobs[row].append(logprob)
                end = row_end(response_ids[row], step, eos_ids, ends)
                if end is not None:
                    ended[row] = end
                else:
                    running.append(slot)
            if not running or step == sampling.max_new_tokens - 1:
                break
            if len(running) < len(active):
                keep = torch.tensor(running, dtype=torch.long, device=self.device)
                cache.batch_select_indices(keep)
                attention_mask, tokens = attention_mask[keep], tokens[keep]
                next_position = next_position[keep]
                active = [active[slot] for slot in running]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            if self.updates.boundary() and self._weight_version != version:
                # A load landed: the tokens from the next on are sampled with its weights
                # (the cache of the tokens before keeps the keys and values it had).
                version = self._weight_version
                changes.append((step + 1, version))
            logits = self._forward(tokens.unsqueeze(1), attention_mask, next_position.unsqueeze(1), cache)
            next_position = next_position + 1
        for row in range(rows):
            ended.setdefault(row, RowEnd(len(response_ids[row]) - 1, "length"))
        return Decoded(response_ids, response_logprobs, [ended[row] for row in range(rows)], changes)

    def probe_logprobs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        self._require_resident("answer the probe", ("weights",))
        return teacher_forced_logprobs(self.model, prompt_ids, response_ids)

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not isinstance(text, str):  # a list of texts answers a batch, never one row
            raise TypeError(f"the tokenizer decoded one row of ids to {type(text).__name__}")
        return text

    # --- weights -------------------------------------------------------------------------

    def load_weights(self, weights: DataRef, weight_version: str) -> int:
        """Read the tensors behind ``weights`` from this engine's transport and load them
        (``load_tensors``); returns the bytes read. On a GPU it returns with the copies
        queued: what this engine runs next (the fingerprints of what it serves, generation)
        runs behind them on its stream, and the transport tells the producer when it may
        write its buffers again (``Transport.done_reading``)."""
        if self.transport is None:
            raise ValueError(
                f"engine {self.name} has no transport to read {weights.transport}:{weights.key} from"
            )
        if weights.transport != self.transport.name:
            raise ValueError(
                f"engine {self.name} reads the {self.transport.name} transport, "
                f"not {weights.transport} ({weights.key})"
            )
        self._require_resident("load weights", ("weights",))
        stream = self.transport.reader.stream_buckets(weights, self.name, self.device)
        if stream is not None:
            try:
                num_bytes = self._load_stream(stream, weight_version)
            finally:
                stream.close()
            self.transport.reader.done_reading(weights, self.device)
            return num_bytes
        staged = self.transport.reader.get_buckets(weights)
        if staged is not None and self._load_buckets(staged, weight_version):
            num_bytes = staged.tensor_bytes
        else:
            payload = self.transport.reader.get_tensors(weights)
            self.load_tensors(payload, weight_version)
            num_bytes = sum(t.numel() * t.element_size() for t in payload.values())
        self.transport.reader.done_reading(weights, self.device)
        return num_bytes

    def _load_stream(self, stream: BucketStream, weight_version: str) -> int:
        """Load buckets sent piece by piece (``collective``): straight into the served
        buckets, each piece as it lands, where they share the layouts; else assembled whole
        and loaded tensor by tensor. A piece that fails to land fails the load, the served
        weights part-written: the fingerprints of what the engine serves then tell."""
        plan = self._bucket_plan(stream.layouts)
        if plan is None:
            staged = stream.assemble(self.device)
            self.load_tensors(staged.tensors(), weight_version)
            return staged.tensor_bytes
        model, canary = plan
        targets: dict[int, torch.Tensor] = {
            index: byte_view(buffer) for index, buffer in zip(model, self._buckets.buffers, strict=True)
        }
        canary_bucket = None
        if canary:
            layout = stream.layouts[canary[0]]
            canary_bucket = torch.empty(layout.numel, dtype=torch.uint8, device=self.device)
            targets[canary[0]] = canary_bucket
        with torch.no_grad():
            stream.receive(lambda bucket, start, end: targets[bucket][start:end])
            if canary_bucket is not None:
                self._canary.copy_(canary_bucket[:CANARY_BYTES])
        self._canary_loaded = self._canary_loaded or canary_bucket is not None
        self._weight_version = str(weight_version)
        return layouts_tensor_bytes(stream.layouts)

    def _load_buckets(self, staged: Buckets, weight_version: str) -> bool:
        """Load ``staged`` bucket by bucket when its model buckets are laid out exactly as
        the served ones (same names, shapes, dtypes and offsets: nothing to check tensor by
        tensor) and the canary has a bucket of its own; False, loading nothing, otherwise."""
        plan = self._bucket_plan(staged.layouts)
        if plan is None:
            return False
        model, canary = plan
        with torch.no_grad():
            self._buckets.copy_from(Buckets(self._buckets.layouts, tuple(staged.buffers[i] for i in model)))
            if canary:
                self._canary.copy_(staged.buffers[canary[0]][:CANARY_BYTES])
        self._canary_loaded = self._canary_loaded or bool(canary)
        self._weight_version = str(weight_version)
        return True

    def _bucket_plan(self, layouts: tuple[BucketLayout, ...]) -> tuple[list[int], list[int]] | None:
        """(the model's buckets, the canary's) among ``layouts`` where they can be loaded
        bucket by bucket, else None; worked out once for the layouts a transport hands over
        again at each publication (comparing a few hundred slots costs about as much as the
        host's part of the rest of a load)."""
        if self._last_plan is not None and self._last_plan[0] is layouts:
            return self._last_plan[1]
        canary = [i for i, layout in enumerate(layouts) if [s.name for s in layout.slots] == [CANARY_TENSOR]]
        model = [i for i in range(len(layouts)) if i not in canary]
        plan = (
            None
            if len(canary) > 1 or tuple(layouts[i] for i in model) != self._buckets.layouts
            else (model, canary)
        )
        self._last_plan = (layouts, plan)
        return plan

    holds_canary = True

    def served_canary(self) -> str:
        # Fingerprinted from the buffer the load wrote, as the weights are: a load that
        # copies nothing leaves the previous publication's canary here.
        return tensor_fingerprint(self._canary) if self._canary_loaded else ""

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], weight_version: str) -> None:
        """Copy ``tensors`` into the served parameters, then serve them as ``weight_version``.

        Every served tensor must be given (a tied tensor under either of its names), no
        unknown name may be given, and shapes must match; otherwise ``ValueError`` names the
        offenders and nothing is copied. Dtypes are converted to the served dtype. The
        publication canary (``CANARY_TENSOR``), when given, is copied with them into the
        engine's canary buffer, which ``served_canary`` fingerprints.
        """
        model_tensors, canary = split_canary(tensors)
        plan = self._load_plan(model_tensors)
        if canary is not None:
            # The canary goes through the same copy as every weight, into its own buffer.
            plan.append((self._canary, canary))
        with torch.no_grad():
            torch._foreach_copy_([t for t, _ in plan], [source for _, source in plan])
        self._canary_loaded = self._canary_loaded or canary is not None
        self._weight_version = str(weight_version)

    def _load_plan(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        unknown = sorted(n for n in tensors if n not in self._served and n not in self._aliases)
        missing: list[str] = []
        wrong_shape: list[str] = []
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        names_of = {name: [name] for name in self._served}
        for alias, canonical in self._aliases.items():
            names_of[canonical].append(alias)
        for canonical, target in self._served.items():
            given = [n for n in names_of[canonical] if n in tensors]
            if not given:
                missing.append(canonical)
                continue
            for n in given:
                if tuple(tensors[n].shape) != tuple(target.shape):
                    wrong_shape.append(f"{n} {tuple(tensors[n].shape)} (serves {tuple(target.shape)})")
            plan.append((target, tensors[given[0]]))
        problems = [
            f"{label}: {name_list(names)}"
            for label, names in (("unknown", unknown), ("missing", missing), ("wrong shape", wrong_shape))
            if names
        ]
        if problems:
            raise ValueError(f"engine {self.name} cannot load these weights; " + "; ".join(problems))
        return plan

    def _select(self, selector: Selector) -> dict[str, torch.Tensor]:
        if selector in ("all", "target"):
            return self._served
        if selector == "draft":
            return {}  # no speculative draft model in this engine
        raise ValueError(f"unknown selector {selector!r}; known: all, target, draft")

    def _selected(self, selector: Selector, skip_tensor_list: Iterable[str]) -> dict[str, torch.Tensor]:
        skip = list(skip_tensor_list)
        return {n: t for n, t in self._select(selector).items() if not is_skipped(n, skip)}

    def checksums(
        self, skip_tensor_list: Iterable[str] = (), selector: Selector = "all"
    ) -> EngineChecksumReport:
        """The fingerprints of the selected tensors, as one rank (this engine has no tensor
        parallelism); ``"draft"`` selects nothing."""
        self._require_resident("fingerprint its weights", ("weights",))
        # Every served tensor lives in the buckets: a selection is all of them or none.
        checksums = fingerprint_buckets(self._buckets, skip_tensor_list) if self._select(selector) else {}
        return single_rank_report(checksums, f"checksums of {len(checksums)} tensors")

    def weights_check(
        self,
        action: TensorCheckAction,
        selector: Selector = "all",
        skip_tensor_list: Iterable[str] = (),
        allow_quant_error: bool = False,
    ) -> WeightsCheckResult:
        """SGLang's ``/weights_checker`` actions on what this engine serves.

        ``snapshot`` copies the selected tensors to CPU; ``reset_tensors`` overwrites them with
        random data; ``compare`` checks them against the snapshot bitwise (with
        ``allow_quant_error``: within one ULP of their dtype). ``"draft"`` selects nothing.
        """
        if action not in TENSOR_CHECK_ACTIONS:
            known = ", ".join(TENSOR_CHECK_ACTIONS)
            return self.check_result(
                action, False, f"unknown action {action!r}; known: {known} (and checksum)"
            )
        self._require_resident(f"run {action}", ("weights",))
        selected = self._selected(selector, skip_tensor_list)
        if selector == "draft":
            return self.check_result(action, True, f"{action}: no draft model, nothing selected")
        if action == "snapshot":
            self._snapshot = {n: t.detach().to("cpu", copy=True) for n, t in selected.items()}
            return self.check_result(
                action, True, f"snapshot of {len(selected)} tensors", num_tensors=len(selected)
            )
        if action == "reset_tensors":
            self._reset(selected)
            message = f"reset {len(selected)} tensors to random data"
            return self.check_result(action, True, message, num_tensors=len(selected))
        return self._compare(selected, allow_quant_error)

    def _reset(self, selected: Mapping[str, torch.Tensor]) -> None:
        # A private generator: resetting must not move the process-wide RNG, which a
        # trainer in the same process relies on for reproducibility.
        seed = int.from_bytes(os.urandom(8), "little") >> 1
        generators: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for tensor in selected.values():
                gen = generators.get(tensor.device)
                if gen is None:
                    gen = generators[tensor.device] = torch.Generator(device=tensor.device).manual_seed(seed)
                if tensor.is_floating_point():
                    tensor.normal_(generator=gen)
                elif tensor.dtype == torch.bool:
                    tensor.random_(0, 2, generator=gen)
                else:
                    tensor.random_(generator=gen)

    def _compare(self, selected: Mapping[str, torch.Tensor], allow_quant_error: bool) -> WeightsCheckResult:
        if self._snapshot is None:
            return self.check_result("compare", False, "compare: no snapshot; run the snapshot action first")
        absent = sorted(n for n in selected if n not in self._snapshot)
        differ = sorted(
            n
            for n, t in selected.items()
            if n in self._snapshot and not tensors_match(t, self._snapshot[n], allow_quant_error)
        )
        if absent or differ:
            parts = [
                f"{len(differ)} of {len(selected)} tensors differ from the snapshot: {name_list(differ)}"
            ]
            if absent:
                parts.append(f"not in the snapshot: {name_list(absent)}")
            return self.check_result(
                "compare",
                False,
                "; ".join(parts),
                num_tensors=len(selected),
                mismatched=differ,
                missing=absent,
            )
        mode = "within one ULP" if allow_quant_error else "bitwise"
        message = f"{len(selected)} tensors equal the snapshot ({mode})"
        return self.check_result("compare", True, message, num_tensors=len(selected))

    # --- offload and onload ----------------------------------------------------------------

    def _require_resident(self, what: str, needs: Sequence[str]) -> None:
        released = sorted(self._released.intersection(needs))
        if released:
            raise RuntimeError(
                f"{self.name} cannot {what} while its {', '.join(released)} memory is released "
                "(offloaded): resume it first"
            )

    def release_memory(self, tags: Sequence[str]) -> int:
        """Free what ``tags`` name: ``cuda_graph`` the captured graphs, ``kv_cache`` the
        static decoder's buffers (and the graphs, which replay them), ``weights`` the served
        weights, to a host copy (the graphs go too: they captured the weights' addresses).
        Returns the tensor bytes freed on the device."""
        unknown = sorted(set(tags) - {"cuda_graph", "kv_cache", "weights"})
        if unknown:
            raise ValueError(
                f"{self.name}: unknown memory tags {unknown}; known: cuda_graph, kv_cache, weights"
            )
        freed = 0
        if self._decoder is not None:
            if "kv_cache" in tags:
                freed += self._decoder.buffer_bytes()
                self._decoder.close()
            elif "cuda_graph" in tags or "weights" in tags:
                self._decoder.drop_graphs()
        if "weights" in tags and "weights" not in self._released:
            freed += self._move_weights(torch.device(HOST))
        self._released.update(tags)
        return freed

    def resume_memory(self, tags: Sequence[str]) -> int:
        """Take back what ``tags`` name: the weights from their host copy to the device; the
        KV cache and the graphs are allocated and captured again by the next decode."""
        resumed = 0
        if "weights" in tags and "weights" in self._released:
            resumed += self._move_weights(self.device)
        self._released.difference_update(tags)
        return resumed

    def _move_weights(self, device: torch.device) -> int:
        owners = self.model.state_dict(keep_vars=True)
        self._buckets = move_buckets(owners, self._buckets, device, self._host_copies)
        self._served = self._buckets.tensors()
        self._last_plan = None
        return self._buckets.num_bytes

    def close(self) -> None:
        self._snapshot = None
        if self._decoder is not None:
            self._decoder.close()


def _eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    return frozenset(ids)
