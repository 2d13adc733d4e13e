"""The embedded engine's decoding against Hugging Face ``generate``, on one GPU.

    python bench/gpu/engine.py [--batch 64 --prompt 128 --new 256] [--hidden 896 --layers 24
        --intermediate 4864 --heads 14 --kv-heads 2] [--reps 3]

The model is the built-in one shaped like Qwen2-0.5B (bf16), random weights; ``--batch``
distinct prompts of ``--prompt`` tokens each, ``--new`` new tokens sampled at temperature 1
past EOS (``ignore_eos``: every row decodes the full length, so tokens/s compare like for
like). Timed, CUDA-synchronised, best of ``--reps`` after a warm-up call (which captures the
graphs):

- ``hf_generate``: ``model.generate(do_sample=True, min_new_tokens=max_new_tokens)``, the
  baseline;
- ``eager``: the engine's eager loop (a growing cache, a host look per token);
- ``cuda_graph``: the engine's static-cache decoder, each step a CUDA graph replay.

Prints tokens/s, ms per decode step and the ratios to HF generate and to ``eager``, then a
``RESULT`` line. Goal: ``cuda_graph`` >= 20k tokens/s at batch 64, 128 + 256 tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from qwen_shape import add_shape_arguments, prepare_model  # noqa: E402

from actors.engine.base import SamplingParams  # noqa: E402
from actors.engine.torch_engine import TorchEngine  # noqa: E402
from miles_events.rl.hf_model import ARITH_SYMBOLS  # noqa: E402


def best_of(fn: Callable[[], int], reps: int) -> tuple[float, int]:
    """Fastest seconds of ``fn`` over ``reps`` runs after one warm-up, and the tokens it made."""
    fn()
    best, tokens = float("inf"), 0
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    add_shape_arguments(parser)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model_dir = prepare_model(args, max_position_embeddings=max(2048, args.prompt + args.new))
    engines = {
        mode: TorchEngine.from_pretrained(
            model_dir, dtype="bfloat16", device="cuda", max_batch_size=args.batch, decode=mode
        )
        for mode in ("eager", "cuda_graph")
    }
    draw = random.Random(0)
    prompts = ["".join(draw.choice(ARITH_SYMBOLS) for _ in range(args.prompt)) for _ in range(args.batch)]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new, ignore_eos=True)
    print(
        f"{torch.cuda.get_device_name()}: batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, "
        f"{sum(p.numel() for p in engines['eager'].model.parameters()) / 1e6:.0f}M parameters, bf16"
    )

    def run_engine(engine: TorchEngine) -> Callable[[], int]:
        def run() -> int:
            completions = engine.generate(prompts, sampling, torch.Generator().manual_seed(0))
            return sum(len(c.response_ids) for c in completions)

        return run

    model = engines["eager"].model
    tokenizer = engines["eager"].tokenizer
    encoded = torch.tensor([tokenizer.encode(p) for p in prompts], device="cuda")

    def hf_generate() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=encoded,
                attention_mask=torch.ones_like(encoded),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                pad_token_id=tokenizer.pad_token_id,
            )
        return int(out[:, encoded.shape[1] :].numel())

    results = {"hf_generate": best_of(hf_generate, args.reps)}
    for mode, engine in engines.items():
        results[mode] = best_of(run_engine(engine), args.reps)
    rate = {name: tokens / seconds for name, (seconds, tokens) in results.items()}
    print(f"{'':<12}{'s':>8}{'tokens':>9}{'tokens/s':>11}{'ms/step':>9}{'vs HF':>8}{'vs eager':>10}")
    for name, (seconds, tokens) in results.items():
        print(
            f"{name:<12}{seconds:>8.3f}{tokens:>9}{rate[name]:>11.0f}{seconds / args.new * 1e3:>9.2f}"
            f"{rate[name] / rate['hf_generate']:>8.2f}{rate[name] / rate['eager']:>10.2f}"
        )
    print(
        f"RESULT batch={args.batch} prompt={args.prompt} new={args.new} hf_tps={rate['hf_generate']:.0f} "
        f"eager_tps={rate['eager']:.0f} cuda_graph_tps={rate['cuda_graph']:.0f} "
        f"vs_hf={rate['cuda_graph'] / rate['hf_generate']:.2f} vs_eager={rate['cuda_graph'] / rate['eager']:.2f} "
        f"goal_20k={'met' if rate['cuda_graph'] >= 20_000 else 'not met'}"
    )


if __name__ == "__main__":
    main()
