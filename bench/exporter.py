"""Cost of the Prometheus exporter against the bus alone, in the same run.

    .venv/bin/python bench/exporter.py [--events 100000] [--repeats 3] [--scrape-interval 15]

The events are the recorded tiny run (tests/fixtures/tiny_run/events.log) repeated, with
their headers cleared so the bus stamps them again: a realistic mix of small facts and
publications carrying checksum digests. Two set-ups publish the same events:

- bus: an EventBus with one consumer draining its mailbox in batches (as the event log);
- bus + exporter: the same plus ``MetricsExporter`` (its own mailbox, RunMetrics, HTTP).

Each time covers publishing every event and draining every mailbox. A scrape is timed as
``generate_latest`` on the exporter's registry and as an HTTP GET of ``/metrics``, and set
against the bus time for the events one scrape interval of the recorded run would see.

``exporter_overhead_ratio`` is the extra time of bus + exporter over the bus alone (0.5:
50% slower); ``exporter_us_per_event`` the same difference per event.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.request
from pathlib import Path

import msgspec
from prometheus_client import generate_latest

from miles_events.bus.event_bus import EventBus
from miles_events.bus.event_log import read_events
from miles_events.sinks.metrics import MetricsExporter, RunMetrics
from schemas.events import Event

FIXTURE_LOG = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_run" / "events.log"
MAX_BATCH = 512


def workload(count: int) -> tuple[list[Event], float]:
    """``count`` events cycling through the recorded run, and that run's events per second."""
    recorded = list(read_events(FIXTURE_LOG))
    span = recorded[-1].time - recorded[0].time
    cleared = [msgspec.structs.replace(e, run_id="", seq=0, time=0.0) for e in recorded]
    return [cleared[i % len(cleared)] for i in range(count)], len(recorded) / span


def median_seconds(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def run_bus(events: list[Event], with_exporter: bool, scrapes: int) -> tuple[float, float, float]:
    """Seconds to publish and drain; with the exporter also one scrape's seconds (text, HTTP)."""
    bus = EventBus("bench")
    mailbox = bus.subscribe("consumer", (Event,))

    async def drain() -> None:
        while await mailbox.get_batch(MAX_BATCH):
            pass

    consumer = asyncio.create_task(drain())
    exporter = MetricsExporter(bus, "127.0.0.1", 0, MAX_BATCH) if with_exporter else None
    start = time.perf_counter()
    for event in events:
        await bus.publish(event, source="bench")
    bus.close()
    await consumer
    if exporter is not None:
        await exporter.task
    seconds = time.perf_counter() - start
    if exporter is None:
        return seconds, 0.0, 0.0
    registry = exporter.metrics.registry

    def http_get() -> None:
        with urllib.request.urlopen(exporter.url, timeout=10) as response:
            response.read()

    text_seconds = median_seconds(lambda: generate_latest(registry), scrapes)
    http_seconds = await asyncio.to_thread(median_seconds, http_get, scrapes)
    await exporter.aclose()
    return seconds, text_seconds, http_seconds


def observe_only(events: list[Event]) -> float:
    """Seconds for RunMetrics.observe alone over the events (stamped with one run id)."""
    stamped = [msgspec.structs.replace(e, run_id="bench") for e in events]
    metrics = RunMetrics()
    start = time.perf_counter()
    for event in stamped:
        metrics.observe(event)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scrapes", type=int, default=20, help="scrapes timed per repeat (median)")
    parser.add_argument("--scrape-interval", type=float, default=15.0, help="Prometheus scrape interval, s")
    args = parser.parse_args()
    events, recorded_rate = workload(args.events)
    bus_best = exporter_best = float("inf")
    text_times: list[float] = []
    http_times: list[float] = []
    for _ in range(args.repeats):
        # Alternate the two so that machine noise hits both alike; keep each one's best.
        bus_seconds, _, _ = asyncio.run(run_bus(events, False, args.scrapes))
        exporter_seconds, text_seconds, http_seconds = asyncio.run(run_bus(events, True, args.scrapes))
        bus_best, exporter_best = min(bus_best, bus_seconds), min(exporter_best, exporter_seconds)
        text_times.append(text_seconds)
        http_times.append(http_seconds)
    observe_seconds = min(observe_only(events) for _ in range(args.repeats))

    n = len(events)
    extra_us = (exporter_best - bus_best) / n * 1e6
    overhead = exporter_best / bus_best - 1
    scrape_text, scrape_http = statistics.median(text_times), statistics.median(http_times)
    interval_events = recorded_rate * args.scrape_interval
    interval_bus_seconds = interval_events / (n / bus_best)

    print(f"{n:,} events (recorded tiny run repeated), best of {args.repeats}")
    print(f"{'':24}{'events/s':>14}{'us/event':>12}")
    print(f"{'bus':24}{n / bus_best:14,.0f}{bus_best / n * 1e6:12.2f}")
    print(f"{'bus + exporter':24}{n / exporter_best:14,.0f}{exporter_best / n * 1e6:12.2f}")
    print(f"{'RunMetrics.observe only':24}{n / observe_seconds:14,.0f}{observe_seconds / n * 1e6:12.2f}")
    print(f"exporter: +{extra_us:.2f} us per event, {overhead:+.1%} time over the bus alone")
    print(
        f"one scrape: generate_latest {scrape_text * 1e3:.2f} ms, HTTP GET {scrape_http * 1e3:.2f} ms; "
        f"the bus publishing the {interval_events:,.0f} events of one {args.scrape_interval:g}s interval "
        f"at the recorded rate ({recorded_rate:,.0f}/s): {interval_bus_seconds * 1e3:.2f} ms "
        f"(scrape / bus = {scrape_http / interval_bus_seconds:.2f})"
    )
    print(
        f"RESULT exporter_us_per_event={extra_us:.3f} exporter_overhead_ratio={overhead:.3f} "
        f"scrape_ms={scrape_http * 1e3:.3f} generate_latest_ms={scrape_text * 1e3:.3f} "
        f"observe_us_per_event={observe_seconds / n * 1e6:.3f} bus_eps={n / bus_best:.0f} "
        f"exporter_eps={n / exporter_best:.0f}"
    )


if __name__ == "__main__":
    main()
