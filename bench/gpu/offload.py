"""Offload and onload on one GPU, per level: device bytes released and seconds.

    python bench/gpu/offload.py [--batch 64 --prompt 128 --new 256] [--hidden 896 --layers 24
        --intermediate 4864 --heads 14 --kv-heads 2] [--reps 3]

The built-in model shaped like Qwen2-0.5B's layers (bf16, random weights; the built-in
tokenizer's vocabulary, so the layers hold nearly every parameter), as the run moves it:

- the embedded engine (``TorchEngine``, CUDA graphs), warmed by a batch of ``--batch``
  prompts of ``--prompt`` tokens decoding ``--new`` tokens, releases the memory of each of
  the seed's levels (``cuda_graph``; ``+ kv_cache``; ``+ weights``: what the engine's
  ``release_memory`` gets after a generation), then resumes the weights (``onload_weights``)
  and the KV cache and graphs (``onload_kv``) and generates again;
- the trainer (``TorchTrainerBackend``), after two optimizer steps (AdamW's moments exist),
  offloads its weights and optimizer state to pinned host memory and onloads them.

Released and resumed bytes are the device's free memory (``torch.cuda.mem_get_info``, after
``empty_cache``) after less before: what really came free. Checked each time: the engine's
next generation (same seed) equals the one before the offload token for token, and the
trainer's weights and optimizer state equal what they were, bit for bit. The baseline is a
plain device-to-host copy of the same bytes (the copy rate bounds an offload). Medians of
``--reps``; a table, then a ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from qwen_shape import add_shape_arguments, prepare_model  # noqa: E402

from actors.engine.base import SamplingParams  # noqa: E402
from actors.engine.torch_engine import TorchEngine  # noqa: E402
from miles_events.device.offload import free_device_bytes  # noqa: E402

LEVELS = {
    "cuda_graph": ["cuda_graph"],
    "kv_cache": ["cuda_graph", "kv_cache"],
    "kv_cache+weight": ["cuda_graph", "kv_cache", "weights"],
}
"""The seed's levels: CUDA graphs always, then what ``offload_rollout_level`` adds."""


def gib(num_bytes: float) -> float:
    return num_bytes / 2**30


def timed(fn) -> tuple[float, int, object]:  # type: ignore[no-untyped-def]
    """(seconds, device bytes freed (negative: taken), result) of ``fn()``."""
    device = torch.device("cuda")
    before = free_device_bytes(device)
    started = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return seconds, free_device_bytes(device) - before, result


def engine_levels(path: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engine = TorchEngine.from_pretrained(path, dtype="bfloat16", device="cuda", decode="cuda_graph")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new, ignore_eos=True)
    prompts = [[3 + (i * 7 + j) % 12 for j in range(args.prompt)] for i in range(args.batch)]

    def generate() -> list[list[int]]:
        generator = torch.Generator().manual_seed(7)
        return [c.response_ids for c in engine.generate(prompts, sampling, generator)]

    reference = generate()
    results: dict[str, dict[str, list[float]]] = {}
    for level, tags in LEVELS.items():
        row = results.setdefault(
            level, {k: [] for k in ("released", "offload_s", "weights_back", "weights_s", "kv_back", "kv_s")}
        )
        for _ in range(args.reps):
            assert generate() == reference, "generation changed before the offload"
            seconds, freed, _ = timed(lambda tags=tags: engine.release_memory(tags))
            row["released"].append(freed)
            row["offload_s"].append(seconds)
            seconds, freed, _ = timed(lambda: engine.resume_memory(["weights"]))
            row["weights_back"].append(-freed)
            row["weights_s"].append(seconds)
            seconds, freed, _ = timed(lambda: engine.resume_memory(["kv_cache", "cuda_graph"]))
            row["kv_back"].append(-freed)
            row["kv_s"].append(seconds)
            # The KV cache and the graphs come back with the next decode; it must equal.
            assert generate() == reference, f"generation after {level} differs from before"
    engine.close()
    return {level: {k: statistics.median(v) for k, v in row.items()} for level, row in results.items()}


def trainer_offload(path: Path, args: argparse.Namespace) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "bench"))
    from trainer_ranks import rollout

    from actors.trainer_backend.torch_backend import TorchTrainerBackend
    from schemas.config import Config, DataConfig, ModelConfig, RunConfig, TrainerConfig

    config = Config(
        run=RunConfig(dir="/tmp/offload-bench", runtime="local"),
        model=ModelConfig(path=str(path), dtype="bfloat16"),
        data=DataConfig(rollout_batch_size=8, n_samples_per_prompt=4),
        trainer=TrainerConfig(lr=1e-6, global_batch_size=32, micro_batch_size=8, shared_prompts=False),
    )
    backend = TorchTrainerBackend(config)
    settings = {"samples": 32, "prompt_tokens": 64, "response_tokens": 128, "vocab": 15}
    for rollout_id in range(2):
        backend.train(rollout(rollout_id, settings))

    def state() -> list[torch.Tensor]:
        weights = [t.detach().cpu().clone() for t in backend.named_weights().values()]
        moments = [
            v.detach().cpu().clone()
            for s in backend.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        return weights + moments

    reference = state()
    held = sum(t.numel() * t.element_size() for t in reference)
    rows: dict[str, list[float]] = {k: [] for k in ("released", "offload_s", "taken", "onload_s", "copy_s")}
    for _ in range(args.reps):
        seconds, freed, _ = timed(backend.offload)
        rows["released"].append(freed)
        rows["offload_s"].append(seconds)
        seconds, freed, _ = timed(backend.onload)
        rows["taken"].append(-freed)
        rows["onload_s"].append(seconds)
        after = state()
        assert all(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            for a, b in zip(reference, after, strict=True)
        ), "the trainer's state changed across an offload"
        # The baseline: one device-to-host copy of the same bytes into pinned memory.
        source = torch.empty(held, dtype=torch.uint8, device="cuda")
        target = torch.empty(held, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        rows["copy_s"].append(time.perf_counter() - started)
        del source, target
    backend.train(rollout(2, settings))  # and it trains on
    result = {k: statistics.median(v) for k, v in rows.items()}
    result["state_bytes"] = held
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    add_shape_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    path = prepare_model(args)
    print(f"device: {torch.cuda.get_device_name()}; total {gib(torch.cuda.mem_get_info()[1]):.1f} GiB")
    engine = engine_levels(path, args)
    print(
        "engine level       released GiB  offload s  weights back GiB  onload_weights s  kv back GiB  onload_kv s"
    )
    for level, row in engine.items():
        print(
            f"{level:<18} {gib(row['released']):>12.3f} {row['offload_s']:>10.4f} {gib(row['weights_back']):>17.3f}"
            f" {row['weights_s']:>17.4f} {gib(row['kv_back']):>12.3f} {row['kv_s']:>12.4f}"
        )
    trainer = trainer_offload(path, args)
    print(
        f"trainer: state {gib(trainer['state_bytes']):.3f} GiB; released {gib(trainer['released']):.3f} GiB in "
        f"{trainer['offload_s']:.4f} s, taken back {gib(trainer['taken']):.3f} GiB in {trainer['onload_s']:.4f} s; "
        f"a pinned copy of the same bytes {trainer['copy_s']:.4f} s (offload {trainer['offload_s'] / trainer['copy_s']:.2f}x the copy)"
    )
    full = engine["kv_cache+weight"]
    print(
        "RESULT "
        + " ".join(
            [
                *(
                    f"engine_{lvl.replace('+', '_')}_released_gib={gib(r['released']):.3f}"
                    for lvl, r in engine.items()
                ),
                *(
                    f"engine_{lvl.replace('+', '_')}_offload_s={r['offload_s']:.4f}"
                    for lvl, r in engine.items()
                ),
                f"engine_onload_weights_s={full['weights_s']:.4f}",
                f"engine_onload_kv_s={full['kv_s']:.4f}",
                f"trainer_released_gib={gib(trainer['released']):.3f}",
                f"trainer_offload_s={trainer['offload_s']:.4f}",
                f"trainer_onload_s={trainer['onload_s']:.4f}",
                f"trainer_offload_vs_copy={trainer['offload_s'] / trainer['copy_s']:.2f}",
            ]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
