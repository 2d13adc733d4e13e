"""Event-log throughput against a pydantic v2 JSON-lines log, measured in the same run.

Both logs hold the same realistic mix of events (rollouts, train steps, the publication
saga with a digest, tensor count, bytes and checksum-manifest path per weight event, data
releases); the pydantic models mirror ours field for field.

The weight events are built by ``weight_events`` (ours) and ``p_weight_events`` (the
pydantic mirror) only, so the mix follows a schema change there.

Like for like, the file is kept open on both sides and flushed to the OS at the same
points: after every event (ours: ``EventLogWriter.append``; the baseline writes
``model_dump_json()`` plus a newline to a buffered text file and flushes it) or after
every batch (ours: ``append_many``, what the run's log subscriber does with each batch the
bus delivers; the baseline writes the batch's lines at once and flushes). Reading is
``read_events`` (what ``python -m miles_events.replay`` uses) against
``model_validate_json`` of the discriminated union per line. For information, the
baseline is also written the way miles' audit event logger writes (lock, open the file in
append mode, write one line, close).

Every measurement runs ``--repeat`` rounds, ours and the baseline interleaved in each; the
figures are medians (ratios: the median of the per-round ratios).

Run: ``.venv/bin/python bench/event_log.py [--events N] [--repeat R] [--batch B]``. The
last line is ``RESULT event_log_write_ratio=... event_log_read_ratio=... ...``.
``--profile`` instead times each step of each path alone.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec
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
    TrainMetrics,
    TrainStepFinished,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)

MIXES = ("digest",)

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


class PTrainMetrics(BaseModel):
    model_config = ConfigDict(frozen=True)
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    clipfrac: float = 0.0
    train_tokens: int = 0
    num_optimizer_steps: int = 0


class PTrainStepFinished(PEvent):
    type: Literal["TrainStepFinished"] = "TrainStepFinished"
    rollout_id: int
    weight_version: str
    metrics: PTrainMetrics = PTrainMetrics()
    staleness_max: int = 0
    train_seconds: float = 0.0


class PWeightsStagedDigest(PEvent):
    type: Literal["WeightsStaged"] = "WeightsStaged"
    weight_version: str
    weights: PDataRef
    digest: str
    num_tensors: int
    num_bytes: int
    checksums_manifest: str
    rollout_id: int | None = None
    stage_seconds: float = 0.0


class PWeightsLoadedDigest(PEvent):
    type: Literal["WeightsLoaded"] = "WeightsLoaded"
    engine: str
    weight_version: str
    previous_version: str
    digest: str
    num_tensors: int
    num_bytes: int
    checksums_manifest: str
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


_P_COMMON = (
    PRolloutRequested,
    PRolloutGenerated,
    PTrainStepFinished,
    PWeightsPublished,
    PPublicationVerified,
    PDataReleased,
)

PAnyEventDigest = Annotated[
    PRolloutRequested
    | PRolloutGenerated
    | PTrainStepFinished
    | PWeightsStagedDigest
    | PWeightsLoadedDigest
    | PWeightsPublished
    | PPublicationVerified
    | PDataReleased,
    Field(discriminator="type"),
]


class PEventRecordDigest(RootModel[PAnyEventDigest]):
    """One line of the baseline log: any event, dispatched on ``type``."""


RECORD_MODELS: dict[str, type[RootModel]] = {"digest": PEventRecordDigest}

_PYDANTIC_BY_NAME: dict[str, type[BaseModel]] = {cls.model_fields["type"].default: cls for cls in _P_COMMON}

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
WEIGHTS_BYTES = 3 << 20


def _digest(version: int) -> str:
    return f"{hash(('digest', version)) & (2**256 - 1):064x}"


def _manifest(version: int) -> str:
    """The content-addressed checksum manifest of ``version``, as the run names it."""
    return f"checksums/{_digest(version)}.msgpack"


def _weights_ref(version: int) -> DataRef:
    return DataRef("shm", f"weights-{version}", "trainer", WEIGHTS_BYTES)


def weight_events(mix: str, version: int, rollout_id: int, engines: Sequence[str]) -> list[Event]:
    """Ours: the trainer's ``WeightsStaged``, then one ``WeightsLoaded`` per engine."""
    staged = WeightsStaged(
        weight_version=str(version),
        weights=_weights_ref(version),
        digest=_digest(version),
        num_tensors=len(_TENSORS),
        num_bytes=WEIGHTS_BYTES,
        checksums_manifest=_manifest(version),
        rollout_id=rollout_id,
        stage_seconds=0.05,
        source="trainer",
    )
    loaded = [
        WeightsLoaded(
            engine=engine,
            weight_version=str(version),
            previous_version=str(version - 1),
            digest=_digest(version),
            num_tensors=len(_TENSORS),
            num_bytes=WEIGHTS_BYTES,
            checksums_manifest=_manifest(version),
            load_seconds=0.07,
            source="generator",
        )
        for engine in engines
    ]
    return [staged, *loaded]


def p_weight_events(mix: str, version: int, rollout_id: int, engines: Sequence[str]) -> list[BaseModel]:
    """The pydantic mirror of ``weight_events``."""
    weights = PDataRef(transport="shm", key=f"weights-{version}", owner="trainer", num_bytes=WEIGHTS_BYTES)
    staged: BaseModel = PWeightsStagedDigest(
        weight_version=str(version),
        weights=weights,
        digest=_digest(version),
        num_tensors=len(_TENSORS),
        num_bytes=WEIGHTS_BYTES,
        checksums_manifest=_manifest(version),
        rollout_id=rollout_id,
        stage_seconds=0.05,
        source="trainer",
    )
    loaded: list[BaseModel] = [
        PWeightsLoadedDigest(
            engine=engine,
            weight_version=str(version),
            previous_version=str(version - 1),
            digest=_digest(version),
            num_tensors=len(_TENSORS),
            num_bytes=WEIGHTS_BYTES,
            checksums_manifest=_manifest(version),
            load_seconds=0.07,
            source="generator",
        )
        for engine in engines
    ]
    return [staged, *loaded]


def _to_pydantic(event: Event) -> BaseModel:
    return _PYDANTIC_BY_NAME[type(event).__name__].model_validate(msgspec.to_builtins(event))


def _rollout(mix: str, rollout_id: int, num_engines: int = 2) -> tuple[list[Event], list[BaseModel]]:
    """The events one rollout of a run emits, in order: ours and the pydantic mirror."""
    version = rollout_id + 1
    batch = DataRef("shm", f"rollout-{rollout_id}", "generator", 1 << 20)
    engines = [f"engine-{i}" for i in range(num_engines)]
    before: list[Event] = [
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
            metrics=TrainMetrics(
                loss=0.123,
                pg_loss=0.1,
                kl=0.01,
                entropy=2.3,
                grad_norm=0.9,
                clipfrac=0.05,
                train_tokens=2048,
                num_optimizer_steps=rollout_id + 1,
            ),
            train_seconds=2.5,
            source="trainer",
        ),
        DataReleased(ref=batch, source="trainer"),
    ]
    after: list[Event] = [
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
            digest=_digest(version),
            num_tensors=len(_TENSORS),
            engines=engines,
            rollout_id=rollout_id,
            verify_seconds=0.001,
            source="verifier",
        ),
        DataReleased(ref=_weights_ref(version), source="publisher"),
    ]
    ours = before + weight_events(mix, version, rollout_id, engines) + after
    theirs = (
        [_to_pydantic(e) for e in before]
        + p_weight_events(mix, version, rollout_id, engines)
        + [_to_pydantic(e) for e in after]
    )
    return ours, theirs


def make_workload(n: int, mix: str = "digest") -> tuple[list[Event], list[BaseModel]]:
    """``n`` events of consecutive rollouts, stamped as the bus would stamp them, and the
    same events as pydantic models (built once, outside the timed region)."""
    events: list[Event] = []
    models: list[BaseModel] = []
    rollout_id = 0
    while len(events) < n:
        ours, theirs = _rollout(mix, rollout_id)
        events += ours
        models += theirs
        rollout_id += 1
    now = time.time()
    stamps = [{"run_id": "bench-run", "seq": i + 1, "time": now + i * 1e-3} for i in range(n)]
    return (
        [msgspec.structs.replace(e, **stamp) for e, stamp in zip(events, stamps, strict=True)],
        [m.model_copy(update=stamp) for m, stamp in zip(models, stamps, strict=True)],
    )


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


def baseline_read(path: Path, record: type[RootModel]) -> int:
    count = 0
    validate = record.model_validate_json
    with open(path, encoding="utf-8") as file:
        for line in file:
            validate(line)
            count += 1
    return count


def timed(fn: Callable[[], object]) -> float:
    """One run of ``fn`` in seconds, with the collector paused."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def profile(mix: str, events: Sequence[Event], models: Sequence[BaseModel], repeat: int, batch: int) -> None:
    """Where the time of each path goes: its steps timed alone, ns per event (medians of
    ``repeat`` interleaved rounds). The steps of one path do not add up exactly to its
    total (the loop that joins them costs too)."""
    import os
    import struct
    import zlib

    from miles_events.bus.codec import EVENT_DECODER, EVENT_ENCODER

    encode, decode, crc32, pack = (
        EVENT_ENCODER.encode,
        EVENT_DECODER.decode,
        zlib.crc32,
        struct.Struct(">II").pack,
    )
    payloads = [encode(e) for e in events]
    records = [pack(len(p), crc32(p)) + p for p in payloads]
    lines = [m.model_dump_json() + "\n" for m in models]
    validate = RECORD_MODELS[mix].model_validate_json
    batches = [events[i : i + batch] for i in range(0, len(events), batch)]
    blobs = [b"".join(records[i : i + batch]) for i in range(0, len(records), batch)]
    n = len(events)
    with tempfile.TemporaryDirectory() as tmp:
        ours_path, base_path = Path(tmp) / "events.log", Path(tmp) / "events.jsonl"
        fd = os.open(Path(tmp) / "scratch", os.O_WRONLY | os.O_CREAT, 0o644)
        text = open(Path(tmp) / "scratch.jsonl", "w", encoding="utf-8")
        ours_write_batched(ours_path, events, batch)
        baseline_write_batched(base_path, models, batch)

        def each(fn: Callable[[object], object], items: Sequence[object]) -> Callable[[], None]:
            return lambda: collections.deque(map(fn, items), maxlen=0)

        def fresh(path: Path, write: Callable[[], None]) -> Callable[[], None]:
            return lambda: (path.unlink(), write())

        def write_flush(line: str) -> None:
            text.write(line)
            text.flush()

        steps: dict[str, Callable[[], object]] = {
            "ours  encode (msgspec)": each(encode, events),
            "ours  encode, in lists of the batch": lambda: [list(map(encode, b)) for b in batches],
            "ours  crc32 of the payload": each(crc32, payloads),
            "ours  frame header (pack + len + crc32)": lambda: list(
                map(pack, map(len, payloads), map(crc32, payloads))
            ),
            "ours  write(2) of one record": each(lambda r: os.write(fd, r), records),
            f"ours  write(2) of {batch} records, per event": each(lambda b: os.write(fd, b), blobs),
            "ours  append (total)": fresh(ours_path, lambda: ours_write(ours_path, events)),
            f"ours  append_many of {batch} (total)": fresh(
                ours_path, lambda: ours_write_batched(ours_path, events, batch)
            ),
            "ours  decode (msgspec, typed)": each(decode, payloads),
            "ours  read_events (total)": lambda: ours_read(ours_path),
            "base  model_dump_json": each(lambda m: m.model_dump_json(), models),
            "base  text write + flush of one line": each(write_flush, lines),
            "base  write + flush per event (total)": lambda: baseline_write(base_path, models),
            f"base  write + flush per {batch} (total)": lambda: baseline_write_batched(
                base_path, models, batch
            ),
            "base  model_validate_json": each(validate, lines),
            "base  read (total)": lambda: baseline_read(base_path, RECORD_MODELS[mix]),
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeat):
            for name, step in steps.items():
                times[name].append(timed(step))
        text.close()
        os.close(fd)
    print(f"\nprofile, {mix} mix: ns per event")
    for name, seconds in times.items():
        print(f"  {name:45}{statistics.median(seconds) / n * 1e9:>8,.0f}")


def _cases(
    mix: str,
    events: Sequence[Event],
    models: Sequence[BaseModel],
    record: type[RootModel],
    ours_path: Path,
    base_path: Path,
    batch: int,
) -> list[tuple[str, Callable[[], object] | None, Callable[[], object]]]:
    """(case, ours, baseline) for one round of one mix; each write starts a fresh file and
    the read reads what the writes before it left."""

    def fresh(path: Path, write: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            path.unlink(missing_ok=True)
            write()

        return run

    cases: list[tuple[str, Callable[[], object] | None, Callable[[], object]]] = [
        (
            "write_event",
            fresh(ours_path, lambda: ours_write(ours_path, events)),
            fresh(base_path, lambda: baseline_write(base_path, models)),
        ),
        (
            "write_batch",
            fresh(ours_path, lambda: ours_write_batched(ours_path, events, batch)),
            fresh(base_path, lambda: baseline_write_batched(base_path, models, batch)),
        ),
        ("read", lambda: ours_read(ours_path), lambda: baseline_read(base_path, record)),
    ]
    if mix == "digest":
        # The same run of ours as "write_event" in the same round is its counterpart.
        cases.append(("miles", None, fresh(base_path, lambda: baseline_write_as_miles(base_path, models))))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds; medians count")
    parser.add_argument(
        "--batch", type=int, default=256, help="events per append_many call and per baseline flush"
    )
    parser.add_argument("--profile", action="store_true", help="time each step of each path instead")
    args = parser.parse_args(argv)

    workloads = {mix: make_workload(args.events, mix) for mix in MIXES}
    if args.profile:
        for mix in MIXES:
            profile(mix, *workloads[mix], args.repeat, args.batch)
        return 0
    n = args.events
    # (mix, case) -> [ours seconds], [baseline seconds]
    times: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    sizes: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ours_path = Path(tmp) / "events.log"
        base_path = Path(tmp) / "events.jsonl"
        for round_ in range(args.repeat):
            for mix in MIXES:
                events, models = workloads[mix]
                record = RECORD_MODELS[mix]
                for case, ours, base in _cases(mix, events, models, record, ours_path, base_path, args.batch):
                    ours_times, base_times = times.setdefault((mix, case), ([], []))
                    ours_times.append(times[(mix, "write_event")][0][-1] if ours is None else timed(ours))
                    base_times.append(timed(base))
                if round_ == 0:
                    # Both logs must hold the same events, or the comparison means nothing.
                    assert list(read_events(ours_path)) == events, "event log round trip changed events"
                    with open(base_path, encoding="utf-8") as file:
                        assert [record.model_validate_json(line).root for line in file] == models
                    sizes[mix] = (ours_path.stat().st_size / n, base_path.stat().st_size / n)

    def eps(mix: str, ours_case: str, base_case: str) -> tuple[float, float, float]:
        """Median events/s of ours and the baseline, and the median per-round ratio."""
        ours_times, base_times = times[(mix, ours_case)][0], times[(mix, base_case)][1]
        ratio = statistics.median(b / o for o, b in zip(ours_times, base_times, strict=True))
        return n / statistics.median(ours_times), n / statistics.median(base_times), ratio

    print(f"{n} events per mix, pydantic {pydantic.VERSION}, msgspec {msgspec.__version__}")
    print(f"{args.repeat} interleaved rounds; medians; events per second (higher is better)\n")
    # (label, RESULT key, our case, the baseline's case; eps keys are reported for like for like)
    rows = [
        ("write, flush per event", "event_log_write_ratio", "write_event", "write_event"),
        (
            f"write, flush per {args.batch} events",
            "event_log_batched_write_ratio",
            "write_batch",
            "write_batch",
        ),
        ("read", "event_log_read_ratio", "read", "read"),
        ("(info) write per event vs miles' logger", "event_log_write_ratio_vs_miles", "write_event", "miles"),
        (
            f"(info) write per {args.batch} vs miles' logger",
            "event_log_batched_write_ratio_vs_miles",
            "write_batch",
            "miles",
        ),
    ]
    print(f"{'mix':8}{'':45}{'ours':>12}{'pydantic':>12}{'ratio':>8}")
    result: dict[str, str] = {}
    for mix in MIXES:
        suffix = ""
        for label, key, ours_case, base_case in rows:
            if (mix, base_case) not in times:
                continue
            ours_eps, base_eps, ratio = eps(mix, ours_case, base_case)
            print(f"{mix:8}{label:45}{ours_eps:>12,.0f}{base_eps:>12,.0f}{ratio:>7.2f}x")
            result[key + suffix] = f"{ratio:.2f}"
            if ours_case == base_case:
                result[f"ours_{ours_case}_eps{suffix}"] = f"{ours_eps:.0f}"
                result[f"baseline_{base_case}_eps{suffix}"] = f"{base_eps:.0f}"
        ours_bpe, base_bpe = sizes[mix]
        print(
            f"{mix:8}{'bytes per event':45}{ours_bpe:>12,.0f}{base_bpe:>12,.0f}{ours_bpe / base_bpe:>7.2f}x"
        )
        result[f"ours_bytes_per_event{suffix}"] = f"{ours_bpe:.0f}"
        result[f"baseline_bytes_per_event{suffix}"] = f"{base_bpe:.0f}"
    print("\n(like for like: both files kept open and flushed at the same points; miles keeps nothing open)")
    print("RESULT " + " ".join(f"{key}={value}" for key, value in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
