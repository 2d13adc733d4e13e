"""Decoding with a static KV cache and device-side sampling, replayed from CUDA graphs.

The embedded engine's eager loop (``TorchEngine``) grows a ``DynamicCache`` and reads every
sampled token back to the host before launching the next step: on a GPU it is bound by
kernel launches and host round trips, not by memory. This decoder keeps the same sampling
semantics and runs the steps without the host:

- the K/V of a chunk live in fixed buffers, ``[batch, kv_heads, length, head_dim]`` per
  layer (``SlotCache``); prefill fills slots ``[0, width)`` and decode step ``s`` writes
  slot ``width + s``; an additive mask in a fixed buffer (0 where a row attends, the
  dtype's minimum elsewhere) says which slots each row attends to, so left padding works as
  in the eager loop;
- every uniform draw of the chunk is taken up front, in the order the eager loop takes
  them (one ``torch.rand(rows)`` per step from the same generator), and the generator is
  left where the eager loop would leave it; a step samples on the device with
  ``sample_tokens`` and writes token and log-probability into output buffers;
- one step is a fixed sequence of kernels over fixed buffers, so on CUDA it is captured
  once per (batch size, temperature, top-p) and replayed: one graph launch per token;
- the host looks every ``sync_every`` steps: EOS tokens and stop strings end rows exactly
  where the eager loop ends them (later tokens of an ended row are computed and dropped),
  and when the running rows fit a smaller captured batch size they move to the front and
  decoding goes on at that size, so finished rows stop costing.

Only models whose layers all use full attention through ``sdpa`` or ``eager`` attention
take this path (``supports``); the engine decodes others with its eager loop. An ``sdpa``
model is switched to ``decode_sdpa``, which attends a single query token to grouped K/V
heads without first repeating them (``repeat_kv`` would copy the whole cache, twice per
layer and step); every other call goes to Hugging Face's ``sdpa`` unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from actors.engine.sampling import sample_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SYNC_EVERY = 16
"""Decode steps between two looks of the host at the sampled tokens."""

LENGTH_ALIGN = 64
"""Cache lengths are rounded up to a multiple of this, so chunks of slightly different
prompt widths share buffers and graphs."""

MAX_BUFFER_SETS = 2
"""Buffer sets (with their graphs) kept for reuse; the least recently used goes first."""

_CAPTURE_LOCK = threading.Lock()
"""One CUDA graph capture at a time in a process (engines may decode in several threads)."""


DECODE_ATTENTION = "miles_events_decode_sdpa"
"""The name ``decode_sdpa`` is registered under with Hugging Face's attention interfaces."""


def decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's ``sdpa`` attention, except for one query token with a mask and grouped
    K/V heads: the query heads of each K/V head become that head's query rows
    (``[batch, kv_heads, group, dim]``), so the cache is read as it is instead of repeated."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or attention_mask is None or module.training:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)
    # The mask [batch, 1, 1, length] broadcasts over the K/V heads and each group's rows.
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_decode_sdpa(model: PreTrainedModel) -> None:
    """Switch an ``sdpa`` model to ``decode_sdpa`` (its masks stay ``sdpa``'s)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_sdpa)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)


class _RMSNorm(Protocol):
    """What a Hugging Face RMSNorm holds."""

    weight: torch.Tensor
    variance_epsilon: float


def _fused_rms_norm(self: _RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm (in float32, scaled in the input dtype) with the
    normalisation in one ``rms_norm`` kernel instead of five."""
    normed = torch.nn.functional.rms_norm(
        hidden_states.float(), hidden_states.shape[-1:], eps=self.variance_epsilon
    )
    return self.weight * normed.to(hidden_states.dtype)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every Hugging Face RMSNorm of ``model`` (Qwen2's, Llama's: a ``weight`` and a
    ``variance_epsilon``) the fused forward; returns how many. The result equals the
    unfused one up to float32 rounding inside the norm."""
    import types

    fused = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_rms_norm, module)
            fused += 1
    return fused


def supports(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot decode here, or None when it can."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager", DECODE_ATTENTION):
        return f"attention implementation {attention!r} (needs sdpa or eager)"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)} (needs full attention in every layer)"
    experts = [
        key for key in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(config, key, None)
    ]
    if experts:
        return f"mixture-of-experts routing ({experts[0]}: data-dependent shapes a graph cannot hold)"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in ("dynamic", "longrope"):
        return f"{rope_type} rotary scaling (recomputed from the sequence length on the host)"
    return None


class SlotCache:
    """The K/V buffers of every layer at one batch size; ``update`` writes the step's keys
    and values at ``slot`` and returns the whole buffers (the mask hides unwritten slots).

    It implements the one method a Hugging Face attention layer calls on its cache.
    """

    def __init__(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], slot: torch.Tensor
    ) -> None:
        self.keys, self.values, self.slot = list(keys), list(values), slot

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slot, key_states)
        values.index_copy_(2, self.slot, value_states)
        return keys, values


@dataclass
class Prefill:
    """A chunk after its prompt pass: one row per sample (a group's rows already expanded)."""

    cache_layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer, keys and values of the prompts ``[rows, kv_heads, width, head_dim]``."""
    logits: torch.Tensor
    """``[rows, vocab]`` float32 logits of each prompt's last position."""
    attention_mask: torch.Tensor
    """``[rows, width]``, 1 on prompt tokens, 0 on left padding."""
    next_position: torch.Tensor
    """``[rows]``, the position of each row's first response token."""


@dataclass
class RowEnd:
    """Where a row ended: its last token's step, and for a stop string the cut text."""

    step: int
    reason: str  # "stop" or "length"
    text: str | None = None
    matched: str | None = None


@dataclass
class Decoded:
    """Per chunk row: response tokens, their log-probabilities, and how the row ended."""

    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    ends: list[RowEnd]
    version_changes: list[tuple[int, str]] = field(default_factory=list)
    """(response token index, weight version) where a load landed between decode steps:
    that token and those after it were sampled with that version."""


EndCheck = Callable[[list[int]], RowEnd | None]
"""Given a row's response ids so far, where a stop string ends it (at its last token), or
None."""


def row_end(ids: list[int], step: int, eos_ids: frozenset[int], ends: EndCheck | None) -> RowEnd | None:
    """Whether a row ends at its last token ``ids[-1]``, sampled at ``step``: an EOS token
    ends it, else a stop string (``ends``); the rule of both decode loops."""
    if ids[-1] in eos_ids:
        return RowEnd(step, "stop")
    return ends(ids) if ends is not None else None


@dataclass
class _Buffers:
    """Every tensor a step reads or writes, at fixed addresses (what a CUDA graph replays)."""

    capacity: int
    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor  # [capacity, vocab] float32: the next step samples from these
    tokens: torch.Tensor  # [capacity] the tokens fed to the forward
    positions: torch.Tensor  # [capacity] their positions
    mask: torch.Tensor  # [capacity, 1, 1, length] additive, in the model's dtype
    slot: torch.Tensor  # [1] the cache slot this step writes
    step: torch.Tensor  # [1] the step index
    row_ids: torch.Tensor  # [capacity] chunk row of each batch slot; ``capacity`` = none
    uniforms: torch.Tensor  # [length, capacity + 1] float32, by step and chunk row
    out_tokens: torch.Tensor  # [capacity + 1, length] by chunk row and step
    out_logprobs: torch.Tensor  # [capacity + 1, length] float32
    caches: dict[int, SlotCache] = field(default_factory=dict)
    graphs: dict[tuple[int, float, float], torch.cuda.CUDAGraph] = field(default_factory=dict)

    def cache(self, batch: int) -> SlotCache:
        if batch not in self.caches:
            self.caches[batch] = SlotCache(
                [k[:batch] for k in self.keys], [v[:batch] for v in self.values], self.slot
            )
        return self.caches[batch]


class StaticDecoder:
    """Decodes chunks of one model with static buffers; with ``cuda_graphs`` (CUDA only),
    each step is a graph replay."""

    def __init__(
        self,
        model: PreTrainedModel,
        cache_kwarg: str,
        *,
        cuda_graphs: bool,
        sync_every: int = SYNC_EVERY,
    ) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"static decoding does not support this model: {reason}")
        self.model = model
        self.device = next(model.parameters()).device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not one on {self.device}")
        self.cuda_graphs = cuda_graphs
        self.sync_every = sync_every
        self._cache_kwarg = cache_kwarg
        if model.config._attn_implementation == "sdpa":
            use_decode_sdpa(model)
        if cuda_graphs:
            fuse_rms_norms(model)
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._pool = None
        self._capture_stream = None
        if cuda_graphs:
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()
                self._capture_stream = torch.cuda.Stream(self.device)

    def close(self) -> None:
        """Free the buffers and graphs (the KV cache): the next decode allocates them again."""
        self._buffers.clear()
        self._new_pool()

    def drop_graphs(self) -> None:
        """Free the captured CUDA graphs, keeping the buffers: the next decode captures them
        again."""
        for buf in self._buffers.values():
            buf.graphs.clear()
        self._new_pool()

    def _new_pool(self) -> None:
        """Graphs captured from now on share a new memory pool: the old one went with the
        graphs that used it (the caching allocator frees a private pool once its last graph
        is destroyed, and refuses a capture into it after that)."""
        if self._pool is not None:
            with torch.cuda.device(self.device):
                self._pool = torch.cuda.graph_pool_handle()

    def buffer_bytes(self) -> int:
        """Bytes of the buffers held between decodes (the KV cache and the step's tensors)."""
        total = 0
        for buf in self._buffers.values():
            tensors = [*buf.keys, *buf.values, buf.logits, buf.tokens, buf.positions, buf.mask, buf.slot]
            tensors += [buf.step, buf.row_ids, buf.uniforms, buf.out_tokens, buf.out_logprobs]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """This decoder's GPU as the thread's current device (its streams, its graphs)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # --- one step ------------------------------------------------------------------------

    def _step(self, buf: _Buffers, batch: int, temperature: float, top_p: float) -> None:
        """Sample from ``buf.logits``, record, feed the tokens forward: one decode step,
        nothing but device work on fixed buffers."""
        rows = buf.row_ids[:batch]
        uniform = None
        if temperature > 0:
            uniform = buf.uniforms.index_select(0, buf.step).squeeze(0).index_select(0, rows)
        tokens, logprobs = sample_tokens(buf.logits[:batch], temperature, top_p, uniform)
        where = (rows, buf.step.expand(batch))
        buf.out_tokens.index_put_(where, tokens)
        buf.out_logprobs.index_put_(where, logprobs)
        buf.tokens[:batch].copy_(tokens)
        mask = buf.mask[:batch]
        mask.index_fill_(3, buf.slot, 0.0)
        out = self.model(
            input_ids=buf.tokens[:batch].unsqueeze(1),
            position_ids=buf.positions[:batch].unsqueeze(1),
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: buf.cache(batch)},
        )
        buf.logits[:batch].copy_(out.logits[:, -1, :])
        buf.positions[:batch].add_(1)
        buf.slot.add_(1)
        buf.step.add_(1)

    def _run_step(self, buf: _Buffers, batch: int, temperature: float, top_p: float) -> None:
        if self.cuda_graphs:
            buf.graphs[(batch, temperature, top_p)].replay()
        else:
            self._step(buf, batch, temperature, top_p)

    def _capture(self, buf: _Buffers, batches: Sequence[int], temperature: float, top_p: float) -> None:
        """Capture the step at each of ``batches`` not captured yet for this sampling. Runs
        before a chunk's state is set: warm-up runs write the buffers."""
        missing = [b for b in batches if (b, temperature, top_p) not in buf.graphs]
        if not missing:
            return
        with _CAPTURE_LOCK:
            self._capture_locked(buf, missing, temperature, top_p)

    def _capture_locked(
        self, buf: _Buffers, missing: Sequence[int], temperature: float, top_p: float
    ) -> None:
        buf.row_ids.fill_(buf.capacity)
        buf.positions.zero_()
        buf.logits.zero_()
        buf.mask.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for batch in missing:  # warm-up: lazy initialisations happen outside capture
                for _ in range(2):
                    buf.slot.zero_()
                    buf.step.zero_()
                    self._step(buf, batch, temperature, top_p)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for batch in missing:
            buf.slot.zero_()
            buf.step.zero_()
            graph = torch.cuda.CUDAGraph()
            # On this decoder's own stream and GPU; thread_local: a trainer in another thread
            # of this process may call CUDA meanwhile.
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"
            ):
                self._step(buf, batch, temperature, top_p)
            buf.graphs[(batch, temperature, top_p)] = graph

    # --- buffers -------------------------------------------------------------------------

    def _buffers_for(self, prefill: Prefill, capacity: int, length: int) -> _Buffers:
        key = (capacity, length)
        buf = self._buffers.pop(key, None)
        if buf is None:
            while len(self._buffers) >= MAX_BUFFER_SETS:
                self._buffers.pop(next(iter(self._buffers)))
            buf = self._allocate(prefill, capacity, length)
        self._buffers[key] = buf  # most recently used last
        return buf

    def _allocate(self, prefill: Prefill, capacity: int, length: int) -> _Buffers:
        def cache_buffer(like: torch.Tensor) -> torch.Tensor:
            _, heads, _, dim = like.shape
            return torch.zeros(capacity, heads, length, dim, dtype=like.dtype, device=self.device)

        mask_dtype = prefill.cache_layers[0][0].dtype
        return _Buffers(
            capacity=capacity,
            length=length,
            keys=[cache_buffer(k) for k, _ in prefill.cache_layers],
            values=[cache_buffer(v) for _, v in prefill.cache_layers],
            logits=torch.zeros(capacity, prefill.logits.shape[-1], dtype=torch.float32, device=self.device),
            tokens=torch.zeros(capacity, dtype=torch.long, device=self.device),
            positions=torch.zeros(capacity, dtype=torch.long, device=self.device),
            mask=torch.zeros(capacity, 1, 1, length, dtype=mask_dtype, device=self.device),
            slot=torch.zeros(1, dtype=torch.long, device=self.device),
            step=torch.zeros(1, dtype=torch.long, device=self.device),
            row_ids=torch.full((capacity,), capacity, dtype=torch.long, device=self.device),
            uniforms=torch.zeros(length, capacity + 1, dtype=torch.float32, device=self.device),
            out_tokens=torch.zeros(capacity + 1, length, dtype=torch.long, device=self.device),
            out_logprobs=torch.zeros(capacity + 1, length, dtype=torch.float32, device=self.device),
        )

    def _place(
        self, buf: _Buffers, source: Prefill | _Buffers, order: list[int], rows: list[int], width: int
    ) -> None:
        """Fill batch slots ``[0, len(order))`` from ``source``'s rows ``order`` (a prefill,
        or this buffer's own slots when freeing finished rows); ``rows`` are the chunk rows of
        the first slots, and the slots after them, which only fill a batch size, belong to no
        row (``buf.capacity``)."""
        batch = len(order)
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        owners = rows + [buf.capacity] * (batch - len(rows))
        buf.row_ids[:batch].copy_(torch.tensor(owners, dtype=torch.long))
        if isinstance(source, Prefill):
            for (k, v), keys, values in zip(source.cache_layers, buf.keys, buf.values, strict=True):
                keys[:batch, :, :width].copy_(k.index_select(0, index))
                values[:batch, :, :width].copy_(v.index_select(0, index))
            attend = source.attention_mask.index_select(0, index).bool()
            buf.mask[:batch].fill_(torch.finfo(buf.mask.dtype).min)
            buf.mask[:batch, 0, 0, :width].masked_fill_(attend, 0.0)
            buf.positions[:batch].copy_(source.next_position.index_select(0, index))
            buf.logits[:batch].copy_(source.logits.index_select(0, index))
            return
        for tensor in (*buf.keys, *buf.values, buf.mask, buf.positions, buf.logits):
            tensor[:batch].copy_(tensor.index_select(0, index))  # the gather copies first: slots overlap

    # --- a chunk -------------------------------------------------------------------------

    def decode(
        self,
        prefill: Prefill,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        eos_ids: frozenset[int],
        ends: EndCheck | None = None,
        cancel_check: Callable[[], None] | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> Decoded:
        """Sample up to ``max_new_tokens`` tokens for every row of ``prefill``: a row ends
        at a token of ``eos_ids``, else where ``ends`` says, else at the length. ``uniforms``
        ([rows, max_new_tokens]): each row's own draws, in place of ``generator``'s."""
        with self._on_device():
            return self._decode(
                prefill, max_new_tokens, temperature, top_p, generator, eos_ids, ends, cancel_check, uniforms
            )

    def _decode(
        self,
        prefill: Prefill,
        steps: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        eos_ids: frozenset[int],
        ends: EndCheck | None,
        cancel_check: Callable[[], None] | None,
        uniforms: torch.Tensor | None = None,
    ) -> Decoded:
        rows = prefill.logits.shape[0]
        width = prefill.attention_mask.shape[1]
        batch = _batch_size(rows)
        length = -(-(width + steps) // LENGTH_ALIGN) * LENGTH_ALIGN
        buf = self._buffers_for(prefill, batch, length)
        if self.cuda_graphs:
            self._capture(buf, _batch_sizes(batch), temperature, top_p)

        with _Draws(generator, temperature, rows) as draw:
            if temperature > 0 and uniforms is not None:
                buf.uniforms[:steps, :rows].copy_(uniforms[:, :steps].T)
            elif temperature > 0:
                buf.uniforms[:steps, :rows].copy_(draw(steps))
            order = list(range(rows)) + [0] * (batch - rows)
            self._place(buf, prefill, order, order[:rows], width)
            buf.slot.fill_(width)
            buf.step.zero_()

            slots = list(range(rows))  # chunk row of each running batch slot
            ids: list[list[int]] = [[] for _ in range(rows)]
            ended: dict[int, RowEnd] = {}
            seen = 0  # steps whose tokens the host has looked at
            for step in range(steps):
                draw.used = step  # what the eager loop has drawn when it reaches this step
                if cancel_check is not None and not self._cancel_point(
                    cancel_check, buf, rows, seen, step, ids, ended, eos_ids, ends
                ):
                    break  # every row had ended: the eager loop would not have reached this check
                self._run_step(buf, batch, temperature, top_p)
                if step + 1 - seen < self.sync_every and step < steps - 1:
                    continue
                block = buf.out_tokens[:rows, seen : step + 1].cpu()  # the host's one sync
                self._look(block, seen, ids, ended, eos_ids, ends, last=step == steps - 1)
                seen = step + 1
                running = [slot for slot, row in enumerate(slots) if row not in ended]
                if not running:
                    break
                smaller = _batch_size(len(running))
                if smaller < batch:
                    order = running + [running[0]] * (smaller - len(running))
                    kept = [slots[slot] for slot in running]
                    self._place(buf, buf, order, kept, width)
                    slots, batch = kept, smaller
            ran = max(end.step for end in ended.values()) + 1
            draw.used = ran  # the eager loop draws once per step it runs
        logprobs = buf.out_logprobs[:rows, :ran].cpu().tolist()
        return Decoded(
            response_ids=ids,  # each row's ids stop at the token that ends it
            response_logprobs=[logprobs[row][: ended[row].step + 1] for row in range(rows)],
            ends=[ended[row] for row in range(rows)],
        )

    def _cancel_point(
        self,
        cancel_check: Callable[[], None],
        buf: _Buffers,
        rows: int,
        seen: int,
        step: int,
        ids: list[list[int]],
        ended: dict[int, RowEnd],
        eos_ids: frozenset[int],
        ends: EndCheck | None,
    ) -> bool:
        """The eager loop's cancellation point before step ``step``: True to go on. A
        cancellation raises unless the steps the host has not looked at yet ended every row,
        in which case the eager loop returned before this point and so does this one."""
        try:
            cancel_check()
        except BaseException:
            if step > seen:
                self._look(
                    buf.out_tokens[:rows, seen:step].cpu(), seen, ids, ended, eos_ids, ends, last=False
                )
            if len(ended) < rows:
                raise
            return False
        return True

    @staticmethod
    def _look(
        block: torch.Tensor,
        first_step: int,
        ids: list[list[int]],
        ended: dict[int, RowEnd],
        eos_ids: frozenset[int],
        ends: EndCheck | None,
        *,
        last: bool,
    ) -> None:
        """Extend each running row's ``ids`` by its tokens in ``block`` (steps
        ``first_step...``) up to the one that ends it (``row_end``), or, at the ``last``
        step, the length."""
        for row, row_tokens in enumerate(block.tolist()):
            if row in ended:
                continue
            for offset, token in enumerate(row_tokens):
                ids[row].append(token)
                end = row_end(ids[row], first_step + offset, eos_ids, ends)
                if end is not None:
                    ended[row] = end
                    break
            else:
                if last:
                    ended[row] = RowEnd(first_step + len(row_tokens) - 1, "length")


class _Draws:
    """A chunk's uniform draws as the eager loop takes them (``rows`` a step), taken up
    front. On leaving, ``generator`` is set to where the eager loop leaves it after ``used``
    steps (set once known; on an error, the steps before the one that failed). Without a
    generator the draws come from the process's default one, which is not rewound: another
    thread may have drawn from it meanwhile."""

    def __init__(self, generator: torch.Generator | None, temperature: float, rows: int) -> None:
        self.generator = generator
        self.rewind = temperature > 0 and generator is not None
        self.rows = rows
        self.state = generator.get_state() if generator is not None else None
        self.used = 0

    def __call__(self, steps: int) -> torch.Tensor:
        return torch.rand(steps, self.rows, generator=self.generator, dtype=torch.float32)

    def __enter__(self) -> _Draws:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.rewind:
            assert self.generator is not None and self.state is not None
            self.generator.set_state(self.state)
            torch.rand(self.used, self.rows, generator=self.generator, dtype=torch.float32)


def _batch_size(rows: int) -> int:
    """The captured batch size that holds ``rows``: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def _batch_sizes(largest: int) -> list[int]:
    """Every batch size a chunk starting at ``largest`` may shrink to."""
    return [1 << i for i in range(largest.bit_length())]
