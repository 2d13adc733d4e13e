"""Event-log throughput against a pydantic v2 JSON-lines log, measured in the same run.

Both logs hold the same realistic mix of events (rollouts, train steps, the publication
saga with a digest and a checksum-manifest path per engine, checkpoints). Ours is ``EventLogWriter.append``
(one event, one write, flushed) or ``append_many`` (what the run's log subscriber does
with each batch the bus delivers) + ``read_events``. The baselines are equivalent pydantic
models written with ``model_dump_json()`` plus a newline, (a) the way miles' audit event
logger writes (lock, open the file in append mode, write one line, close) and (b) with
the file kept open and flushed per line or per batch; read back with
``model_validate_json`` of the discriminated union per line.

Run: ``.venv/bin/python bench/event_log.py [--events N] [--repeat R]``. The last line is
``RESULT event_log_write_ratio=... event_log_read_ratio=... ...``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, RootModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_events.bus.event_log import EventLogWriter, read_events
from schemas.data import DataRef
from schemas.events import (
    DataReleased,
    Event,
    PublicationVerified,
    RolloutGenerated,
    RolloutRequested,
    TrainStepFinished,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)

# --- the baseline: the same events as pydantic v2 models ------------------------------


class PEvent(BaseModel):
    model_config = ConfigDict(frozen=True)
    run_id: str = ""
    seq: int = 0
    time: float = 0.0
    source: str = ""


class PDataRef(BaseModel):
    model_config = ConfigDict(frozen=True)
    transport: str
    key: str
    owner: str
    num_bytes: int = 0


class PRolloutRequested(PEvent):
    type: Literal["RolloutRequested"] = "RolloutRequested"
    rollout_id: int


class PRolloutGenerated(PEvent):
    type: Literal["RolloutGenerated"] = "RolloutGenerated"
    rollout_id: int
    batch: PDataRef
    num_samples: int
    reward_mean: float
    weight_versions: list[str]
    response_tokens: int = 0
    generate_seconds: float = 0.0


class PTrainStepFinished(PEvent):
    type: Literal["TrainStepFinished"] = "TrainStepFinished"
    rollout_id: int
    weight_version: str
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    grad_norm: float
    clipfrac: float
    train_tokens: int
    num_optimizer_steps: int
    staleness_max: int = 0
    train_seconds: float = 0.0


class PWeightsStaged(PEvent):
    type: Literal["WeightsStaged"] = "WeightsStaged"
    weight_version: str
    weights: PDataRef
    digest: str
    num_tensors: int
    num_bytes: int
    checksums_manifest: str = ""
    rollout_id: int | None = None
    stage_seconds: float = 0.0


class PWeightsLoaded(PEvent):
    type: Literal["WeightsLoaded"] = "WeightsLoaded"
    engine: str
    weight_version: str
    previous_version: str
    digest: str
    num_tensors: int = 0
    num_bytes: int = 0
    checksums_manifest: str = ""
    load_seconds: float = 0.0


class PWeightsPublished(PEvent):
    type: Literal["WeightsPublished"] = "WeightsPublished"
    weight_version: str
    engines: list[str]
    previous_versions: list[str]
    rollout_id: int | None = None
    stage_seconds: float = 0.0
    load_seconds: float = 0.0
    publish_seconds: float = 0.0


class PPublicationVerified(PEvent):
    type: Literal["PublicationVerified"] = "PublicationVerified"
    weight_version: str
    digest: str
    num_tensors: int
    engines: list[str]
    rollout_id: int | None = None
    verify_seconds: float = 0.0


class PDataReleased(PEvent):
    type: Literal["DataReleased"] = "DataReleased"
    ref: PDataRef


PAnyEvent = Annotated[
    PRolloutRequested
    | PRolloutGenerated
    | PTrainStepFinished
    | PWeightsStaged
    | PWeightsLoaded
    | PWeightsPublished
    | PPublicationVerified
    | PDataReleased,
    Field(discriminator="type"),
]


class PEventRecord(RootModel[PAnyEvent]):
    """One line of the baseline log: any event, dispatched on ``type``."""


_PYDANTIC_BY_NAME: dict[str, type[BaseModel]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        PRolloutRequested,
        PRolloutGenerated,
        PTrainStepFinished,
        PWeightsStaged,
        PWeightsLoaded,
        PWeightsPublished,
        PPublicationVerified,
        PDataReleased,
    )
}

# --- the workload ---------------------------------------------------------------------

_TENSORS = [
    f"model.layers.{layer}.{part}"
    for layer in range(4)
    for part in (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
] + ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def _checksums(version: int, engine: int) -> dict[str, str]:
    return {name: f"{(hash((name, version, engine)) & (2**64 - 1)):016x}" for name in _TENSORS}


def _rollout_events(rollout_id: int, num_engines: int = 2) -> list[Event]:
    """The events one rollout of a run emits, in order."""
    version = rollout_id + 1
    batch = DataRef("shm", f"rollout-{rollout_id}", "generator", 1 << 20)
    weights = DataRef("shm", f"weights-{version}", "trainer", 3 << 20)
    checksums = _checksums(version, 0)
    digest = f"{hash(('digest', version)) & (2**256 - 1):064x}"
    engines = [f"engine-{i}" for i in range(num_engines)]
    events: list[Event] = [
        RolloutRequested(rollout_id=rollout_id, source="coordinator"),
        RolloutGenerated(
            rollout_id=rollout_id,
            batch=batch,
            num_samples=64,
            reward_mean=0.42 + rollout_id * 1e-4,
            weight_versions=[str(version - 1)],
            response_tokens=1024,
            generate_seconds=1.25,
            source="generator",
        ),
        TrainStepFinished(
            rollout_id=rollout_id,
            weight_version=str(version - 1),
            loss=0.123,
            pg_loss=0.1,
            kl=0.01,
            entropy=2.3,
            grad_norm=0.9,
            clipfrac=0.05,
            train_tokens=2048,
            num_optimizer_steps=rollout_id + 1,
            train_seconds=2.5,
            source="trainer",
        ),
        DataReleased(ref=batch, source="trainer"),
        WeightsStaged(
            weight_version=str(version),
            weights=weights,
            digest=digest,
            num_tensors=len(checksums),
            num_bytes=3 << 20,
            checksums_manifest=f"checksums/{digest}.msgpack",
            rollout_id=rollout_id,
            stage_seconds=0.05,
            source="trainer",
        ),
    ]
    events += [
        WeightsLoaded(
            engine=engine,
            weight_version=str(version),
            previous_version=str(version - 1),
            digest=digest,
            num_tensors=len(checksums),
            num_bytes=3 << 20,
            checksums_manifest=f"checksums/{digest}.msgpack",
            load_seconds=0.07,
            source="generator",
        )
        for engine in engines
    ]
    events += [
        WeightsPublished(
            weight_version=str(version),
            engines=engines,
            previous_versions=[str(version - 1)] * num_engines,
            rollout_id=rollout_id,
            stage_seconds=0.05,
            load_seconds=0.07,
            publish_seconds=0.13,
            source="publisher",
        ),
        PublicationVerified(
            weight_version=str(version),
            digest=digest,
            num_tensors=len(checksums),
            engines=engines,
            rollout_id=rollout_id,
            verify_seconds=0.001,
            source="verifier",
        ),
        DataReleased(ref=weights, source="publisher"),
    ]
    return events


def make_workload(n: int) -> list[Event]:
    """``n`` events of consecutive rollouts, stamped as the bus would stamp them."""
    events: list[Event] = []
    rollout_id = 0
    now = time.time()
    while len(events) < n:
        events += _rollout_events(rollout_id)
        rollout_id += 1
    import msgspec

    return [
        msgspec.structs.replace(e, run_id="bench-run", seq=i + 1, time=now + i * 1e-3)
        for i, e in enumerate(events[:n])
    ]


def to_pydantic(events: Sequence[Event]) -> list[BaseModel]:
    """The same events as pydantic models (built once, outside the timed region)."""
    import msgspec

    return [
        _PYDANTIC_BY_NAME[type(e).__name__].model_validate(msgspec.to_builtins(e)) for e in events
    ]


# --- the timed work -------------------------------------------------------------------


def ours_write(path: Path, events: Sequence[Event]) -> None:
    with EventLogWriter(path) as writer:
        append = writer.append
        for event in events:
            append(event)


def ours_write_batched(path: Path, events: Sequence[Event], batch: int) -> None:
    with EventLogWriter(path) as writer:
        for start in range(0, len(events), batch):
            writer.append_many(events[start : start + batch])


def ours_read(path: Path) -> int:
    count = 0
    for _ in read_events(path):
        count += 1
    return count


def baseline_write(path: Path, models: Sequence[BaseModel]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for model in models:
            file.write(model.model_dump_json() + "\n")
            file.flush()


def baseline_write_as_miles(path: Path, models: Sequence[BaseModel]) -> None:
    """miles' audit EventLogger: each event dumped to JSON, then, under a lock, the file is
    opened in append mode, the line written and the file closed (so it can be replaced
    between events). Its optional console echo of each event is left out here."""
    lock = threading.Lock()
    for model in models:
        line = model.model_dump_json() + "\n"
        with lock, open(path, "a", encoding="utf-8") as file:
            file.write(line)


def baseline_write_batched(path: Path, models: Sequence[BaseModel], batch: int) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for start in range(0, len(models), batch):
            file.write("".join(m.model_dump_json() + "\n" for m in models[start : start + batch]))
            file.flush()


def baseline_read(path: Path) -> int:
    count = 0
    validate = PEventRecord.model_validate_json
    with open(path, encoding="utf-8") as file:
        for line in file:
            validate(line)
            count += 1
    return count


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    """The fastest of ``repeat`` runs, in seconds, with the collector paused."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best counts")
    parser.add_argument(
        "--batch", type=int, default=256, help="events per append_many call in the batched row"
    )
    args = parser.parse_args(argv)

    events = make_workload(args.events)
    models = to_pydantic(events)
    n = len(events)
    with tempfile.TemporaryDirectory() as tmp:
        ours_path = Path(tmp) / "events.log"
        base_path = Path(tmp) / "events.jsonl"

        def fresh(path: Path, write: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                path.unlink(missing_ok=True)
                write()

            return run

        ours_wb = best_of(args.repeat, fresh(ours_path, lambda: ours_write_batched(ours_path, events, args.batch)))
        base_wb = best_of(args.repeat, fresh(base_path, lambda: baseline_write_batched(base_path, models, args.batch)))
        ours_w = best_of(args.repeat, fresh(ours_path, lambda: ours_write(ours_path, events)))
        base_w = best_of(args.repeat, fresh(base_path, lambda: baseline_write(base_path, models)))
        miles_w = best_of(args.repeat, fresh(base_path, lambda: baseline_write_as_miles(base_path, models)))
        ours_r = best_of(args.repeat, lambda: ours_read(ours_path))
        base_r = best_of(args.repeat, lambda: baseline_read(base_path))
        # Both logs must hold the same events, or the comparison means nothing.
        assert list(read_events(ours_path)) == events, "event log round trip changed events"
        assert baseline_read(base_path) == n
        ours_mib = ours_path.stat().st_size / 2**20
        base_mib = base_path.stat().st_size / 2**20

    ours_write_eps, ours_read_eps = n / ours_w, n / ours_r
    base_write_eps, base_read_eps = n / base_w, n / base_r
    miles_write_eps = n / miles_w
    write_ratio, read_ratio = ours_write_eps / base_write_eps, ours_read_eps / base_read_eps
    miles_ratio = ours_write_eps / miles_write_eps
    print(f"{n} events, {ours_mib:.1f} MiB ours / {base_mib:.1f} MiB baseline; pydantic {pydantic.VERSION}")
    print(f"best of {args.repeat}; events per second (higher is better)\n")
    rows = [
        ("write per event, vs miles' open-append-close", n / ours_w, n / miles_w),
        (f"write in batches of {args.batch}, vs miles", n / ours_wb, n / miles_w),
        ("write, flush per event (file kept open)", n / ours_w, n / base_w),
        ("read", n / ours_r, n / base_r),
        (f"write, flush per {args.batch} (info)", n / ours_wb, n / base_wb),
    ]
    print(f"{'':46}{'ours':>12}{'pydantic':>12}{'ratio':>8}")
    for name, ours, base in rows:
        print(f"{name:46}{ours:>12,.0f}{base:>12,.0f}{ours / base:>7.2f}x")
    print("\n(ratios against a file kept open are the like-for-like ones; miles keeps nothing open)")
    print(
        f"RESULT event_log_write_ratio_vs_miles={miles_ratio:.2f} "
        f"event_log_batched_write_ratio_vs_miles={miles_w / ours_wb:.2f} "
        f"event_log_write_ratio={write_ratio:.2f} event_log_read_ratio={read_ratio:.2f} "
        f"miles_write_eps={miles_write_eps:.0f} "
        f"ours_write_eps={ours_write_eps:.0f} ours_read_eps={ours_read_eps:.0f} "
        f"baseline_write_eps={base_write_eps:.0f} baseline_read_eps={base_read_eps:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
