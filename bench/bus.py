"""In-process bus throughput and latency against a bare asyncio.Queue, in the same run.

    .venv/bin/python bench/bus.py [--events 200000] [--mailbox 4096] [--repeats 3]

Both sides move the same pre-built events from one producer task to one consumer task
through a bounded queue of the same size; the bus additionally stamps seq/run_id/time,
routes by type and keeps statistics. Latency is publish-call to receipt, per event.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from miles_events.bus.event_bus import EventBus
from schemas.events import Event, RolloutRequested


async def run_queue(events: list[Event], size: int) -> tuple[float, list[int]]:
    queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=size)
    sent = [0] * len(events)
    latency = [0] * len(events)

    async def consume() -> None:
        i = 0
        while (await queue.get()) is not None:
            latency[i] = time.perf_counter_ns() - sent[i]
            i += 1

    consumer = asyncio.create_task(consume())
    start = time.perf_counter()
    for i, event in enumerate(events):
        sent[i] = time.perf_counter_ns()
        await queue.put(event)
    await queue.put(None)
    await consumer
    return time.perf_counter() - start, latency


async def run_bus(events: list[Event], size: int) -> tuple[float, list[int]]:
    bus = EventBus("bench", mailbox_size=size)
    mailbox = bus.subscribe("consumer", (Event,))
    bus.subscribe("other", ())  # a second subscriber that routes nothing, as in a real run
    sent = [0] * len(events)
    latency = [0] * len(events)

    async def consume() -> None:
        i = 0
        while (await mailbox.get()) is not None:
            latency[i] = time.perf_counter_ns() - sent[i]
            i += 1

    consumer = asyncio.create_task(consume())
    start = time.perf_counter()
    for i, event in enumerate(events):
        sent[i] = time.perf_counter_ns()
        await bus.publish(event, source="bench")
    bus.close()
    await consumer
    return time.perf_counter() - start, latency


def p99_us(latency: list[int]) -> float:
    return statistics.quantiles(latency, n=100)[98] / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--mailbox", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    events: list[Event] = [RolloutRequested(rollout_id=i) for i in range(args.events)]
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeats):
        # Alternate the two so that machine noise hits both alike; keep each one's best.
        for name, fn in (("asyncio.Queue", run_queue), ("EventBus", run_bus)):
            seconds, latency = asyncio.run(fn(events, args.mailbox))
            eps = len(events) / seconds
            if name not in best or eps > best[name][0]:
                best[name] = (eps, p99_us(latency))
    print(f"{'':16}{'events/s':>14}{'p99 latency us':>18}")
    for name, (eps, p99) in best.items():
        print(f"{name:16}{eps:14,.0f}{p99:18.1f}")
    ratio = best["EventBus"][0] / best["asyncio.Queue"][0]
    print(f"throughput ratio EventBus / asyncio.Queue: {ratio:.2f} (goal >= 0.5)")
    print(
        f"RESULT bus_throughput_ratio={ratio:.3f} bus_eps={best['EventBus'][0]:.0f} "
        f"queue_eps={best['asyncio.Queue'][0]:.0f} bus_p99_us={best['EventBus'][1]:.1f} "
        f"queue_p99_us={best['asyncio.Queue'][1]:.1f}"
    )


if __name__ == "__main__":
    main()
