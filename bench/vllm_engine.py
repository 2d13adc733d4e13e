"""The vLLM engine against the embedded engine, on the same tiny model and batch, in one run.

    .venv/bin/python bench/vllm_engine.py [--prompts 32] [--samples 16] [--new-tokens 16] [--rounds 3]

Needs ``.venv-vllm`` (``bash .ci/setup-vllm``). Builds the project's built-in model at a head
size vLLM's CPU attention serves (hidden 128, 4 heads of 32), starts one vLLM server for it
(its start time is printed, not counted), then in interleaved rounds:

- generation: the same prompts and sampling on both engines; response tokens per second
  of wall time (vLLM: one HTTP request per sequence, all in flight);
- publication: a perturbed copy of the weights loaded into each engine; seconds for the
  load against the bytes published (vLLM by reload from a directory the engine writes,
  and by a push over HTTP to the project's worker extension).

Medians over the rounds; the last line is ``RESULT`` with the ratios against the embedded
engine. The behavioural probe's difference on the published weights is printed too.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from actors.engine.base import SamplingParams
from actors.engine.torch_engine import TorchEngine
from actors.engine.vllm_engine import VllmEngine
from miles_events.rl.canary import CANARY_TENSOR, publication_canary
from miles_events.rl.hf_model import load_model, prepare_base_model
from miles_events.rl.probe import max_difference, probe_batch, probe_vocab_size, teacher_forced_logprobs
from miles_events.rl.prompts import load_prompts
from miles_events.transport.inprocess import InProcessTransport
from schemas.config import BuiltinModelConfig, Config, ModelConfig, RunConfig, VllmConfig

ROOT = Path(__file__).resolve().parent.parent
VLLM_RUN = (
    "model.builtin.num_attention_heads=4",
    "model.builtin.num_key_value_heads=2",
    'generator.engine="vllm"',
    'verifier.skip_tensor_list=["proj.weight"]',
)
"""The overrides that make the embedded default a vLLM run (head size 32; the linears vLLM
repacks left to the behavioural probe)."""


def tokens_per_second(
    engine: TorchEngine | VllmEngine, prompts: list[str], sampling: SamplingParams, seed: int
) -> float:
    started = time.perf_counter()
    completions = engine.generate(prompts, sampling, torch.Generator().manual_seed(seed))
    elapsed = time.perf_counter() - started
    return sum(len(c.response_ids) for c in completions) / elapsed


def publish(
    engine: TorchEngine | VllmEngine, transport: InProcessTransport, tensors: dict, version: str
) -> tuple[float, int]:
    payload = {**tensors, CANARY_TENSOR: publication_canary("bench", version)}
    ref = transport.stager.put_tensors(f"weights-{version}", payload, owner="trainer")
    try:
        started = time.perf_counter()
        num_bytes = engine.load_weights(ref, version)
        return time.perf_counter() - started, num_bytes
    finally:
        transport.stager.free(ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    model_config = ModelConfig(builtin=BuiltinModelConfig(hidden_size=128))
    model_dir = prepare_base_model(model_config, run_dir, seed=1)
    rows = load_prompts(ROOT / "examples" / "data" / "arith_train.jsonl", "input", "label")
    prompts = [rows[i % len(rows)].prompt for i in range(args.prompts) for _ in range(args.samples)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    transport = InProcessTransport("bench")

    config = Config(run=RunConfig(dir=str(run_dir), runtime="local"), model=ModelConfig(path=str(model_dir)))
    config = msgspec.structs.replace(config, vllm=VllmConfig(startup_timeout=300.0))
    started = time.perf_counter()
    vllm = VllmEngine.from_config(config, index=0, name="engine-0", transport=transport)
    print(f"vLLM server ready and warmed up in {time.perf_counter() - started:.1f} s")
    embedded = TorchEngine.from_pretrained(model_dir, name="embedded", transport=transport)

    base = {
        n: t.detach().clone() for n, t in load_model(model_dir).state_dict().items() if "inv_freq" not in n
    }
    generator = torch.Generator().manual_seed(3)
    results: dict[str, list[float]] = {
        k: [] for k in ("embedded_tps", "vllm_tps", "embedded_load", "disk_load", "push_load")
    }
    num_bytes = 0
    for round_index in range(args.rounds):
        results["embedded_tps"].append(tokens_per_second(embedded, prompts, sampling, round_index))
        results["vllm_tps"].append(tokens_per_second(vllm, prompts, sampling, round_index))
        tensors = {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in base.items()}
        seconds, num_bytes = publish(embedded, transport, tensors, f"{3 * round_index + 1}")
        results["embedded_load"].append(seconds)
        vllm.config = msgspec.structs.replace(vllm.config, publication="disk")
        results["disk_load"].append(publish(vllm, transport, tensors, f"{3 * round_index + 2}")[0])
        vllm.config = msgspec.structs.replace(vllm.config, publication="push")
        vllm.holds_canary = True
        results["push_load"].append(publish(vllm, transport, tensors, f"{3 * round_index + 3}")[0])

    prompt_ids, response_ids = probe_batch(probe_vocab_size(str(model_dir)), seed=1)
    trainer = load_model(model_dir)
    trainer.load_state_dict(tensors, strict=False)
    probe = max_difference(
        teacher_forced_logprobs(trainer, prompt_ids, response_ids),
        vllm.probe_logprobs(prompt_ids, response_ids),
    )
    vllm.close()

    median = {k: statistics.median(v) for k, v in results.items()}
    sequences = args.prompts * args.samples
    print(
        f"{sequences} sequences of at most {args.new_tokens} new tokens, {args.rounds} interleaved rounds, medians"
    )
    print(f"{'':24}{'embedded':>12}{'vLLM':>12}{'ratio':>8}")
    print(
        f"{'tokens/s':24}{median['embedded_tps']:12.0f}{median['vllm_tps']:12.0f}{median['vllm_tps'] / median['embedded_tps']:8.2f}"
    )
    megabytes = num_bytes / 1e6
    print(f"publication of {megabytes:.2f} MB (s):")
    print(f"{'  load, in process':24}{median['embedded_load']:12.4f}")
    for key, label in (("disk_load", "  reload from disk"), ("push_load", "  push over HTTP")):
        ratio = median[key] / median["embedded_load"]
        print(f"{label:24}{'':12}{median[key]:12.4f}{ratio:8.1f}  ({megabytes / median[key]:.1f} MB/s)")
    print(f"behavioural probe on the last publication: max |logprob difference| {probe:.2e}")
    print(
        f"RESULT vllm_vs_embedded_tokens_per_s={median['vllm_tps'] / median['embedded_tps']:.3f} "
        f"disk_load_s={median['disk_load']:.4f} push_load_s={median['push_load']:.4f} "
        f"embedded_load_s={median['embedded_load']:.4f} bytes={num_bytes} probe_max_diff={probe:.2e}"
    )


if __name__ == "__main__":
    main()
