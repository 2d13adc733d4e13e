"""Bytes per publication event, with the per-tensor checksum map in the event and without.

    .venv/bin/python bench/event_size.py [--engines 8]

Two models: a 24-layer Qwen2-0.5B-shaped one (hidden 896, intermediate 4864, 14 heads,
2 KV heads, vocab 151936, tied embeddings), whose tensor names and shapes come from the
Hugging Face Qwen2 config built on the meta device (no weights), and a synthetic MoE of
~18k tensors named like Qwen3-MoE (46 layers of 128 experts). For each, one
``WeightsStaged`` and one ``WeightsLoaded`` are encoded as they travel on the bus and into
the event log (``miles_events.bus.codec.encode_event``):

- before: the events as first recorded (``tests/fixtures/tiny_run_v1``), with the map of
  tensor name -> 16-hex-digit fingerprint inside;
- after: today's events, with the digest, the counts and the path of the checksum
  manifest, which is written once per publication under ``<run_dir>/checksums/`` and
  measured beside them.

Goal: every event after the change under 1 KiB, whatever the tensor count. The last line is
``RESULT ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from miles_events.bus.codec import encode_event
from miles_events.rl.checksum import per_gpu_checksum
from miles_events.rl.checksum_manifest import write_manifest
from schemas.data import DataRef
from schemas.events import Event, WeightsLoaded, WeightsStaged

GOAL_BYTES = 1024
HEADER = {"run_id": "20261201-092716-4c9c84", "seq": 1_234_567, "time": time.time()}


class StagedBefore(Event, frozen=True, kw_only=True, tag="WeightsStaged"):
    """``WeightsStaged`` as the first recorded log holds it."""

    weight_version: str
    weights: DataRef
    checksums: dict[str, str]
    digest: str
    num_tensors: int
    num_bytes: int
    rollout_id: int | None = None
    stage_seconds: float = 0.0


class LoadedBefore(Event, frozen=True, kw_only=True, tag="WeightsLoaded"):
    """``WeightsLoaded`` as the first recorded log holds it."""

    engine: str
    weight_version: str
    previous_version: str
    checksums: dict[str, str]
    digest: str
    load_seconds: float = 0.0


def qwen2_half_b() -> tuple[dict[str, str], int]:
    """(name -> fingerprint, bytes in bf16) of a Qwen2-0.5B-shaped model, from its HF config."""
    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters() lists a tied parameter once: the names a publication carries.
    params = dict(model.named_parameters())
    return {name: fingerprint(name) for name in params}, sum(p.numel() * 2 for p in params.values())


def synthetic_moe(layers: int = 46, experts: int = 128) -> tuple[dict[str, str], int]:
    """(name -> fingerprint, bytes) of a Qwen3-MoE-named model of ~18k tensors."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        names += [
            f"{prefix}.self_attn.{p}.weight"
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ]
        names += [f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"]
        names.append(f"{prefix}.mlp.gate.weight")
        names += [
            f"{prefix}.mlp.experts.{e}.{p}.weight"
            for e in range(experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
    return {name: fingerprint(name) for name in names}, 470_000_000_000


def fingerprint(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=8).hexdigest()


def sizes(checksums: dict[str, str], num_bytes: int, run_dir: str) -> dict[str, int]:
    weights = DataRef("shm", "weights-v123", "trainer", num_bytes)
    digest = per_gpu_checksum(checksums)
    staged_before = StagedBefore(
        weight_version="123", weights=weights, checksums=checksums, digest=digest, num_tensors=len(checksums),
        num_bytes=num_bytes, rollout_id=122, stage_seconds=0.5, source="trainer", **HEADER,
    )  # fmt: skip
    loaded_before = LoadedBefore(
        engine="engine-7", weight_version="123", previous_version="122", checksums=checksums, digest=digest,
        load_seconds=0.75, source="generator", **HEADER,
    )  # fmt: skip
    digest, manifest = write_manifest(run_dir, checksums)
    staged_after = WeightsStaged(
        weight_version="123", weights=weights, digest=digest, num_tensors=len(checksums), num_bytes=num_bytes,
        checksums_manifest=manifest, rollout_id=122, stage_seconds=0.5, source="trainer", **HEADER,
    )  # fmt: skip
    loaded_after = WeightsLoaded(
        engine="engine-7", weight_version="123", previous_version="122", digest=digest, num_tensors=len(checksums),
        num_bytes=num_bytes, checksums_manifest=manifest, load_seconds=0.75, source="generator", **HEADER,
    )  # fmt: skip
    # Both shapes decode with today's schemas (the old map is skipped).
    assert msgspec.msgpack.decode(encode_event(loaded_before), type=WeightsLoaded).digest == digest
    return {
        "WeightsStaged before": len(encode_event(staged_before)),
        "WeightsStaged after": len(encode_event(staged_after)),
        "WeightsLoaded before": len(encode_event(loaded_before)),
        "WeightsLoaded after": len(encode_event(loaded_after)),
        "manifest": (Path(run_dir) / manifest).stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--engines", type=int, default=8, help="engines per publication, for the per-publication total"
    )
    args = parser.parse_args()
    models = {"qwen2-0.5b": qwen2_half_b(), "moe-18k": synthetic_moe()}
    results: dict[str, tuple[int, dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, (checksums, num_bytes) in models.items():
            results[name] = (len(checksums), sizes(checksums, num_bytes, run_dir))

    print("bytes per encoded event (msgpack, as on the bus and in the event log)")
    print(f"{'model':12}{'tensors':>9}  {'event':15}{'before':>12}{'after':>8}{'before/after':>14}")
    for name, (count, size) in results.items():
        for event in ("WeightsStaged", "WeightsLoaded"):
            before, after = size[f"{event} before"], size[f"{event} after"]
            print(f"{name:12}{count:>9,}  {event:15}{before:>12,}{after:>8,}{before / after:>13,.0f}x")
    print(f"\nper publication to {args.engines} engines (1 WeightsStaged + {args.engines} WeightsLoaded):")
    for name, (_count, size) in results.items():
        before = size["WeightsStaged before"] + args.engines * size["WeightsLoaded before"]
        after = size["WeightsStaged after"] + args.engines * size["WeightsLoaded after"]
        print(
            f"  {name:12} events {before:>12,} B before, {after:>6,} B after; "
            f"+ one checksum manifest of {size['manifest']:,} B written once under <run_dir>/checksums/"
        )
    largest = max(
        size[f"{e} after"] for _, size in results.values() for e in ("WeightsStaged", "WeightsLoaded")
    )
    met = largest < GOAL_BYTES
    print(
        f"\nlargest event after: {largest} B; goal < {GOAL_BYTES} B whatever the tensor count: {'met' if met else 'NOT met'}"
    )
    qwen, moe = results["qwen2-0.5b"][1], results["moe-18k"][1]
    print(
        f"RESULT event_size_max_after_bytes={largest} goal_met={str(met).lower()} "
        f"qwen2_tensors={results['qwen2-0.5b'][0]} qwen2_loaded_before={qwen['WeightsLoaded before']} "
        f"qwen2_loaded_after={qwen['WeightsLoaded after']} moe_tensors={results['moe-18k'][0]} "
        f"moe_loaded_before={moe['WeightsLoaded before']} moe_loaded_after={moe['WeightsLoaded after']} "
        f"moe_staged_before={moe['WeightsStaged before']} moe_staged_after={moe['WeightsStaged after']} "
        f"moe_manifest_bytes={moe['manifest']}"
    )


if __name__ == "__main__":
    main()
