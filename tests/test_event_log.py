"""The event log: framing, torn-tail detection, resynchronisation after damage in the
middle, resume and repair."""

from __future__ import annotations

import random
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
    DamagedRange,
    EventLogWriter,
    LogReader,
    NotAnEventLogError,
    TornRecordError,
    read_events,
    scan_log,
)
from schemas.data import DataRef
from schemas.events import Event, RolloutGenerated, RolloutRequested, WeightsLoaded
from tests.support import flip_byte


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


def read_until_torn(path: Path, on_damage=None) -> tuple[list[Event], TornRecordError]:
    got: list[Event] = []
    with pytest.raises(TornRecordError) as caught:
        for event in read_events(path, on_damage=on_damage):
            got.append(event)
    return got, caught.value


def read_resyncing(path: Path) -> tuple[list[Event], list[DamagedRange]]:
    damaged: list[DamagedRange] = []
    return list(read_events(path, on_damage=damaged.append)), damaged


def frame(payload: bytes) -> bytes:
    return struct.pack(">II", len(payload), zlib.crc32(payload)) + payload


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
        file.write(frame(payload))
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
        assert writer.damaged == []
        writer.append_many(events[4:])
    # The side file is an event log of its own: the header, then the torn bytes.
    assert (tmp_path / f"events.log.torn-{offsets[3]}").read_bytes() == MAGIC + data[offsets[3] : -3]
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


# Damage in the middle: readers given ``on_damage`` resynchronise on the next valid frame.

MANY = 300
DAMAGED = 150


@pytest.fixture
def big_log(tmp_path: Path) -> tuple[Path, list[Event], list[int]]:
    """A log of a few hundred events written by the writer, and each record's offset."""
    path = tmp_path / "events.log"
    events = make_events(MANY)
    with EventLogWriter(path) as writer:
        for start in range(0, MANY, 37):
            writer.append_many(events[start : start + 37])
    offsets = record_offsets(events)
    assert offsets[-1] + FRAME_SIZE + len(encode_event(events[-1])) == path.stat().st_size
    return path, events, offsets


@pytest.mark.parametrize(
    ("where", "mask", "reason"),
    [
        (0, 0x40, "implausible record length"),  # the length's high byte: above MAX_RECORD_BYTES
        (1, 0x01, "short payload"),  # a length reaching past the end of the file
        (3, 0x40, "CRC mismatch"),  # the length's low byte
        (6, 0x40, "CRC mismatch"),  # the stored CRC
        (FRAME_SIZE, 0x40, "undecodable payload"),  # the payload's map header, with a CRC to match
        (FRAME_SIZE + 2, 0x40, "CRC mismatch"),
        (-1, 0x01, "CRC mismatch"),  # the payload's last byte
    ],
)
def test_a_flipped_byte_in_the_middle_costs_only_its_record(
    big_log: tuple[Path, list[Event], list[int]], where: int, mask: int, reason: str
) -> None:
    path, events, offsets = big_log
    start, end = offsets[DAMAGED], offsets[DAMAGED + 1]
    flip_byte(path, start + where if where >= 0 else end + where, mask)
    if where == FRAME_SIZE:  # make the CRC match the changed payload: only msgpack is wrong
        data = bytearray(path.read_bytes())
        data[start + 4 : start + FRAME_SIZE] = struct.pack(">I", zlib.crc32(data[start + FRAME_SIZE : end]))
        path.write_bytes(bytes(data))
    got, damaged = read_resyncing(path)
    assert got == events[:DAMAGED] + events[DAMAGED + 1 :]
    assert [(d.start, d.end) for d in damaged] == [(start, end)]
    assert damaged[0].reason.startswith(reason)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("window", [1, 9, 100])
def test_resynchronising_works_at_any_read_chunk_and_scan_window(
    big_log: tuple[Path, list[Event], list[int]], monkeypatch: pytest.MonkeyPatch, chunk: int, window: int
) -> None:
    monkeypatch.setattr(event_log, "_READ_CHUNK", chunk)
    monkeypatch.setattr(event_log, "_SCAN_WINDOW", window)
    path, events, offsets = big_log
    flip_byte(path, offsets[DAMAGED] + FRAME_SIZE + 5)
    got, damaged = read_resyncing(path)
    assert got == events[:DAMAGED] + events[DAMAGED + 1 :]
    assert [(d.start, d.end) for d in damaged] == [(offsets[DAMAGED], offsets[DAMAGED + 1])]


def test_each_damaged_range_is_reported_once_and_adjacent_records_make_one_range(
    big_log: tuple[Path, list[Event], list[int]],
) -> None:
    path, events, offsets = big_log
    for index in (10, 11, 12, 200):
        flip_byte(path, offsets[index] + FRAME_SIZE + 1)
    got, damaged = read_resyncing(path)
    assert got == events[:10] + events[13:200] + events[201:]
    assert [(d.start, d.end) for d in damaged] == [(offsets[10], offsets[13]), (offsets[200], offsets[201])]


@pytest.mark.parametrize("fill", ["random", "zeros"])
def test_a_lost_sector_in_the_middle_costs_the_records_it_touches(
    big_log: tuple[Path, list[Event], list[int]], fill: str
) -> None:
    path, events, offsets = big_log
    lost_from, lost_to = offsets[100] + 20, offsets[100] + 20 + 4096
    data = bytearray(path.read_bytes())
    data[lost_from:lost_to] = random.Random(7).randbytes(4096) if fill == "random" else bytes(4096)
    path.write_bytes(bytes(data))
    first_whole = next(i for i, offset in enumerate(offsets) if offset >= lost_to)
    got, damaged = read_resyncing(path)
    assert got == events[:100] + events[first_whole:]
    assert [(d.start, d.end) for d in damaged] == [(offsets[100], offsets[first_whole])]


def test_a_valid_crc_over_undecodable_msgpack_in_the_middle_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(6)
    offsets = record_offsets(events)
    good = [frame(encode_event(e)) for e in events]
    not_an_event = frame(b"\x81\xa4type\xa9NoSuchOne")  # decodable msgpack, but no event
    not_msgpack = frame(b"\xc1\xc1\xc1")
    path.write_bytes(
        MAGIC + b"".join(good[:2]) + not_an_event + b"".join(good[2:4]) + not_msgpack + b"".join(good[4:])
    )
    got, damaged = read_resyncing(path)
    assert got == events
    first = offsets[2]
    second = offsets[4] + len(not_an_event)
    assert [(d.start, d.end) for d in damaged] == [
        (first, first + len(not_an_event)),
        (second, second + len(not_msgpack)),
    ]
    assert all(d.reason.startswith("undecodable payload") for d in damaged)
    with pytest.raises(TornRecordError, match="undecodable"):  # strict: the first one stops the reader
        list(read_events(path))


def test_damage_with_nothing_valid_after_it_is_a_torn_tail(
    big_log: tuple[Path, list[Event], list[int]],
) -> None:
    path, events, offsets = big_log
    flip_byte(path, offsets[-1] + FRAME_SIZE + 1)  # the last record
    flip_byte(path, offsets[DAMAGED] + FRAME_SIZE + 1)  # and one in the middle
    damaged: list[DamagedRange] = []
    got, torn = read_until_torn(path, on_damage=damaged.append)
    assert got == events[:DAMAGED] + events[DAMAGED + 1 : -1]
    assert [(d.start, d.end) for d in damaged] == [(offsets[DAMAGED], offsets[DAMAGED + 1])]
    assert torn.offset == offsets[-1]
    assert "CRC" in torn.reason


def test_a_truncated_record_is_still_a_torn_tail_when_resynchronising(
    big_log: tuple[Path, list[Event], list[int]],
) -> None:
    path, events, offsets = big_log
    path.write_bytes(path.read_bytes()[: offsets[-1] + FRAME_SIZE + 4])
    damaged: list[DamagedRange] = []
    got, torn = read_until_torn(path, on_damage=damaged.append)
    assert got == events[:-1] and damaged == []
    assert torn.offset == offsets[-1] and "short payload" in torn.reason


def test_a_zero_filled_tail_is_a_torn_tail(big_log: tuple[Path, list[Event], list[int]]) -> None:
    path, events, _ = big_log
    size = path.stat().st_size
    with open(path, "ab") as file:
        file.write(bytes(4 << 20))  # what a filesystem can leave after a crash
    damaged: list[DamagedRange] = []
    got, torn = read_until_torn(path, on_damage=damaged.append)
    assert got == events and damaged == []
    assert torn.offset == size


def test_the_reader_reports_offsets_after_a_damaged_range(
    big_log: tuple[Path, list[Event], list[int]],
) -> None:
    path, events, offsets = big_log
    flip_byte(path, offsets[DAMAGED] + FRAME_SIZE + 3)
    damaged: list[DamagedRange] = []
    reader = LogReader(path, on_damage=damaged.append)
    records = list(reader.records())
    assert [offset for offset, _ in records] == offsets[:DAMAGED] + offsets[DAMAGED + 1 :]
    assert [event for _, event in records] == events[:DAMAGED] + events[DAMAGED + 1 :]
    assert reader.end_offset == path.stat().st_size
    assert damaged == [DamagedRange(offsets[DAMAGED], offsets[DAMAGED + 1], damaged[0].reason)]
    assert str(damaged[0]).startswith(
        f"bytes {offsets[DAMAGED]}..{offsets[DAMAGED + 1]} damaged: CRC mismatch"
    )


def test_scan_log_resynchronises_when_asked(big_log: tuple[Path, list[Event], list[int]]) -> None:
    path, _, offsets = big_log
    flip_byte(path, offsets[DAMAGED] + FRAME_SIZE + 3)
    end, torn = scan_log(path)  # strict: stops at the damage
    assert (end, torn is not None and torn.offset) == (offsets[DAMAGED], offsets[DAMAGED])
    damaged: list[DamagedRange] = []
    assert scan_log(path, on_damage=damaged.append) == (path.stat().st_size, None)
    assert [(d.start, d.end) for d in damaged] == [(offsets[DAMAGED], offsets[DAMAGED + 1])]


@pytest.mark.parametrize("repair", [False, True])
def test_the_writer_keeps_the_records_after_damage_in_the_middle_and_appends_after_them(
    big_log: tuple[Path, list[Event], list[int]], repair: bool
) -> None:
    path, events, offsets = big_log
    flip_byte(path, offsets[DAMAGED] + FRAME_SIZE + 3)
    before = path.read_bytes()
    more = make_events(MANY + 3)[MANY:]
    with EventLogWriter(path, repair=repair) as writer:
        assert writer.torn_copy is None
        assert [(d.start, d.end) for d in writer.damaged] == [(offsets[DAMAGED], offsets[DAMAGED + 1])]
        assert writer.offset == len(before)
        writer.append_many(more)
    assert path.read_bytes()[: len(before)] == before
    assert list(path.parent.iterdir()) == [path]  # no side file
    got, damaged = read_resyncing(path)
    assert got == events[:DAMAGED] + events[DAMAGED + 1 :] + more
    assert len(damaged) == 1


def test_repair_cuts_only_the_torn_tail_after_damage_in_the_middle(
    big_log: tuple[Path, list[Event], list[int]],
) -> None:
    path, events, offsets = big_log
    flip_byte(path, offsets[DAMAGED] + FRAME_SIZE + 3)
    data = path.read_bytes()[:-3]
    path.write_bytes(data)
    with pytest.raises(TornRecordError, match="repair=True"):
        EventLogWriter(path)
    with EventLogWriter(path, repair=True) as writer:
        assert writer.torn_copy == path.with_name(f"events.log.torn-{offsets[-1]}")
        assert [(d.start, d.end) for d in writer.damaged] == [(offsets[DAMAGED], offsets[DAMAGED + 1])]
        writer.append(events[-1])
    assert path.read_bytes()[: offsets[-1]] == data[: offsets[-1]]
    got, _ = read_resyncing(path)
    assert got == events[:DAMAGED] + events[DAMAGED + 1 :]
    assert writer.torn_copy.read_bytes() == MAGIC + data[offsets[-1] :]


def test_the_torn_tail_side_file_reads_as_an_event_log(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    events = make_events(5)
    write_log(path, events)
    path.write_bytes(path.read_bytes()[:-3])
    with EventLogWriter(path, repair=True) as writer:
        side = writer.torn_copy
    assert side is not None
    damaged: list[DamagedRange] = []
    got, torn = read_until_torn(side, on_damage=damaged.append)  # not NotAnEventLogError
    assert got == [] and damaged == []
    assert torn.offset == HEADER_SIZE and "short payload" in torn.reason


def test_a_torn_header_is_repaired_and_kept_beside_the_log(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    path.write_bytes(MAGIC[:5])
    with EventLogWriter(path, repair=True) as writer:
        assert writer.torn_copy == tmp_path / "events.log.torn-0"
        writer.append(make_events(1)[0])
    assert list(read_events(path)) == make_events(1)
    assert (tmp_path / "events.log.torn-0").read_bytes() == MAGIC + MAGIC[:5]


@pytest.mark.parametrize("zeros", [4096, 4099])
def test_repair_cuts_a_zero_filled_tail(tmp_path: Path, zeros: int) -> None:
    path = tmp_path / "events.log"
    events = make_events(5)
    write_log(path, events[:4])
    size = path.stat().st_size
    with open(path, "ab") as file:
        file.write(bytes(zeros))  # eight zero bytes are a frame whose CRC matches: still no record
    with EventLogWriter(path, repair=True) as writer:
        assert writer.torn_copy == tmp_path / f"events.log.torn-{size}"
        writer.append(events[4])
    assert list(read_events(path)) == events
    assert writer.torn_copy.read_bytes() == MAGIC + bytes(zeros)
