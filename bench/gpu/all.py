"""The GPU benchmark set in one command: publication, fingerprint, engine decoding, saves,
the trainer's FSDP2 path.

    python bench/gpu/all.py

Runs ``publication.py``, ``fingerprint.py --quick``, ``engine.py``, ``pinning.py``,
``save_overlap.py`` and ``../trainer_ranks.py --device cuda`` (the 1.5B shape) one after the
other (each in its own process, so none inherits another's allocations), streams their
tables, and ends with their ``RESULT`` lines together. Each bench reports its ratios against a
baseline it measures in the same run: a copy of the same bytes, HF ``generate``, the loop
without a save (or a pinning) beside it, the single-process trainer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = (
    ["publication.py"],
    ["fingerprint.py", "--quick"],
    ["engine.py"],
    ["pinning.py"],
    [
        "save_overlap.py",
        "--iterations",
        "150",
        "--ways",
        "pin_new,pin_reused,host_copy,torch_save,checkpoint,checkpoint_process",
    ],
    # The CPU bench's CUDA mode: FSDP2 on one rank against the single process, one GPU.
    [
        "../trainer_ranks.py",
        "--device",
        "cuda",
        *("--hidden", "1536", "--layers", "28", "--intermediate", "8960", "--heads", "12", "--kv-heads", "2"),
        *("--samples", "128", "--micro-batch", "32", "--prompt-tokens", "64", "--response-tokens", "256"),
    ],
)


def main() -> int:
    results: list[str] = []
    failed = 0
    for bench in BENCHES:
        print(f"== {' '.join(bench)}", flush=True)
        proc = subprocess.Popen(
            [sys.executable, str(HERE / bench[0]), *bench[1:]], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith("RESULT"):
                results.append(f"{bench[0]}: {line.strip()}")
        if proc.wait() != 0:
            failed += 1
            results.append(f"{bench[0]}: FAILED with exit code {proc.returncode}")
    print("== results")
    print("\n".join(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
