"""Cross-process event delivery on the ray runtime: batched proxies against one Ray actor
call per event, in the same run, on the same local Ray cluster.

    .venv/bin/python bench/ray_delivery.py [--events 50000] [--baseline-events 3000]

"batched": events published on the driver's bus reach an actor in another process through
the ray runtime's proxy (msgpack batches of up to ``bus.max_batch``). The actor answers once
it has handled them all. "one call per event": the same events sent as one
``handle.remote(encoded_event)`` each, both awaited one by one ("sequential") and submitted
all at once then awaited ("pipelined", Ray keeps one caller's order).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import ray

from miles_events.bus.actor import Actor, handles
from miles_events.bus.codec import decode_event, encode_event
from miles_events.bus.event_bus import EventBus
from miles_events.runtime.base import RunContext
from miles_events.runtime.ray import RayRuntime
from miles_events.transport.inprocess import InProcessTransport
from schemas.config import BusConfig, Config, RayConfig, RunConfig
from schemas.events import RolloutRequested, RunFinished
from schemas.plan import RunPlan


class Sink(Actor):
    """Counts events; says so once it has seen the expected number."""

    name = "sink"
    expected = 0

    def __init__(self, config: Config, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.count = 0

    @handles(RolloutRequested, emits=(RunFinished,))
    async def on_event(self, event: RolloutRequested) -> None:
        self.count += 1
        if event.rollout_id == -1:
            await self.publish(RunFinished(status="completed", reason=str(self.count)))


@ray.remote
class Unbatched:
    def __init__(self) -> None:
        self.count = 0

    def handle(self, payload: bytes) -> int:
        decode_event(payload)
        self.count += 1
        return self.count


async def batched(n: int, max_batch: int) -> float:
    # The sink is a light actor: the option gives it the process of its own this bench crosses to.
    config = Config(
        run=RunConfig(runtime="ray"), bus=BusConfig(max_batch=max_batch), ray=RayConfig(own_process=["sink"])
    )
    bus = EventBus("bench", mailbox_size=config.bus.mailbox_size)
    done = bus.subscribe("done", (RunFinished,))
    plan = RunPlan(start_rollout_id=0, num_rollout=1, num_rollout_per_epoch=1, runtime="ray")
    runtime = RayRuntime(
        RunContext("bench", config, Path(tempfile.mkdtemp()), "inprocess", plan), InProcessTransport("bench")
    )
    await runtime.start(bus, [Sink])
    events = [RolloutRequested(rollout_id=i) for i in range(n - 1)] + [RolloutRequested(rollout_id=-1)]
    start = time.perf_counter()
    for event in events:
        await bus.publish(event)
    finished = await done.get()
    seconds = time.perf_counter() - start
    assert isinstance(finished, RunFinished) and int(finished.reason) == n, finished
    bus.close()
    for proxy in runtime.proxies:
        await proxy.stop()
    return seconds


async def one_call_per_event(n: int, pipelined: bool) -> float:
    actor = Unbatched.remote()
    await actor.handle.remote(encode_event(RolloutRequested(rollout_id=0)))
    payloads = [encode_event(RolloutRequested(rollout_id=i, seq=i + 1)) for i in range(n)]
    start = time.perf_counter()
    if pipelined:
        refs = [actor.handle.remote(p) for p in payloads]
        counts = await asyncio.gather(*refs)
    else:
        counts = [await actor.handle.remote(p) for p in payloads]
    seconds = time.perf_counter() - start
    assert counts[-1] == n + 1
    ray.kill(actor)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--baseline-events", type=int, default=3_000)
    parser.add_argument("--max-batch", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        rows = {
            "batched (ours)": args.events / asyncio.run(batched(args.events, args.max_batch)),
            "one call per event, pipelined": args.baseline_events
            / asyncio.run(one_call_per_event(args.baseline_events, pipelined=True)),
            "one call per event, sequential": args.baseline_events
            / asyncio.run(one_call_per_event(args.baseline_events, pipelined=False)),
        }
    finally:
        ray.shutdown() if hasattr(ray, "shutdown") else None
    print(f"{'':34}{'events/s':>12}")
    for name, eps in rows.items():
        print(f"{name:34}{eps:12,.0f}")
    ours = rows["batched (ours)"]
    vs_pipelined = ours / rows["one call per event, pipelined"]
    vs_sequential = ours / rows["one call per event, sequential"]
    print(
        f"batched / pipelined single calls: {vs_pipelined:.1f}x; / sequential: {vs_sequential:.1f}x (goal >= 20x)"
    )
    print(
        f"RESULT ray_batched_ratio_vs_pipelined={vs_pipelined:.1f} ray_batched_ratio_vs_sequential={vs_sequential:.1f} "
        f"batched_eps={ours:.0f} pipelined_eps={rows['one call per event, pipelined']:.0f} "
        f"sequential_eps={rows['one call per event, sequential']:.0f}"
    )


if __name__ == "__main__":
    main()
