"""Publication over the collective transport (gloo on this CPU) against a raw
``torch.distributed.broadcast`` of the same bytes, in the same run, between the same two
processes.

    .venv/bin/python bench/collective_publication.py [--config examples/tiny.toml] [--set KEY=VALUE ...]
        [--repeats 9] [--bucket-mb 512]

This process is the trainer's publishing rank: it stages the built-in model's weights (as
``--config`` and ``--set`` shape it, the publication canary with them) as the trainer does,
with ``publish_buckets``. A second process is an engine: it reads each publication with
``stream_buckets``, each chunk landing in buffers laid out as the staged ones (the embedded
engine's load). The baseline is the same bytes, in the same chunks, broadcast over a bare gloo
group of the same two processes into one preallocated buffer. Each repeat times one of each,
in alternating order, from the command to the engine's reply; the figure is the ratio of the
medians' rates (collective / raw).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINE = r"""
import sys, time
from datetime import timedelta
import msgspec, torch
import torch.distributed as dist
from miles_events.device.buckets import Buckets, byte_view
from miles_events.transport.collective import ChannelReader, CollectiveSettings
from schemas.data import DataRef

host, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
raw = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, timedelta(seconds=60))
channels = ChannelReader(CollectiveSettings(timeout=60.0))
target = landing = None
options = dist.BroadcastOptions()
for line in sys.stdin:
    kind, _, payload = line.strip().partition(" ")
    if kind == "collective":
        ref = msgspec.json.decode(payload, type=DataRef)
        stream = channels.stream_buckets(ref, "engine-0")
        if target is None:
            target = Buckets.allocate(stream.layouts, "cpu")
        views = [byte_view(buffer) for buffer in target.buffers]
        stream.receive(lambda bucket, start, end: views[bucket][start:end])
    else:
        total, chunk = (int(value) for value in payload.split())
        if landing is None:
            landing = torch.empty(total, dtype=torch.uint8)
        for start in range(0, total, chunk):
            raw.broadcast([landing[start : start + chunk]], options).wait()
    print("done", flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    import msgspec
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles_events.app.config import load_config
    from miles_events.device.buckets import Buckets, byte_view
    from miles_events.rl.canary import CANARY_TENSOR, publication_canary
    from miles_events.rl.hf_model import prepare_base_model
    from miles_events.transport.collective import CollectiveSettings, CollectiveTransport

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--bucket-mb", type=float, default=512)
    args = parser.parse_args(argv)
    bucket_bytes = int(args.bucket_mb * 2**20)
    config = load_config(args.config, args.overrides)
    work = Path(tempfile.mkdtemp(prefix="collective-bench-"))
    weights = load_file(str(prepare_base_model(config.model, work, config.run.seed) / "model.safetensors"))
    staged = Buckets.of({**weights, CANARY_TENSOR: publication_canary("bench", "1")})
    total = sum(buffer.numel() * buffer.element_size() for buffer in staged.buffers)

    plane = CollectiveTransport("bench-collective", work, CollectiveSettings(bucket_bytes, 60.0, "127.0.0.1"))
    ref = plane.stager.publish_buckets("weights-v1", staged, owner="trainer")
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, "127.0.0.1", str(store.port)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert engine.stdin is not None and engine.stdout is not None
    raw = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timedelta(seconds=60))
    flat = torch.cat([byte_view(buffer) for buffer in staged.buffers])
    options = dist.BroadcastOptions()

    def collective() -> float:
        started = time.perf_counter()
        engine.stdin.write(f"collective {msgspec.json.encode(ref).decode()}\n")
        engine.stdin.flush()
        engine.stdout.readline()
        return time.perf_counter() - started

    def bare() -> float:
        started = time.perf_counter()
        engine.stdin.write(f"raw {total} {bucket_bytes}\n")
        engine.stdin.flush()
        for start in range(0, total, bucket_bytes):
            raw.broadcast([flat[start : start + bucket_bytes]], options).wait()
        engine.stdout.readline()
        return time.perf_counter() - started

    collective(), bare()  # channel and group formed, buffers allocated
    seconds: dict[str, list[float]] = {"collective": [], "raw": []}
    for repeat in range(args.repeats):
        for name, run in (("collective", collective), ("raw", bare))[:: 1 if repeat % 2 == 0 else -1]:
            seconds[name].append(run())
    engine.stdin.close()
    engine.wait(timeout=60)
    plane.close()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["raw"] / median["collective"]
    print(f"weights: {len(weights)} tensors, {total / 2**20:.2f} MiB in {len(staged.buffers)} buckets")
    for name, value in median.items():
        print(f"{name}: median {value * 1e3:.2f} ms ({total / value / 2**20:.0f} MiB/s) over {args.repeats}")
    print(
        f"RESULT ratio={ratio:.3f} collective_ms={median['collective'] * 1e3:.2f} raw_ms={median['raw'] * 1e3:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
