"""The fused fingerprint kernel on a GPU against a copy and a read of the same bytes.

    python bench/gpu/fingerprint.py [--gib 1] [--quick]

Publication verification fingerprints every published byte on the trainer and on each
engine; on a GPU that pass should run at the device's read bandwidth. For a tensor of
``--gib`` GiB of random int64 words it times (``triton.testing.do_bench``, medians):
``clone()`` (read + write: the copy rate), ``sum()`` (a read by torch's own reduction),
the previous kernel (one block per program, an atomic per block) and the current one over a
sweep of its tile, programs per multiprocessor, warps and pipeline stages. Each kernel is
timed as ``sum()`` is, queued without a host wait in the timed call (``launch_mix_sum``),
and beside it as ``mix_sum``, which also waits for its answer. Every variant is first checked
bit for bit against the CPU reference (``fingerprint._mix_sum_numpy``) on sizes around its
tile and on the whole tensor. Prints a table of GB/s read and the ratios to the copy and
read rates, and a ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from miles_events.device import fingerprint
from miles_events.device.checksum_triton import (
    BLOCK,
    NUM_WARPS,
    PROGRAMS_PER_SM,
    STAGES,
    launch_mix_sum,
    mix_sum,
)

K = (fingerprint.K1, fingerprint.K2, fingerprint.K3)


@triton.jit
def _previous_kernel(words_ptr, out_ptr, n, k1, k2, k3, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offsets < n
    words = tl.load(words_ptr + offsets, mask=mask, other=0)
    mixed = words * k1 + offsets * k2
    mixed = mixed ^ (mixed >> 31)
    mixed = mixed * k3
    mixed = mixed ^ (mixed >> 29)
    mixed = tl.where(mask, mixed, 0)
    tl.atomic_add(out_ptr, tl.sum(mixed, axis=0))


def previous(words: torch.Tensor) -> int:
    out = torch.zeros(1, dtype=torch.int64, device=words.device)
    _previous_kernel[(triton.cdiv(words.numel(), 4096),)](words, out, words.numel(), *K, BLOCK=4096)
    return int(out.item())


def reference(words: torch.Tensor) -> int:
    return fingerprint._mix_sum_numpy(words.cpu().numpy())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="the default settings only, no sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    n = int(args.gib * 2**30) // 8
    words = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, device="cuda")
    num_bytes = words.numel() * 8
    expected = reference(words)
    print(f"{torch.cuda.get_device_name()}: {num_bytes / 2**30:.2f} GiB of random int64 words")

    def gbps(ms: float, moved: int = num_bytes) -> float:
        return moved / (ms * 1e-3) / 1e9

    copy_ms = do_bench(lambda: words.clone(), warmup=500, rep=500, return_mode="median")
    read_ms = do_bench(lambda: words.sum(), warmup=500, rep=500, return_mode="median")
    copy, read = gbps(copy_ms, 2 * num_bytes), gbps(read_ms)
    print(
        f"copy (clone, read + write): {copy_ms:.3f} ms, {copy:.0f} GB/s; read (sum): {read_ms:.3f} ms, {read:.0f} GB/s"
    )

    # The kernels are timed as ``sum()`` is: queued, with no host wait inside the timed call
    # (``mix_sum`` also waits for its answer, a host round trip of tens of us, timed beside).
    out = torch.zeros(1, dtype=torch.int64, device="cuda")

    def launch(**settings: int) -> None:
        out.zero_()
        launch_mix_sum(words, out, *K, **settings)

    variants: list[tuple[str, object, object]] = [("previous (block 4096, atomic per block)", previous, None)]
    default = (BLOCK, PROGRAMS_PER_SM, NUM_WARPS, STAGES)
    settings = [default]
    if not args.quick:
        sweep = itertools.chain(
            itertools.product((4096, 8192), (2, 4), (16,), (1, 2, 3, 4)),
            itertools.product((2048, 4096), (4,), (8,), (1, 3)),
        )
        settings += [s for s in sweep if s != default]
    for block, per_sm, warps, stages in settings:
        chosen = {"block": block, "programs_per_sm": per_sm, "num_warps": warps, "stages": stages}
        name = f"block {block}, {per_sm}/SM, {warps} warps, {stages} stages" + (
            " (default)" if chosen == dict(zip(chosen, default, strict=True)) else ""
        )
        variants.append((name, lambda w, c=chosen: mix_sum(w, *K, **c), lambda c=chosen: launch(**c)))

    small = [1, 7, 1023, 1024, 1025, 4095, 4096, 4097, 8193, 2048 * 132 * 4 + 5, 3_000_001]
    rows = []
    for name, fn, kernel in variants:
        for size in small:
            part = words[:size]
            assert fn(part) == reference(part), f"{name}: differs from the CPU reference at {size} words"  # type: ignore[operator]
        assert fn(words) == expected, f"{name}: differs from the CPU reference on the whole tensor"  # type: ignore[operator]
        whole_ms = do_bench(lambda f=fn: f(words), warmup=200, rep=300, return_mode="median")  # type: ignore[misc]
        kernel_ms = (
            whole_ms if kernel is None else do_bench(kernel, warmup=200, rep=300, return_mode="median")
        )  # type: ignore[arg-type]
        rows.append((name, kernel_ms, gbps(kernel_ms), gbps(whole_ms)))
    print(
        "\n| kernel | ms | GB/s read | / copy rate | / read rate | GB/s with the host's wait |\n|---|---|---|---|---|---|"
    )
    for name, ms, rate, waited in rows:
        print(f"| {name} | {ms:.3f} | {rate:.0f} | {rate / copy:.2f} | {rate / read:.2f} | {waited:.0f} |")
    best = max(rows[1:], key=lambda r: r[2])
    chosen_row = rows[1]
    # The default again, four times between reads and copies: how much the machine moves it.
    again = []
    for _ in range(4):
        again.append(gbps(do_bench(lambda: launch(), warmup=200, rep=300, return_mode="median")))
        do_bench(lambda: words.sum(), warmup=50, rep=100)
    print(f"\ndefault kernel, measured again 4 times: {', '.join(f'{r:.0f}' for r in again)} GB/s")
    print(
        f"RESULT bytes={num_bytes} copy_gbps={copy:.0f} read_gbps={read:.0f} previous_gbps={rows[0][2]:.0f} "
        f"default_gbps={chosen_row[2]:.0f} default_again_min_gbps={min(again):.0f} "
        f"default_with_wait_gbps={chosen_row[3]:.0f} best_gbps={best[2]:.0f} best='{best[0]}' bit_identical=yes"
    )


if __name__ == "__main__":
    np.seterr(over="ignore")
    main()
