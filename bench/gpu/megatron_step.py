"""The Megatron backend against the torch backend on one GPU: logits, step time, publication.

    python3 bench/gpu/megatron_step.py [--rounds 5] [--samples 8 --prompt-tokens 64
        --response-tokens 448 --micro-batch 8] [--layers 24]

A Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads / 2 KV groups, SwiGLU 4864, QKV
bias, tied embeddings, vocabulary 151,936; random weights, std 0.02, bf16) is written as a
Hugging Face directory; both backends load it, in this process, on the GPU: the torch
backend as the single-process trainer (``sharding = "none"``), the Megatron one as rank 0 of
a ``MegatronGroup`` of one (NCCL), Megatron's local layer spec.

1. Conversion: the Hugging Face state dict to Megatron's names and back (on the GPU, then
   on the host), bitwise equal after the round trip; time of each way.
2. Logits: both models' logits at every position of ``--samples`` random sequences of
   ``prompt + response`` tokens, relative L2 error of Megatron's against Hugging Face's
   (``||a - b|| / ||b||``) and the largest difference of the target tokens' log-probabilities.
3. Step time: one rollout of ``--samples`` samples (groups of 4 sharing a prompt), one
   optimizer step, micro-batches of ``--micro-batch``, shared prompts off (both backends
   run the same sequences); ``--rounds`` rounds after two warm-ups, interleaved (torch,
   Megatron, ...), each step synchronised; medians and their ratio. Then one step of each
   under ``torch.profiler``: its GPU kernels' time by kind (matrix products, attention,
   the optimizer, other) against the step's wall time.
4. Publication: ``named_weights(bfloat16)`` (Megatron's: converted to Hugging Face names)
   and a copy of every tensor into one flat staging buffer, as a publication stages them;
   medians over ``--rounds``.

Exit 0 with a message where there is no CUDA. The last lines are ``RESULT`` lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GROUP_SIZE = 4


def build_model(args: argparse.Namespace, directory: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(1)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


def rollout(rollout_id: int, args: argparse.Namespace) -> Any:
    from schemas.rollout import RolloutBatch, Sample

    generator = torch.Generator().manual_seed(1000 + rollout_id)
    samples, prompt = [], []
    for i in range(args.samples):
        if i % GROUP_SIZE == 0:
            prompt = torch.randint(10, 150000, (args.prompt_tokens,), generator=generator).tolist()
        response = torch.randint(10, 150000, (args.response_tokens,), generator=generator).tolist()
        samples.append(
            Sample(
                index=i // GROUP_SIZE,
                group=i // GROUP_SIZE,
                prompt="",
                label="",
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=[-1.0] * len(response),
                response="",
                reward=float((i * 7 + rollout_id) % 3),
                weight_version="bench",
                engine="bench",
                finish_reason="stop",
            )
        )
    return RolloutBatch(rollout_id=rollout_id, samples=samples)


def make_config(model: Path, args: argparse.Namespace, backend: str) -> Any:
    from schemas.config import Config, MegatronConfig, ModelConfig, RunConfig, TrainerConfig

    return Config(
        run=RunConfig(dir="unused", seed=1, runtime="local"),
        model=ModelConfig(path=str(model), dtype="bfloat16"),
        trainer=TrainerConfig(
            backend=backend,
            lr=1e-5,
            micro_batch_size=args.micro_batch,
            shared_prompts=False,
        ),
        megatron=MegatronConfig(transformer_impl="local"),
    )


def timed(function: Any) -> tuple[float, Any]:
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result


KINDS = (
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "splitk")),
    ("attention", ("flash", "fmha", "attention", "softmax", "sdpa", "efficient")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
)


def kernel_split(profiler: Any, wall: float) -> dict[str, float]:
    """GPU kernel time by kind, in seconds, and the wall time."""
    split: dict[str, float] = defaultdict(float)
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        split[kind] += event.device_time / 1e6
    split["kernels"] = sum(split[k] for k in ("matmul", "attention", "optimizer", "other"))
    split["wall"] = wall
    return dict(split)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from actors.trainer_backend.grpo import token_logprobs
    from actors.trainer_backend.megatron_backend import MegatronGroup, MegatronTrainerBackend
    from actors.trainer_backend.megatron_convert import MegatronLayout, to_hf, to_megatron
    from actors.trainer_backend.torch_backend import TorchTrainerBackend, pack_samples

    results: dict[str, str] = {}
    torch.cuda.set_device(0)
    model_dir = build_model(args, Path(tempfile.mkdtemp()))

    # 1. Conversion, both ways, on the GPU and on the host.
    from safetensors.torch import load_file
    from transformers import AutoConfig

    layout = MegatronLayout.of(AutoConfig.from_pretrained(model_dir))
    host = load_file(str(model_dir / "model.safetensors"))
    for where, weights in (("gpu", {n: t.cuda() for n, t in host.items()}), ("host", host)):
        to_mc, converted = timed(lambda weights=weights: to_megatron(weights, layout))
        to_back, back = timed(lambda converted=converted: to_hf(converted, layout))
        exact = all(torch.equal(back[n], weights[n]) for n in back) and set(back) == set(weights) - {
            "lm_head.weight"
        }
        size = sum(t.numel() * t.element_size() for t in weights.values())
        print(
            f"conversion on the {where}: HF->Megatron {to_mc * 1e3:.1f} ms, Megatron->HF {to_back * 1e3:.1f} ms "
            f"({size / 1e6:.0f} MB), round trip bitwise: {exact}"
        )
        results[f"convert_to_megatron_ms_{where}"] = f"{to_mc * 1e3:.1f}"
        results[f"convert_to_hf_ms_{where}"] = f"{to_back * 1e3:.1f}"
        results[f"round_trip_bitwise_{where}"] = str(exact)
    del host

    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    device = torch.device("cuda", 0)
    torch_backend = TorchTrainerBackend(make_config(model_dir, args, "torch"))
    megatron_config = make_config(model_dir, args, "megatron")
    group = MegatronGroup(megatron_config, 0, ("127.0.0.1", store.port), device)
    megatron_backend = MegatronTrainerBackend(megatron_config, group)
    parameters = sum(p.numel() for p in megatron_backend.model.parameters())
    print(f"model: {parameters / 1e6:.0f}M parameters (Megatron), {layout}")

    # 2. Logits at every position.
    batch = rollout(0, args)
    micro = pack_samples(batch.samples, list(range(len(batch.samples))))
    every = torch.arange(micro.input_ids.shape[1]).unsqueeze(0).expand_as(micro.input_ids)
    with torch.no_grad():
        hf_logits = torch_backend.root(
            micro.input_ids.to(device), micro.attention_mask.to(device), every.to(device)
        )
        mc_logits = megatron_backend.root(
            micro.input_ids.to(device), micro.attention_mask.to(device), every.to(device)
        )
        relative = float((mc_logits.float() - hf_logits.float()).norm() / hf_logits.float().norm())
        targets = torch.cat([micro.input_ids[:, 1:], micro.input_ids[:, -1:]], dim=1).to(device)
        logp_gap = float(
            (token_logprobs(mc_logits.float(), targets) - token_logprobs(hf_logits.float(), targets))
            .abs()
            .max()
        )
    del hf_logits, mc_logits
    print(f"logits: relative L2 error {relative:.2e}, largest log-probability difference {logp_gap:.3f}")
    results["logits_relative_error"] = f"{relative:.2e}"
    results["logprob_max_diff"] = f"{logp_gap:.3f}"

    # 3. Step time, interleaved.
    arms = {"torch": torch_backend, "megatron": megatron_backend}
    steps: dict[str, list[float]] = {name: [] for name in arms}
    for round_number in range(args.rounds + 2):
        for name, backend in arms.items():
            batch = rollout(1 + round_number, args)
            seconds, metrics = timed(lambda backend=backend, batch=batch: backend.train(batch))
            if round_number >= 2:
                steps[name].append(seconds)
            print(
                f"round {round_number} {name}: {seconds * 1e3:.0f} ms (loss {metrics.loss:+.4f}, grad {metrics.grad_norm:.3f})"
            )
    medians = {name: statistics.median(values) for name, values in steps.items()}
    for name, value in medians.items():
        results[f"step_ms_{name}"] = f"{value * 1e3:.0f}"
    results["step_ratio_megatron_over_torch"] = f"{medians['megatron'] / medians['torch']:.3f}"
    for name, backend in arms.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            wall, _ = timed(lambda backend=backend: backend.train(rollout(99, args)))
        split = kernel_split(profiler, wall)
        print(
            f"{name} step under the profiler: wall {wall * 1e3:.0f} ms, kernels {split['kernels'] * 1e3:.0f} ms: "
            + ", ".join(
                f"{k} {split.get(k, 0.0) * 1e3:.0f}" for k in ("matmul", "attention", "optimizer", "other")
            )
        )
        for kind in ("matmul", "attention", "optimizer", "other", "kernels"):
            results[f"split_ms_{name}_{kind}"] = f"{split.get(kind, 0.0) * 1e3:.0f}"

    # 4. Publication: the weights in Hugging Face names, copied into one staging buffer.
    for name, backend in arms.items():
        weights = backend.named_weights(torch.bfloat16)
        size = sum(t.numel() for t in weights.values())
        staging = torch.empty(size, dtype=torch.bfloat16, device=device)

        def publish(backend: Any = backend, staging: torch.Tensor = staging) -> int:
            offset = 0
            for tensor in backend.named_weights(torch.bfloat16).values():
                staging[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
                offset += tensor.numel()
            return offset

        times = [timed(publish)[0] for _ in range(args.rounds + 1)][1:]
        results[f"publish_ms_{name}"] = f"{statistics.median(times) * 1e3:.2f}"
        print(
            f"publication staging, {name}: {statistics.median(times) * 1e3:.2f} ms for {size * 2 / 1e6:.0f} MB"
        )
    group.close()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
