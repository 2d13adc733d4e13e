"""What freeing a staged train state costs the thread that frees it: a transport's ``free``
(the data renamed aside, its removal on the reaper's thread) against removing the same
file there and then, as ``free`` did before, in the same run.

    .venv/bin/python bench/free.py [--gb 1.6] [--transport shm|disk]

Each side stages an optimizer-like state of ``--gb`` gigabytes with ``put_state`` (the
trainer's staging of a save) and frees it; the caller's time is what an actor's event loop
would spend, every event behind it waiting.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from miles_events.transport.base import open_transport
from miles_events.transport.reaper import wait_removed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.6)
    parser.add_argument("--transport", default="shm", choices=["shm", "disk"])
    args = parser.parse_args()
    floats = int(args.gb * 1e9 / 4 / 2)
    state = {"state": {0: {"exp_avg": torch.randn(floats), "exp_avg_sq": torch.randn(floats)}}}
    with tempfile.TemporaryDirectory() as run_dir:
        plane = open_transport(args.transport, "bench-free", Path(run_dir))
        try:
            ref = plane.stager.put_state("before", state, owner="trainer")
            began = time.perf_counter()
            plane.state_file(ref).unlink()  # removed there and then
            removed_here = time.perf_counter() - began

            ref = plane.stager.put_state("now", state, owner="trainer")
            began = time.perf_counter()
            plane.stager.free(ref)
            freed = time.perf_counter() - began
            assert wait_removed(120)
            removed_later = time.perf_counter() - began
        finally:
            plane.close()
    print(f"{args.transport}, {ref.num_bytes / 1e9:.2f} GB staged:")
    print(f"  removed on the caller's thread (before): {removed_here * 1e3:8.1f} ms")
    print(
        f"  free (now), on the caller's thread:      {freed * 1e3:8.1f} ms  ({removed_here / freed:.0f}x less)"
    )
    print(f"  free (now), until the reaper removed it: {removed_later * 1e3:8.1f} ms")
    print(
        f"RESULT transport={args.transport} bytes={ref.num_bytes} removed_here_ms={removed_here * 1e3:.1f} "
        f"free_ms={freed * 1e3:.2f} removed_later_ms={removed_later * 1e3:.1f} ratio={removed_here / freed:.1f}"
    )


if __name__ == "__main__":
    main()
