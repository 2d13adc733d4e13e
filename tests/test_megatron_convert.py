"""Hugging Face <-> Megatron-core conversion for the Llama and Qwen2 families.

The round trip is bitwise; the names and shapes are Megatron's own (a ``GPTModel`` built by
megatron-core takes them strictly); the converted model's logits equal the Hugging Face
model's: float32 on the CPU to rounding, bfloat16 on a GPU within bf16's error.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from actors.trainer_backend.megatron_convert import (
    MegatronLayout,
    fuse_qkv,
    hf_names,
    split_qkv,
    to_hf,
    to_megatron,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def qwen2(**overrides: object) -> Qwen2Config:
    settings: dict[str, object] = dict(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=128,
        pad_token_id=0,
    )  # fmt: skip
    settings.update(overrides)
    return Qwen2Config(**settings)


def llama(**overrides: object) -> LlamaConfig:
    settings: dict[str, object] = dict(
        vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=False, rope_theta=5e5, max_position_embeddings=16384,
        rope_scaling=LLAMA3_SCALING,
    )  # fmt: skip
    settings.update(overrides)
    return LlamaConfig(**settings)


MODELS = {
    "qwen2-tied": (Qwen2ForCausalLM, qwen2),
    "qwen2-untied-mha": (Qwen2ForCausalLM, lambda: qwen2(tie_word_embeddings=False, num_key_value_heads=6)),
    "llama3-gqa": (LlamaForCausalLM, llama),
    "llama-head-dim": (
        LlamaForCausalLM,
        lambda: llama(head_dim=16, rope_scaling=None, num_key_value_heads=2),
    ),
}


def random_model(name: str, seed: int = 0) -> torch.nn.Module:
    cls, make = MODELS[name]
    torch.manual_seed(seed)
    model = cls(make()).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_round_trip_is_bitwise_and_names_every_tensor(name):
    model = random_model(name)
    layout = MegatronLayout.of(model.config)
    weights = model.state_dict()
    megatron = to_megatron(weights, layout)
    assert {n: tuple(t.shape) for n, t in megatron.items()} == layout.megatron_shapes()
    back = to_hf(megatron, layout)
    expected = [n for n in weights if not (layout.tied_embeddings and n == "lm_head.weight")]
    assert sorted(back) == sorted(expected) == hf_names(layout)
    for n in expected:
        assert torch.equal(back[n], weights[n]), n


def test_qkv_rows_go_by_query_group_queries_then_key_then_value():
    layout = MegatronLayout.of(qwen2())  # 6 heads, 2 groups, head dim 8
    head = layout.kv_channels
    q = torch.arange(6 * head).float().unsqueeze(1)
    k = 100 + torch.arange(2 * head).float().unsqueeze(1)
    v = 200 + torch.arange(2 * head).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, layout).squeeze(1)
    # Group 0: query heads 0-2, key head 0, value head 0; then group 1.
    group = 5 * head
    assert torch.equal(fused[: 3 * head], q[: 3 * head, 0])
    assert torch.equal(fused[3 * head : 4 * head], k[:head, 0])
    assert torch.equal(fused[4 * head : group], v[:head, 0])
    assert torch.equal(fused[group : group + 3 * head], q[3 * head :, 0])
    assert all(
        torch.equal(a, b) for a, b in zip(split_qkv(fused.unsqueeze(1), layout), (q, k, v), strict=True)
    )


def test_gate_rows_come_first_in_the_fused_mlp():
    model = random_model("qwen2-tied")
    layout = MegatronLayout.of(model.config)
    megatron = to_megatron(model.state_dict(), layout)
    fc1 = megatron["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1[: layout.ffn_hidden_size], model.state_dict()["model.layers.1.mlp.gate_proj.weight"]
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adams_state_converts_both_ways_bitwise(name):
    """AdamW's moments are elementwise: converted as the weights are; the step is a scalar."""
    from actors.trainer_backend.megatron_convert import optimizer_to_hf, optimizer_to_megatron

    model = random_model(name)
    layout = MegatronLayout.of(model.config)
    megatron = to_megatron(model.state_dict(), layout)
    generator = torch.Generator().manual_seed(3)
    state = {
        "state": {
            n: {
                "step": torch.tensor(7.0),
                "exp_avg": torch.randn(t.shape, generator=generator),
                "exp_avg_sq": torch.rand(t.shape, generator=generator),
            }
            for n, t in megatron.items()
        },
        "param_groups": [{"lr": 1e-3, "params": list(megatron)}],
    }
    hf = optimizer_to_hf(state, layout)
    assert sorted(hf["state"]) == hf_names(layout) == sorted(hf["param_groups"][0]["params"])
    q = hf["state"]["model.layers.0.self_attn.q_proj.weight"]
    assert (
        q["step"] == 7.0
        and q["exp_avg"].shape == model.state_dict()["model.layers.0.self_attn.q_proj.weight"].shape
    )
    back = optimizer_to_megatron(hf, layout)
    assert back["param_groups"] == state["param_groups"]
    for n, values in state["state"].items():
        for field, tensor in values.items():
            assert torch.equal(back["state"][n][field], tensor), (n, field)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Qwen2Config(hidden_act="gelu"), "hidden_act 'gelu': Megatron's SwiGLU needs 'silu'"),
        (Qwen2Config(use_sliding_window=True), "use_sliding_window"),
        (llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
        (llama(rope_scaling={**LLAMA3_SCALING, "high_freq_factor": 2.0}), "high_freq_factor 2.0"),
        (llama(attention_bias=True), "attention_bias"),
        (llama(mlp_bias=True), "mlp_bias"),
        ({"model_type": "gemma"}, "model type 'gemma' has no Megatron conversion; converted: llama, qwen2"),
    ],
)
def test_what_megatrons_gpt_model_cannot_express_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MegatronLayout.of(config)


def test_weights_that_do_not_fit_the_layout_are_named():
    model = random_model("llama3-gqa")
    layout = MegatronLayout.of(model.config)
    weights = dict(model.state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\], unexpected \['model.extra"
    ):
        to_megatron(weights, layout)


# --- against megatron-core's own model ---------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_parallel() -> Iterator[None]:
    """A process group of one (gloo) with Megatron's parallel state over it."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from actors.trainer_backend.megatron_model import destroy_parallel, initialize_parallel

    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=store,
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    initialize_parallel(1, 1, seed=1, timeout_seconds=60)
    yield
    destroy_parallel()
    dist.destroy_process_group()


def megatron_of(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from actors.trainer_backend.megatron_model import build_gpt, load_megatron_state

    layout = MegatronLayout.of(model.config)
    gpt = build_gpt(layout, dtype, device, "local").eval()
    load_megatron_state(
        gpt, {n: t.to(device, dtype) for n, t in to_megatron(model.state_dict(), layout).items()}
    )
    return gpt


def response_logits(gpt: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from actors.trainer_backend.megatron_model import ResponseLogits

    every = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return ResponseLogits(gpt)(ids, torch.ones_like(ids), every)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_megatrons_gpt_model_takes_the_converted_weights_and_gives_the_same_logits(megatron_parallel, name):
    model = random_model(name)
    gpt = megatron_of(model, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    got = response_logits(gpt, ids)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen2-untied-mha"])
def test_the_padding_tokens_lookups_pass_no_gradient_to_the_embedding_as_in_hugging_face(
    megatron_parallel, name
):
    from actors.trainer_backend.megatron_model import ResponseLogits

    model = random_model(name)
    gpt = megatron_of(model, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[3, 0, 5, 0, 7]])  # the padding token (0) as a real token
    every = torch.arange(5).unsqueeze(0)
    ResponseLogits(gpt)(ids, torch.ones_like(ids), every).sum().backward()
    model(ids).logits.sum().backward()
    megatron_grad = gpt.embedding.word_embeddings.weight.grad
    hf_grad = model.model.embed_tokens.weight.grad
    # Tied, the output layer's gradient still reaches the padding row.
    assert torch.allclose(megatron_grad, hf_grad, atol=1e-5)
    if not model.config.tie_word_embeddings:
        assert torch.count_nonzero(megatron_grad[0]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen2-tied", "llama3-gqa"])
def test_on_a_gpu_megatrons_bf16_logits_equal_hugging_faces_within_bf16_error(megatron_parallel, name):
    device = torch.device("cuda", 0)
    model = random_model(name).to(device, torch.bfloat16)
    gpt = megatron_of(model, torch.bfloat16, device)
    ids = torch.randint(0, 64, (4, 96), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        expected = model(ids).logits.float()
    got = response_logits(gpt, ids).float()
    relative = float((got - expected).norm() / expected.norm())
    assert relative < 1e-2, relative


def test_a_bfloat16_model_holds_every_tensor_in_bfloat16(megatron_parallel):
    """As the Hugging Face model does: norms included (so checkpoints keep the model's dtype)."""
    from actors.trainer_backend.megatron_model import build_gpt, megatron_state

    gpt = build_gpt(MegatronLayout.of(qwen2()), torch.bfloat16, torch.device("cpu"), "local")
    assert {t.dtype for t in megatron_state(gpt).values()} == {torch.bfloat16}
