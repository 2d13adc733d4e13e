"""The embedded PyTorch inference engine: sampling, weight loading, weight checks."""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec
import pytest
import torch

from actors.engine.base import SamplingParams
from actors.engine.static_decode import fuse_rms_norms, supports
from actors.engine.torch_engine import TorchEngine, sample_tokens
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.device.buckets import Buckets
from miles_events.device.fingerprint import fingerprints, tensor_fingerprint
from miles_events.rl.canary import CANARY_TENSOR, publication_canary
from miles_events.rl.checksum import per_gpu_checksum, report_checksums
from miles_events.rl.hf_model import load_model, load_tokenizer, prepare_base_model
from miles_events.transport.base import BucketStream, open_transport
from miles_events.transport.collective import CollectiveSettings, CollectiveTransport
from schemas.checksums import EngineChecksumReport, ParallelismInfo
from schemas.config import BuiltinModelConfig, ModelConfig
from schemas.data import DataRef

PROMPTS = ["3+4=", "12*3=", "9-", "1", "7*8+1=", "2+2="]


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig(builtin=BuiltinModelConfig(tie_word_embeddings=True))
    return prepare_base_model(config, tmp_path_factory.mktemp("tied"), seed=3)


@pytest.fixture(params=["eager", "static"])
def engine(model_dir: Path, request: pytest.FixtureRequest) -> TorchEngine:
    """Every engine test runs with both decode loops (``cuda_graph`` is ``static`` replayed
    from graphs: tested on a GPU below)."""
    return TorchEngine.from_pretrained(model_dir, max_batch_size=4, decode=request.param)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def full_forward_logprobs(
    engine: TorchEngine, prompt_ids: list[int], response_ids: list[int], temperature: float
) -> torch.Tensor:
    """Log-probabilities of the response tokens from one unpadded, uncached forward pass."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    scaled = logits / temperature if temperature > 0 else logits
    logprobs = torch.log_softmax(scaled, dim=-1)
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
    return logprobs[positions, torch.tensor(response_ids)]


def served_checksums(engine: TorchEngine, **options: object) -> dict[str, str]:
    return report_checksums(engine.checksums(**options))  # type: ignore[arg-type]


def perturbed_state(engine: TorchEngine, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = seeded(seed)
    return {
        name: tensor + 0.01 * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
        for name, tensor in engine.served_tensors().items()
    }


# --- sampling -------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_kv_cached_logprobs_match_full_forward_pass(engine: TorchEngine, temperature: float) -> None:
    sampling = SamplingParams(temperature=temperature, max_new_tokens=10)
    completions = engine.generate(PROMPTS, sampling, seeded(0))
    assert sum(len(c.response_ids) for c in completions) > len(PROMPTS)
    for completion in completions:
        expected = full_forward_logprobs(engine, completion.prompt_ids, completion.response_ids, temperature)
        got = torch.tensor(completion.response_logprobs)
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_a_groups_prompt_is_prefilled_once_and_its_samples_still_match_a_full_forward(
    engine: TorchEngine,
) -> None:
    rows: list[int] = []
    engine.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: rows.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    requests = ["3+4="] * 3 + ["12*3="]  # one chunk (max_batch_size 4), two distinct prompts
    completions = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=6), seeded(0))
    assert rows[0] == 2  # the prefill: one row per distinct prompt
    assert len({tuple(c.response_ids) for c in completions[:3]}) > 1  # each row still draws its own
    for completion in completions:
        expected = full_forward_logprobs(engine, completion.prompt_ids, completion.response_ids, 1.0)
        assert torch.allclose(torch.tensor(completion.response_logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_decoding_is_deterministic_and_ignores_the_generator(engine: TorchEngine) -> None:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    first = engine.generate(PROMPTS, sampling, seeded(1))
    second = engine.generate(PROMPTS, sampling, seeded(2))
    assert [c.response_ids for c in first] == [c.response_ids for c in second]


def test_greedy_decoding_picks_the_argmax_of_a_full_forward_pass(engine: TorchEngine) -> None:
    [completion] = engine.generate(["3+4="], SamplingParams(temperature=0.0, max_new_tokens=6))
    ids = completion.prompt_ids + completion.response_ids
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    start = len(completion.prompt_ids) - 1
    assert logits[start : start + len(completion.response_ids)].argmax(-1).tolist() == completion.response_ids


def test_tiny_top_p_picks_the_argmax(engine: TorchEngine) -> None:
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    tiny = SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8)
    nucleus = engine.generate(PROMPTS, tiny, seeded(5))
    assert [c.response_ids for c in nucleus] == [c.response_ids for c in greedy]


def test_top_p_samples_only_the_nucleus_and_reports_untruncated_logprobs() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(5, 3)
    uniform = torch.tensor([0.0, 0.3, 0.6, 0.8, 0.99])
    tokens, logprobs = sample_tokens(logits, 1.0, 0.6, uniform)
    # The nucleus is {0, 1} (mass 0.8): draws above 0.5 / 0.8 land on token 1, never on 2.
    assert tokens.tolist() == [0, 0, 0, 1, 1]
    assert torch.allclose(logprobs, probs.log()[tokens])


def test_full_top_p_samples_by_inverse_cdf() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2])
    tokens, _ = sample_tokens(probs.log().expand(3, 3), 1.0, 1.0, torch.tensor([0.1, 0.6, 0.9]))
    assert tokens.tolist() == [0, 1, 2]


def test_same_seed_reproduces_samples(engine: TorchEngine) -> None:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    first = engine.generate(PROMPTS, sampling, seeded(11))
    second = engine.generate(PROMPTS, sampling, seeded(11))
    assert [(c.response_ids, c.response_logprobs) for c in first] == [
        (c.response_ids, c.response_logprobs) for c in second
    ]


def test_different_seeds_give_different_samples(engine: TorchEngine) -> None:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    first = engine.generate(PROMPTS, sampling, seeded(11))
    second = engine.generate(PROMPTS, sampling, seeded(12))
    assert [c.response_ids for c in first] != [c.response_ids for c in second]


def test_max_new_tokens_bounds_the_response(engine: TorchEngine) -> None:
    completions = engine.generate(PROMPTS * 3, SamplingParams(temperature=1.0, max_new_tokens=3), seeded(0))
    eos = engine.tokenizer.eos_token_id
    assert all(len(c.response_ids) <= 3 for c in completions)
    for c in completions:
        ended_by_eos = c.response_ids[-1] == eos
        assert c.finish_reason == ("stop" if ended_by_eos else "length")
        assert ended_by_eos or len(c.response_ids) == 3


def test_eos_ends_the_response_and_is_left_out_of_the_text(engine: TorchEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    completions = engine.generate(PROMPTS * 8, SamplingParams(temperature=1.0, max_new_tokens=12), seeded(0))
    ended = [c for c in completions if c.response_ids[-1] == eos]
    assert ended, "the fixed seed is expected to sample EOS somewhere"
    for c in completions:
        assert eos not in c.response_ids[:-1]
    for c in ended:
        assert c.finish_reason == "stop"
        assert c.response == engine.tokenizer.decode(c.response_ids[:-1], skip_special_tokens=True)
        assert "<eos>" not in c.response


def test_stop_string_ends_the_response_and_is_cut_from_the_text(engine: TorchEngine) -> None:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    [free] = engine.generate(["3+4="], sampling, seeded(21))
    assert len(free.response) >= 3, free
    stop = free.response[2]
    cut = free.response.index(stop)
    # The token that completes the stop string is the first whose prefix text contains it.
    decode = engine.tokenizer.decode
    last = next(
        i
        for i in range(len(free.response_ids))
        if stop in decode(free.response_ids[: i + 1], skip_special_tokens=True)
    )
    stopping = SamplingParams(temperature=1.0, max_new_tokens=12, stop=("@@", stop))
    [stopped] = engine.generate(["3+4="], stopping, seeded(21))
    assert stopped.response_ids == free.response_ids[: last + 1]
    assert stopped.response == free.response[:cut]
    assert stopped.finish_reason == "stop"
    assert stopped.matched_stop == stop


def test_completions_come_back_in_request_order_across_chunks(engine: TorchEngine) -> None:
    assert engine.max_batch_size < len(PROMPTS)
    completions = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=2), seeded(0))
    assert [c.prompt_ids for c in completions] == [engine.encode(p) for p in PROMPTS]


def test_token_id_prompts_are_used_as_given(engine: TorchEngine) -> None:
    ids = engine.encode("3+4=")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
    [from_text] = engine.generate(["3+4="], sampling)
    [from_ids] = engine.generate([ids], sampling)
    assert from_ids.prompt_ids == ids and from_ids.response_ids == from_text.response_ids


def test_completions_carry_the_served_weight_version(engine: TorchEngine) -> None:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
    assert engine.generate(["1"], sampling)[0].weight_version == "default"
    engine.load_tensors(perturbed_state(engine), "1")
    assert engine.generate(["1"], sampling)[0].weight_version == "1"


# --- decode loops ---------------------------------------------------------------------------


def same_completions(first: list, second: list) -> None:
    assert [(c.response_ids, c.response, c.finish_reason, c.matched_stop) for c in first] == [
        (c.response_ids, c.response, c.finish_reason, c.matched_stop) for c in second
    ]
    for a, b in zip(first, second, strict=True):
        assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9), (0.0, 1.0)])
def test_static_decoding_samples_what_eager_decoding_samples_and_leaves_the_generator_alike(
    model_dir: Path, temperature: float, top_p: float
) -> None:
    eager = TorchEngine.from_pretrained(model_dir, max_batch_size=16, decode="eager")
    static = TorchEngine.from_pretrained(model_dir, max_batch_size=16, decode="static")
    assert static._decoder is not None
    static._decoder.sync_every = 3  # rows end between looks, and several looks per chunk
    requests = PROMPTS * 5  # two chunks: 16 rows, then 14
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12, stop=("99",))
    first, second = seeded(4), seeded(4)
    same_completions(eager.generate(requests, sampling, first), static.generate(requests, sampling, second))
    assert torch.equal(first.get_state(), second.get_state())


class CancelAfter(Cancellation):
    """Cancelled at its check number ``checks + 1``."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks, self.calls = checks, 0

    def check(self) -> None:
        self.calls += 1
        if self.calls > self.checks:
            self.cancel("cancelled at a decode step")
        super().check()


@pytest.mark.slow
def test_static_decoding_is_cancelled_where_eager_decoding_is_and_rewinds_the_generator_alike(
    model_dir: Path,
) -> None:
    eager = TorchEngine.from_pretrained(model_dir, max_batch_size=16, decode="eager")
    static = TorchEngine.from_pretrained(model_dir, max_batch_size=16, decode="static")
    assert static._decoder is not None
    static._decoder.sync_every = 16  # the host looks later than rows end
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)  # over two of the static loop's looks
    counted = CancelAfter(10**9)
    eager.generate(PROMPTS * 2, sampling, seeded(1), counted)
    # Every check the eager loop makes, and a few after its last (where the static loop,
    # not having looked yet, still runs: those must not cancel a finished chunk).
    for checks in range(counted.calls - 3, counted.calls + 8):
        outcomes = []
        for engine in (eager, static):
            generator = seeded(1)
            try:
                engine.generate(PROMPTS * 2, sampling, generator, CancelAfter(checks))
                outcome = "done"
            except Cancelled:
                outcome = "cancelled"
            outcomes.append((outcome, generator.get_state()))
        assert outcomes[0][0] == outcomes[1][0], checks
        assert torch.equal(outcomes[0][1], outcomes[1][1]), checks


def test_static_decoding_frees_finished_rows_into_a_smaller_batch(model_dir: Path) -> None:
    eager = TorchEngine.from_pretrained(model_dir, max_batch_size=32, decode="eager")
    static = TorchEngine.from_pretrained(model_dir, max_batch_size=32, decode="static")
    decoder = static._decoder
    assert decoder is not None
    decoder.sync_every = 2
    batches: list[int] = []
    run_step = decoder._run_step
    decoder._run_step = lambda buf, batch, *args: (batches.append(batch), run_step(buf, batch, *args))[1]  # type: ignore[method-assign]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)
    requests = PROMPTS * 5  # 30 rows: a batch of 32 with 2 padding rows
    completions = static.generate(requests, sampling, seeded(9))
    same_completions(eager.generate(requests, sampling, seeded(9)), completions)
    lengths = sorted(len(c.response_ids) for c in completions)
    assert lengths[0] < lengths[-1], "the seed is expected to end some rows early"
    assert batches[0] == 32 and batches[-1] < 32 and batches == sorted(batches, reverse=True)
    # Steps after every row ended are not run: the last look ends the chunk.
    assert len(batches) <= lengths[-1] + decoder.sync_every - 1


def test_static_decoding_with_eager_attention_samples_what_eager_decoding_samples(model_dir: Path) -> None:
    engines = []
    for mode in ("eager", "static"):
        model = load_model(model_dir, "float32")
        model.set_attn_implementation("eager")  # additive masks, not sdpa's
        engines.append(TorchEngine(model, load_tokenizer(model_dir), max_batch_size=8, decode=mode))
    assert engines[1].model.config._attn_implementation == "eager"
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    same_completions(*(engine.generate(PROMPTS, sampling, seeded(3)) for engine in engines))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_rms_norm_computes_hugging_faces(model_dir: Path, dtype: torch.dtype) -> None:
    model = load_model(model_dir, "float32").to(dtype)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=seeded(0)).to(dtype)
    with torch.no_grad():
        expected = [norm(hidden) for norm in norms]
        assert fuse_rms_norms(model) == len(norms) == 2 * model.config.num_hidden_layers + 1
        got = [norm(hidden) for norm in norms]
    for a, b in zip(expected, got, strict=True):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(b, a, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"_attn_implementation": "flash_attention_2"}, "attention implementation"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer types"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic rotary scaling"),
        ({}, None),
    ],
)
def test_models_a_graph_cannot_hold_are_named_and_decode_eagerly(config: dict, reason: str | None) -> None:
    model = types.SimpleNamespace(config=types.SimpleNamespace(**{"_attn_implementation": "sdpa", **config}))
    why = supports(model)  # type: ignore[arg-type]
    assert (why is None) if reason is None else (why is not None and reason in why)


def test_ignore_eos_samples_the_full_length(engine: TorchEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    completions = engine.generate(PROMPTS * 8, sampling, seeded(0))
    assert all(len(c.response_ids) == 12 and c.finish_reason == "length" for c in completions)
    assert any(eos in c.response_ids for c in completions), "the fixed seed is expected to sample EOS"


def test_a_decode_mode_the_device_cannot_run_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        TorchEngine.from_pretrained(model_dir, decode="cuda_graph")
    with pytest.raises(ValueError, match="unknown decode mode 'fast'"):
        TorchEngine.from_pretrained(model_dir, decode="fast")
    assert TorchEngine.from_pretrained(model_dir).decode_mode == "eager"  # auto, on a CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_cuda_graph_decoding_samples_what_eager_decoding_samples(model_dir: Path, temperature: float) -> None:
    eager = TorchEngine.from_pretrained(model_dir, max_batch_size=16, device="cuda", decode="eager")
    graphs = TorchEngine.from_pretrained(model_dir, max_batch_size=16, device="cuda")
    assert graphs.decode_mode == "cuda_graph"
    sampling = SamplingParams(temperature=temperature, max_new_tokens=20, stop=("99",))
    requests = PROMPTS * 5
    for seed in (1, 2):  # the second call replays the graphs captured by the first
        first, second = seeded(seed), seeded(seed)
        expected, got = eager.generate(requests, sampling, first), graphs.generate(requests, sampling, second)
        same = sum(a.response_ids == b.response_ids for a, b in zip(expected, got, strict=True))
        # float32 on the GPU: the static cache sums attention over masked slots in another
        # order, so a near-tie may resolve differently; nearly every row is identical.
        assert same >= len(requests) - 2, same
        assert torch.equal(first.get_state(), second.get_state())


# --- weights --------------------------------------------------------------------------------


def test_weight_version_starts_as_default(engine: TorchEngine) -> None:
    assert engine.weight_version == "default"


def test_load_weights_serves_the_new_tensors_under_the_new_version(engine: TorchEngine) -> None:
    state = perturbed_state(engine)
    engine.load_tensors(state, "1")
    assert engine.weight_version == "1"
    assert served_checksums(engine) == fingerprints(state)


@pytest.mark.parametrize("problem", ["unknown", "missing", "wrong shape"])
def test_load_weights_rejects_bad_names_and_shapes_and_loads_nothing(
    engine: TorchEngine, problem: str
) -> None:
    before = served_checksums(engine)
    state = perturbed_state(engine)
    if problem == "unknown":
        state["model.not_a_tensor.weight"] = torch.zeros(2)
        name = "model.not_a_tensor.weight"
    elif problem == "missing":
        name = "model.norm.weight"
        del state[name]
    else:
        name = "model.layers.0.mlp.up_proj.weight"
        state[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=problem) as error:
        engine.load_tensors(state, "1")
    assert name in str(error.value)
    assert engine.weight_version == "default"
    assert served_checksums(engine) == before


def test_checksums_cover_the_state_dict_without_non_persistent_buffers(engine: TorchEngine) -> None:
    checksums = served_checksums(engine)
    assert set(checksums) == set(engine.model.state_dict())
    assert not any("inv_freq" in name for name in checksums)
    assert any("inv_freq" in name for name, _ in engine.model.named_buffers())


def test_checksums_leave_out_skipped_tensors(engine: TorchEngine) -> None:
    checksums = served_checksums(engine, skip_tensor_list=["norm"])
    assert checksums and not any("norm" in name for name in checksums)


def test_tied_embeddings_are_served_once_and_load_under_either_name(tied_model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(tied_model_dir)
    assert "lm_head.weight" not in served_checksums(engine)
    state = perturbed_state(engine)
    engine.load_tensors(state, "1")
    assert torch.equal(engine.model.lm_head.weight, state["model.embed_tokens.weight"])
    by_head = dict(state)
    by_head["lm_head.weight"] = by_head.pop("model.embed_tokens.weight") * 2
    engine.load_tensors(by_head, "2")
    assert torch.equal(engine.model.get_input_embeddings().weight, by_head["lm_head.weight"])


@pytest.mark.parametrize("transport", ["inprocess", "disk"])
def test_load_weights_resolves_a_data_plane_handle(model_dir: Path, tmp_path: Path, transport: str) -> None:
    plane = open_transport(transport, f"run-{transport}", tmp_path)
    engine = TorchEngine.from_pretrained(model_dir, transport=plane)
    state = perturbed_state(engine)
    ref = plane.stager.put_tensors("weights-v1", state, owner="trainer")
    done = []
    plane.reader.done_reading = lambda ref, device: done.append((ref, device))  # type: ignore[method-assign]
    assert engine.load_weights(ref, "1") == sum(t.numel() * t.element_size() for t in state.values())
    assert engine.weight_version == "1" and served_checksums(engine) == fingerprints(state)
    assert done == [(ref, engine.device)]  # the engine tells the transport it is done reading
    plane.close()


def test_weights_staged_in_buckets_of_the_served_layout_load_bucket_by_bucket(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane = open_transport("inprocess", "run-buckets", tmp_path)
    engine = TorchEngine.from_pretrained(model_dir, transport=plane)
    state = perturbed_state(engine)
    canary = publication_canary("run-buckets", "1")
    ref = plane.stager.put_buckets(
        "weights-v1", Buckets.of({**state, CANARY_TENSOR: canary}), owner="trainer"
    )

    def tensor_by_tensor(*args: object) -> None:
        raise AssertionError("the buckets' layout is the engine's: no tensor-by-tensor load")

    monkeypatch.setattr(engine, "load_tensors", tensor_by_tensor)
    done = []
    monkeypatch.setattr(plane.reader, "done_reading", lambda ref, device: done.append((ref, device)))
    assert engine.load_weights(ref, "1") == sum(t.numel() * t.element_size() for t in state.values()) + 16
    assert done == [(ref, engine.device)]
    assert engine.weight_version == "1" and served_checksums(engine) == fingerprints(state)
    assert engine.served_canary() == tensor_fingerprint(canary)
    served = engine.served_tensors()
    assert all(torch.equal(served[n], state[n]) for n in state)
    plane.close()


def test_buckets_staged_again_load_their_new_values_and_a_later_layout_is_checked_again(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transport hands the same buckets (and layouts) over at each publication staged into
    them: the engine works out once that they are its own, and still copies every load; other
    layouts are compared again and loaded tensor by tensor."""
    plane = open_transport("inprocess", "run-restaged", tmp_path)
    engine = TorchEngine.from_pretrained(model_dir, transport=plane)
    staged = Buckets.of(
        {**perturbed_state(engine, seed=3), CANARY_TENSOR: publication_canary("run-restaged", "1")}
    )
    engine.load_weights(plane.stager.put_buckets("weights-v1", staged, owner="trainer"), "1")
    state = perturbed_state(engine, seed=4)
    canary = publication_canary("run-restaged", "2")
    staged.pack({**state, CANARY_TENSOR: canary})  # staged again into the same buckets
    engine.load_weights(plane.stager.put_buckets("weights-v2", staged, owner="trainer"), "2")
    assert served_checksums(engine) == fingerprints(state) and engine.served_canary() == tensor_fingerprint(
        canary
    )
    by_tensor = []
    monkeypatch.setattr(engine, "load_tensors", lambda tensors, version: by_tensor.append(version))
    reordered = Buckets.of(dict(reversed(list(state.items()))))
    engine.load_weights(plane.stager.put_buckets("weights-v3", reordered, owner="trainer"), "3")
    assert by_tensor == ["3"]
    plane.close()


def test_weights_staged_in_buckets_of_another_layout_load_tensor_by_tensor(
    model_dir: Path, tmp_path: Path
) -> None:
    plane = open_transport("inprocess", "run-reordered", tmp_path)
    engine = TorchEngine.from_pretrained(model_dir, transport=plane)
    state = perturbed_state(engine, seed=2)
    reordered = dict(reversed(list(state.items())))
    ref = plane.stager.put_buckets("weights-v1", Buckets.of(reordered), owner="trainer")
    engine.load_weights(ref, "1")
    assert engine.weight_version == "1" and served_checksums(engine) == fingerprints(state)
    plane.close()


def test_weights_broadcast_over_the_collective_land_in_the_served_buckets_chunk_by_chunk(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = CollectiveSettings(bucket_bytes=4096, timeout=10.0)
    plane = CollectiveTransport("run-collective", tmp_path, settings)
    engine = TorchEngine.from_pretrained(model_dir, transport=plane)
    state = perturbed_state(engine, seed=5)
    canary = publication_canary("run-collective", "1")
    ref = plane.stager.publish_buckets(
        "weights-v1", Buckets.of({**state, CANARY_TENSOR: canary}), owner="trainer"
    )
    monkeypatch.setattr(engine, "load_tensors", lambda *args: pytest.fail("loaded tensor by tensor"))
    served = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in engine._buckets.buffers]
    landed: list[tuple[int, int]] = []
    receive = BucketStream.receive

    def recording(self: BucketStream, into: Callable[[int, int, int], torch.Tensor]) -> None:
        def placed(bucket: int, start: int, end: int) -> torch.Tensor:
            target = into(bucket, start, end)
            landed.append((target.data_ptr(), end - start))
            return target

        receive(self, placed)

    monkeypatch.setattr(BucketStream, "receive", recording)
    try:
        assert engine.load_weights(ref, "1") == sum(t.numel() * t.element_size() for t in state.values()) + 16
        assert engine.weight_version == "1" and served_checksums(engine) == fingerprints(state)
        assert engine.served_canary() == tensor_fingerprint(canary)
        model_chunks = [(p, n) for p, n in landed if any(lo <= p < hi for lo, hi in served)]
        assert len(model_chunks) == len(landed) - 1  # all but the canary's land in the served buffers
        assert len(model_chunks) > 1 and all(n <= 4096 for _, n in landed)
    finally:
        plane.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_on_a_gpu_loads_weights_broadcast_over_the_collective(
    model_dir: Path, tmp_path: Path
) -> None:
    plane = CollectiveTransport(
        "run-collective-gpu", tmp_path, CollectiveSettings(bucket_bytes=4096, timeout=30.0)
    )
    engine = TorchEngine.from_pretrained(model_dir, transport=plane, device="cuda")
    gen = seeded(7)
    state = {
        name: tensor.cpu() + 0.01 * torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
        for name, tensor in engine.served_tensors().items()
    }
    canary = publication_canary("run-collective-gpu", "1")
    staged = Buckets.of({**state, CANARY_TENSOR: canary}, device="cuda")  # a trainer on the same GPU
    try:
        engine.load_weights(plane.stager.publish_buckets("weights-v1", staged, owner="trainer"), "1")
        assert engine.weight_version == "1"
        assert served_checksums(engine) == fingerprints(state)
        assert engine.served_canary() == tensor_fingerprint(canary)
    finally:
        plane.close()


def test_weights_broadcast_in_another_layout_load_tensor_by_tensor(model_dir: Path, tmp_path: Path) -> None:
    plane = CollectiveTransport("run-collective-other", tmp_path, CollectiveSettings(timeout=10.0))
    engine = TorchEngine.from_pretrained(model_dir, transport=plane)
    state = perturbed_state(engine, seed=6)
    ref = plane.stager.publish_buckets(
        "weights-v1", Buckets.of(dict(reversed(list(state.items())))), owner="trainer"
    )
    by_tensor = []
    load_tensors = engine.load_tensors

    def counted(tensors: Mapping[str, torch.Tensor], version: str) -> None:
        by_tensor.append(version)
        load_tensors(tensors, version)

    engine.load_tensors = counted  # type: ignore[method-assign]
    try:
        engine.load_weights(ref, "1")
        assert by_tensor == ["1"]
        assert engine.weight_version == "1" and served_checksums(engine) == fingerprints(state)
    finally:
        plane.close()


def test_load_weights_refuses_a_handle_of_another_transport(model_dir: Path, tmp_path: Path) -> None:
    engine = TorchEngine.from_pretrained(model_dir, transport=open_transport("disk", "run-x", tmp_path))
    with pytest.raises(ValueError, match="reads the disk transport, not shm"):
        engine.load_weights(DataRef("shm", "weights-v1", "trainer"), "1")
    assert engine.weight_version == "default"


# --- SGLang weight-checker actions -----------------------------------------------------------


def test_compare_without_a_snapshot_fails(engine: TorchEngine) -> None:
    result = engine.weights_check("compare")
    assert result.success is False and "snapshot" in result.message


def test_compare_right_after_a_snapshot_succeeds(engine: TorchEngine) -> None:
    assert engine.weights_check("snapshot").success
    assert engine.weights_check("compare").success


def test_reset_tensors_changes_every_selected_tensor_and_no_skipped_one(engine: TorchEngine) -> None:
    before = served_checksums(engine)
    assert engine.weights_check("reset_tensors", skip_tensor_list=["norm"]).success
    after = served_checksums(engine)
    for name in before:
        assert (before[name] == after[name]) == ("norm" in name), name


def test_compare_fails_after_reset_and_passes_after_reloading_the_snapshot(engine: TorchEngine) -> None:
    original = {n: t.clone() for n, t in engine.served_tensors().items()}
    engine.weights_check("snapshot")
    engine.weights_check("reset_tensors")
    failed = engine.weights_check("compare")
    assert failed.success is False and failed.action == "compare"
    assert "model.embed_tokens.weight" in failed.mismatched
    engine.load_tensors(original, "1")
    assert engine.weights_check("compare").success


def test_compare_allows_one_ulp_only_with_allow_quant_error(engine: TorchEngine) -> None:
    engine.weights_check("snapshot")
    weight = engine.served_tensors()["model.norm.weight"]
    with torch.no_grad():
        weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))
    assert engine.weights_check("compare").success is False
    assert engine.weights_check("compare", allow_quant_error=True).success
    with torch.no_grad():
        weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))
    assert engine.weights_check("compare", allow_quant_error=True).success is False


def test_compare_ignores_skipped_tensors(engine: TorchEngine) -> None:
    engine.weights_check("snapshot", skip_tensor_list=["norm"])
    engine.weights_check("reset_tensors", skip_tensor_list=["mlp", "attn", "embed", "lm_head"])
    assert engine.weights_check("compare", skip_tensor_list=["norm"]).success


def test_checksum_action_returns_an_sglang_shaped_report(engine: TorchEngine) -> None:
    report = engine.checksums(skip_tensor_list=["norm"])
    assert msgspec.json.decode(msgspec.json.encode(report), type=EngineChecksumReport) == report
    [rank] = report.ranks
    served = {n: t for n, t in engine.served_tensors().items() if "norm" not in n}
    assert report.success and rank.checksums == fingerprints(served)
    assert rank.per_gpu_checksum == per_gpu_checksum(rank.checksums)
    assert report.per_engine_checksum == hashlib.sha256(rank.per_gpu_checksum.encode()).hexdigest()
    assert rank.parallelism_info == ParallelismInfo(rank=0, size=1, tp_rank=0, tp_size=1)
    assert engine.weight_version == "default"


def test_an_unknown_action_is_an_unsuccessful_result(engine: TorchEngine) -> None:
    result = engine.weights_check("checksum")  # type: ignore[arg-type]
    assert not result.success and "unknown action 'checksum'" in result.message


def test_draft_selector_selects_nothing(engine: TorchEngine) -> None:
    engine.weights_check("snapshot")
    assert engine.checksums(selector="draft").ranks[0].checksums == {}
    for action in ("snapshot", "reset_tensors", "compare"):
        assert engine.weights_check(action, selector="draft").success, action
    # The draft actions touched neither the served weights nor the target snapshot.
    assert engine.weights_check("compare", selector="target").success


def test_a_cancelled_generation_ends_at_its_next_decode_step(engine: TorchEngine) -> None:
    cancel = Cancellation()
    engine.generate(["1+2="], SamplingParams(max_new_tokens=2), seeded(0), cancel)  # not cancelled: runs
    cancel.cancel("stop now")
    with pytest.raises(Cancelled, match="stop now"):
        engine.generate(["1+2="] * 3, SamplingParams(max_new_tokens=2), seeded(0), cancel)


def test_the_canary_is_served_from_the_buffer_the_load_wrote(engine: TorchEngine) -> None:
    assert engine.served_canary() == ""  # nothing loaded yet
    state = engine.served_tensors()
    engine.load_tensors({**state, CANARY_TENSOR: publication_canary("run", "1")}, "1")
    assert engine.served_canary() == tensor_fingerprint(publication_canary("run", "1"))
    engine._canary.zero_()  # what the engine holds is what it reports, not what it was sent
    assert engine.served_canary() == tensor_fingerprint(torch.zeros(16, dtype=torch.uint8))


def test_per_sample_seeds_draw_the_same_whatever_the_batch_or_chunk(model_dir: Path) -> None:
    """With a seed per request, a sample comes out the same decoded alone, in another
    order, or in chunks of another size, with either decode loop."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    seeds = [101, 202, 303, 404, 505, 606]
    whole = TorchEngine.from_pretrained(model_dir, max_batch_size=8, decode="eager")
    reference = [c.response_ids for c in whole.generate(PROMPTS, sampling, seeds=seeds)]
    for decode, size in (("eager", 2), ("static", 4), ("static", 1)):
        engine = TorchEngine.from_pretrained(model_dir, max_batch_size=size, decode=decode)
        assert [c.response_ids for c in engine.generate(PROMPTS, sampling, seeds=seeds)] == reference
    reversed_ = whole.generate(PROMPTS[::-1], sampling, seeds=seeds[::-1])
    assert [c.response_ids for c in reversed_][::-1] == reference
    other = whole.generate(PROMPTS, sampling, seeds=[s + 1 for s in seeds])
    assert [c.response_ids for c in other] != reference


def test_sample_uniforms_are_a_pure_function_of_the_seed_and_spread_over_the_unit_interval() -> None:
    from actors.engine.sampling import sample_uniforms

    draws = sample_uniforms(list(range(1000)), 8)
    assert draws.shape == (1000, 8) and draws.dtype == torch.float32
    assert torch.equal(draws[3:4], sample_uniforms([3], 8))
    assert 0.0 <= draws.min() and draws.max() < 1.0
    assert abs(draws.mean().item() - 0.5) < 0.01 and abs(draws.std().item() - (1 / 12) ** 0.5) < 0.01
