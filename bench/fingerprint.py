"""Publication fingerprint throughput against a memory copy of the same bytes, same run.

    .venv/bin/python bench/fingerprint.py [--device cpu|cuda] [--mib 256] [--repeats 5]

The verification of every publication costs one fingerprint pass over the published
tensors on the trainer and on each engine; this measures that pass in GB/s of tensor data
against ``clone()`` (read + write of the same bytes) on the same device. On CUDA it also
checks that the device fingerprint equals the CPU one for a set of tensors (the trainer
and an engine may sit on different devices).
"""

from __future__ import annotations

import argparse
import time

import torch

from miles_events.device.fingerprint import tensor_fingerprint


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_seconds(fn, device: str, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = args.device
    agree = "n/a"
    if device.startswith("cuda"):
        samples = [torch.randn(4097, 333), torch.randn(1 << 20).to(torch.bfloat16), torch.arange(70_001)]
        agree = str(all(tensor_fingerprint(t) == tensor_fingerprint(t.to(device)) for t in samples))
    tensor = torch.randn(args.mib * (1 << 20) // 4, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    fingerprint = best_seconds(lambda: tensor_fingerprint(tensor), device, args.repeats)
    copy = best_seconds(lambda: tensor.clone(), device, args.repeats)
    print(f"device {device}, {args.mib} MiB fp32 tensor, best of {args.repeats}")
    print(f"{'':22}{'GB/s':>10}")
    print(f"{'fingerprint':22}{nbytes / fingerprint / 1e9:10.2f}")
    print(f"{'clone (copy)':22}{nbytes / copy / 1e9:10.2f}")
    ratio = copy / fingerprint
    print(f"fingerprint / copy throughput: {ratio:.2f}; device and CPU fingerprints agree: {agree}")
    print(
        f"RESULT fingerprint_vs_copy_ratio={ratio:.3f} fingerprint_gbps={nbytes / fingerprint / 1e9:.2f} "
        f"copy_gbps={nbytes / copy / 1e9:.2f} device={device} cpu_agrees={agree}"
    )


if __name__ == "__main__":
    main()
