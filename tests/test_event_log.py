"""The event log: framing, torn-tail detection, resume and repair."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from miles_events.bus import event_log
from miles_events.bus.codec import encode_event
from miles_events.bus.event_log import (
    FRAME_SIZE,
    HEADER_SIZE,
    MAGIC,
    EventLogWriter,
    LogReader,
    NotAnEventLogError,
    TornRecordError,
    read_events,
    scan_log,
)
from schemas.data import DataRef
from schemas.events import Event, RolloutGenerated, RolloutRequested, WeightsLoaded


def make_events(n: int) -> list[Event]:
    events: list[Event] = []
    for i in range(n):
        if i % 3 == 0:
            events.append(RolloutRequested(rollout_id=i, seq=i + 1, source="coordinator"))
        elif i % 3 == 1:
            events.append(
                RolloutGenerated(
                    rollout_id=i,
                    batch=DataRef("shm", f"batch-{i}", "generator"),
                    num_samples=8,
                    reward_mean=0.5,
                    weight_versions=[str(i)],
                    seq=i + 1,
                )
            )
        else:
            events.append(
                WeightsLoaded(
                    engine="engine-0",
                    weight_version=str(i),
                    previous_version=str(i - 1),
                    digest=f"{i:064x}",
                    num_tensors=30,
                    num_bytes=30 << 20,
                    checksums_manifest=f"checksums/{i:064x}.msgpack",
                    seq=i + 1,
                )
            )
    return events


def record_offsets(events: list[Event]) -> list[int]:
    """Where each record starts when ``events`` are written to a fresh log."""
    offsets, offset = [], HEADER_SIZE
    for event in events:
        offsets.append(offset)
        offset += FRAME_SIZE + len(encode_event(event))
    return offsets


def write_log(path: Path, events: list[Event]) -> None:
    with EventLogWriter(path) as writer:
        for event in events:
            writer.append(event)


def read_until_torn(path: Path) -> tuple[list[Event], TornRecordError]:
    got: list[Event] = []
    with pytest.raises(TornRecordError) as caught:
        for event in read_events(path):
            got.append(event)
    return got, caught.value


def test_written_events_read_back_identical(tmp_path: Path) -> None:
    events = make_events(50)
    write_log(tmp_path / "events.log", events)
    assert list(read_events(tmp_path / "events.log")) == events


def test_new_log_starts_with_the_magic(tmp_path: Path) -> None:
    write_log(tmp_path / "events.log", make_events(1))
    assert (tmp_path / "events.log").read_bytes()[:HEADER_SIZE] == MAGIC


def test_append_many_equals_appending_one_by_one(tmp_path: Path) -> None:
    events = make_events(10)
    write_log(tmp_path / "one.log", events)
    with EventLogWriter(tmp_path / "many.log") as writer:
        writer.append_many(events)
    assert (tmp_path / "one.log").read_bytes() == (tmp_path / "many.log").read_bytes()


def test_each_append_is_visible_to_readers_before_close(tmp_path: Path) -> None:
    events = make_events(3)
    writer = EventLogWriter(tmp_path / "events.log")
    try:
        writer.append(events[0])
        writer.append_many(events[1:])
        assert list(read_events(tmp_path / "events.log")) == events
    finally:
        writer.close()


def test_reader_reports_record_offsets(tmp_path: Path) -> None:
    events = make_events(7)
    write_log(tmp_path / "events.log", events)
    reader = LogReader(tmp_path / "events.log")
    assert [offset for offset, _ in reader.records()] == record_offsets(events)
    assert reader.end_offset == (tmp_path / "events.log").stat().st_size


def test_truncated_payload_is_torn_at_its_record_offset(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(20)
    write_log(path, events)
    offsets = record_offsets(events)
    data = path.read_bytes()
    path.write_bytes(data[: offsets[12] + FRAME_SIZE + 5])
    got, torn = read_until_torn(path)
    assert got == events[:12]
    assert torn.offset == offsets[12]
    assert "short payload" in torn.reason


def test_truncated_frame_header_is_torn_at_its_record_offset(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(5)
    write_log(path, events)
    offsets = record_offsets(events)
    path.write_bytes(path.read_bytes()[: offsets[3] + 3])
    got, torn = read_until_torn(path)
    assert got == events[:3]
    assert torn.offset == offsets[3]
    assert "short header" in torn.reason


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_torn_tail_is_found_at_any_read_chunk_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(event_log, "_READ_CHUNK", chunk)
    path = tmp_path / "events.log"
    events = make_events(8)
    write_log(path, events)
    offsets = record_offsets(events)
    path.write_bytes(path.read_bytes()[: offsets[7] + 3])
    got, torn = read_until_torn(path)
    assert got == events[:7]
    assert (torn.offset, torn.reason) == (offsets[7], "short header (3 of 8 bytes)")


def test_flipped_payload_byte_is_a_crc_error_at_that_record(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(10)
    write_log(path, events)
    offsets = record_offsets(events)
    data = bytearray(path.read_bytes())
    data[offsets[6] + FRAME_SIZE + 2] ^= 0x40
    path.write_bytes(bytes(data))
    got, torn = read_until_torn(path)
    assert got == events[:6]
    assert torn.offset == offsets[6]
    assert "CRC" in torn.reason


def test_valid_crc_over_undecodable_payload_is_torn(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    write_log(path, make_events(2))
    end = path.stat().st_size
    payload = b"\xc1"  # never valid msgpack
    with open(path, "ab") as file:
        file.write(struct.pack(">II", len(payload), zlib.crc32(payload)) + payload)
    got, torn = read_until_torn(path)
    assert len(got) == 2
    assert torn.offset == end
    assert "undecodable" in torn.reason


def test_torn_record_error_is_a_value_error_naming_the_offset() -> None:
    error = TornRecordError(123, "short header")
    assert isinstance(error, ValueError)
    assert "123" in str(error)


def test_file_without_magic_is_not_an_event_log(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a log\n")
    with pytest.raises(NotAnEventLogError):
        read_events(path)


def test_appending_to_an_existing_log_continues_it(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(9)
    write_log(path, events[:4])
    with EventLogWriter(path) as writer:
        assert writer.offset == path.stat().st_size
        writer.append_many(events[4:])
    assert list(read_events(path)) == events


def test_torn_log_is_refused_for_append_without_repair(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    write_log(path, make_events(4))
    data = path.read_bytes()[:-3]
    path.write_bytes(data)
    with pytest.raises(TornRecordError, match="repair=True"):
        EventLogWriter(path)
    assert path.read_bytes() == data


def test_repair_keeps_the_torn_tail_and_appends_after_the_last_complete_record(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(6)
    write_log(path, events[:4])
    offsets = record_offsets(events)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with EventLogWriter(path, repair=True) as writer:
        assert writer.torn_copy == tmp_path / f"events.log.torn-{offsets[3]}"
        writer.append_many(events[4:])
    assert (tmp_path / f"events.log.torn-{offsets[3]}").read_bytes() == data[offsets[3] : -3]
    assert list(read_events(path)) == events[:3] + events[4:]


def test_scan_log_reports_the_end_of_the_last_complete_record(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(3)
    write_log(path, events)
    offsets = record_offsets(events)
    path.write_bytes(path.read_bytes()[:-1])
    end, torn = scan_log(path)
    assert end == offsets[2]
    assert torn is not None and torn.offset == offsets[2]


def test_second_writer_on_the_same_log_is_refused(tmp_path: Path) -> None:
    with EventLogWriter(tmp_path / "events.log"), pytest.raises(RuntimeError, match="another writer"):
        EventLogWriter(tmp_path / "events.log")


def test_unencodable_event_leaves_the_log_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    with EventLogWriter(path) as writer:
        writer.append(make_events(1)[0])
        before = path.read_bytes()
        with pytest.raises(TypeError):
            writer.append_many([make_events(1)[0], object()])  # type: ignore[list-item]
    assert path.read_bytes() == before


def test_append_after_close_raises(tmp_path: Path) -> None:
    writer = EventLogWriter(tmp_path / "events.log")
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.append(make_events(1)[0])


def _fail_writes_to(monkeypatch: pytest.MonkeyPatch, fd: int, plan: list[int | OSError]) -> None:
    """Make ``os.write`` on ``fd`` follow ``plan``: write at most N bytes, or raise."""
    real_write = event_log.os.write

    def write(target: int, data: bytes) -> int:
        if target != fd or not plan:
            return real_write(target, data)
        step = plan.pop(0)
        if isinstance(step, OSError):
            raise step
        return real_write(target, bytes(data)[:step])

    monkeypatch.setattr(event_log.os, "write", write)


def test_a_short_write_is_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.log"
    events = make_events(6)
    with EventLogWriter(path) as writer:
        _fail_writes_to(monkeypatch, writer._fd, [5, 3])
        writer.append_many(events[:3])
        writer.append_many(events[3:])
    assert list(read_events(path)) == events


def test_an_append_failing_part_way_leaves_the_log_at_a_record_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "events.log"
    events = make_events(6)
    with EventLogWriter(path) as writer:
        writer.append_many(events[:2])
        before = path.read_bytes()
        _fail_writes_to(monkeypatch, writer._fd, [FRAME_SIZE + 3, OSError(28, "No space left on device")])
        with pytest.raises(OSError, match="No space"):
            writer.append_many(events[2:4])
        assert path.read_bytes() == before
        assert writer.offset == len(before)
        writer.append_many(events[4:])  # the disk has room again
    assert list(read_events(path)) == events[:2] + events[4:]
    assert scan_log(path) == (path.stat().st_size, None)


def test_an_append_failing_at_once_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.log"
    events = make_events(3)
    with EventLogWriter(path) as writer:
        writer.append(events[0])
        _fail_writes_to(monkeypatch, writer._fd, [OSError(28, "No space left on device")])
        with pytest.raises(OSError):
            writer.append(events[1])
        writer.append(events[2])
    assert list(read_events(path)) == [events[0], events[2]]


def test_a_partial_record_that_cannot_be_cut_off_stops_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "events.log"
    events = make_events(3)
    with EventLogWriter(path) as writer:
        writer.append(events[0])
        _fail_writes_to(monkeypatch, writer._fd, [4, OSError(5, "Input/output error")])

        def no_truncate(fd: int, length: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(event_log.os, "ftruncate", no_truncate)
        with pytest.raises(OSError):
            writer.append(events[1])
        with pytest.raises(ValueError, match="partial record"):
            writer.append(events[2])
    got, torn = read_until_torn(path)
    assert got == events[:1]
    assert torn.offset == record_offsets(events)[1]
