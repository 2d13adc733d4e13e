"""The event log: every event of a run, msgpack-framed and appended to one file.

File layout::

    b"MILESEV1"                                   8-byte magic and format version
    then per record:
        length   4 bytes, big-endian, of the payload
        crc32    4 bytes, big-endian, zlib.crc32 of the payload
        payload  one event as msgpack (``miles_events.bus.codec``)

A crash can leave the last record incomplete ("torn"); a bad disk or a stray write can
damage bytes anywhere. Readers are strict by default: they yield every complete record and
then raise ``TornRecordError`` with the byte offset of the first bad one. Given an
``on_damage`` callback they resynchronise instead: from a bad record they scan forward, byte
by byte, for the next valid frame (a sane length that fits in the file, a matching CRC, a
payload that decodes as an event), pass the skipped ``DamagedRange`` to the callback and
read on from there. Only damage with no valid frame after it, up to the end of the file, is
a torn tail; it still raises ``TornRecordError``.

The log is never truncated silently: ``EventLogWriter`` refuses to append after a torn tail
unless it is opened with ``repair=True``, in which case the torn bytes are first copied to
``<log>.torn-<offset>`` (behind the magic, so that the copy is an event log too) and only
then cut off. Damage in the middle is left as it is: the records after it stay in the log.
"""

from __future__ import annotations

import errno
import io
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from miles_events.bus.codec import EVENT_ENCODER, DecodeError, decode_logged_event
from schemas.events import Event

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None  # type: ignore[assignment]

MAGIC = b"MILESEV1"
HEADER_SIZE = len(MAGIC)
FRAME = struct.Struct(">II")
FRAME_SIZE = FRAME.size
MAX_RECORD_BYTES = 1 << 30
"""A length field above this is corruption, not an event (events are small)."""
_READ_CHUNK = 1 << 22
_SCAN_WINDOW = 1 << 20
"""How many candidate offsets resynchronising examines per read."""
# Where a frame can start, so that resynchronising skips every other offset at C speed
# (``_valid_frame`` decides about the rest): a length field of 1 to MAX_RECORD_BYTES (an
# empty payload is no event), any CRC, then what every event starts with: a msgpack map
# (fixmap, map16, map32; ``codec.encode_event``) with a string key. The map's first byte is
# searched for, the whole pattern matched only there.
_MAP_BYTE = re.compile(rb"[\x81-\x8f\xde\xdf]")
_LENGTH_FIELD = rb"(?:[\x01-%b][\x00-\xff]{3}|\x00(?!\x00\x00\x00)[\x00-\xff]{3})" % re.escape(
    bytes([MAX_RECORD_BYTES >> 24])
)
_MAP_WITH_STRING_KEY = rb"(?:[\x81-\x8f]|\xde[\x00-\xff]{2}|\xdf[\x00-\xff]{4})[\xa0-\xbf\xd9-\xdb]"
_FRAME_START = re.compile(_LENGTH_FIELD + rb"[\x00-\xff]{4}" + _MAP_WITH_STRING_KEY)
_FRAME_START_BYTES = FRAME_SIZE + 6
"""The most bytes ``_FRAME_START`` looks at."""

_T = TypeVar("_T")
_decode = decode_logged_event
_encode = EVENT_ENCODER.encode
_pack_frame = FRAME.pack
_crc32 = zlib.crc32


class TornRecordError(ValueError):
    """The record at byte ``offset`` is incomplete or corrupt; ``reason`` says how."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"torn record at byte {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class NotAnEventLogError(ValueError):
    """The file does not start with the event-log magic."""


@dataclass(frozen=True, slots=True)
class DamagedRange:
    """Bytes ``start`` up to (not including) ``end`` of a log hold no readable record, and a
    valid record starts at ``end``: damage in the middle, which a resynchronising reader
    skipped. ``reason`` says what was wrong with the record that claimed to start at
    ``start``."""

    start: int
    end: int
    reason: str

    def __str__(self) -> str:
        return f"bytes {self.start}..{self.end} damaged: {self.reason}"


OnDamage = Callable[[DamagedRange], object]
"""Told of each damaged range as a reader skips it (before the record after it is read)."""


def _check_magic(head: bytes, path: Path) -> None:
    """Raise unless ``head`` (the first bytes of the file) is a complete, known header."""
    if len(head) >= HEADER_SIZE:
        if head[:HEADER_SIZE] != MAGIC:
            raise NotAnEventLogError(
                f"{path}: not a miles-events event log (starts with {head[:HEADER_SIZE]!r}, "
                f"expected {MAGIC!r})"
            )
        return
    if MAGIC.startswith(head):
        # A crash between creating the file and writing the header.
        raise TornRecordError(0, f"incomplete file header ({len(head)} of {HEADER_SIZE} bytes)")
    raise NotAnEventLogError(f"{path}: not a miles-events event log (too short and no magic)")


def _open_log(path: Path) -> BinaryIO:
    """The log opened for reading, positioned after its validated header."""
    file = open(path, "rb")
    try:
        _check_magic(file.read(HEADER_SIZE), path)
    except BaseException:
        file.close()
        raise
    return file


class LogReader:
    """Reads a log record by record, exposing each record's byte offset.

    ``records()`` yields ``(offset, event)``; ``end_offset`` is where the last complete
    record ended (after iteration stopped, normally or with ``TornRecordError``). A file
    that is still being appended to is read up to its size when a chunk runs out. Without
    ``on_damage`` the reader is strict; with it, it resynchronises after damage (see the
    module's docstring).
    """

    def __init__(self, path: str | os.PathLike[str], *, on_damage: OnDamage | None = None) -> None:
        self.path = Path(path)
        self.on_damage = on_damage
        self.end_offset = 0

    def records(self) -> Iterator[tuple[int, Event]]:
        """Every readable record in order; raises ``TornRecordError`` at the first bad one
        (strict) or at a torn tail (resynchronising)."""
        offset = self.end_offset = HEADER_SIZE
        on_damage = self.on_damage

        def skipped(damage: DamagedRange) -> None:
            nonlocal offset
            offset = damage.end
            if on_damage is not None:  # always: ``skipped`` is passed only with one
                on_damage(damage)

        for length, event in _records(
            _open_log(self.path), _sized_event, None if on_damage is None else skipped
        ):
            end = offset + FRAME_SIZE + length
            self.end_offset = end
            yield offset, event
            offset = end

    def __iter__(self) -> Iterator[Event]:
        for _, event in self.records():
            yield event


def _sized_event(payload: bytes) -> tuple[int, Event]:
    return len(payload), _decode(payload)


def read_events(path: str | os.PathLike[str], *, on_damage: OnDamage | None = None) -> Iterator[Event]:
    """Every event of the log in order.

    Raises at once ``FileNotFoundError`` for a missing file and ``NotAnEventLogError``
    for a file without the magic (``TornRecordError`` for a header cut short). While
    iterating, raises ``TornRecordError`` (after yielding every complete record before
    it) at the first record that is short, fails its CRC, is empty or does not decode. With
    ``on_damage``, such a record in the middle is skipped instead: reading resumes at the
    next valid frame and the skipped bytes go to ``on_damage``; only a torn tail raises.
    """
    return _records(_open_log(Path(path)), _decode, on_damage)


def scan_log(
    path: str | os.PathLike[str], *, on_damage: OnDamage | None = None
) -> tuple[int, TornRecordError | None]:
    """The end offset of the last record with a valid frame and CRC, and the tear if any.

    Only framing and CRCs are checked (payloads are not decoded): a record from a newer
    writer with an event type this reader does not know is still a complete record. With
    ``on_damage`` the scan resynchronises after damage in the middle (the frame it resumes
    at must decode as an event) and the tear is a torn tail only. A missing file, a file
    without the magic or a header cut short raise as for ``read_events``.
    """
    file = _open_log(Path(path))
    end = HEADER_SIZE

    def skipped(damage: DamagedRange) -> None:
        nonlocal end
        end = damage.end
        if on_damage is not None:  # always: ``skipped`` is passed only with one
            on_damage(damage)

    try:
        for length in _records(file, len, None if on_damage is None else skipped):
            end += FRAME_SIZE + length
    except TornRecordError as torn:
        return end, torn
    return end, None


def _records(file: BinaryIO, decode: Callable[[bytes], _T], on_damage: OnDamage | None) -> Iterator[_T]:
    """``decode(payload)`` of every complete record of ``file`` (positioned after the
    header; closed when done). At a record that is short, fails its CRC or does not decode
    (``DecodeError``) or is empty: raises ``TornRecordError`` without ``on_damage``, else
    ``_resync``.

    The file is read in large chunks, and everything per record is a few C calls in this
    one loop: the payload is sliced out of the chunk as ``bytes`` (for records of events'
    size that is cheaper than a ``memoryview`` slice, and faster to CRC and decode). Bad
    records leave the loop; only they cost a scan.
    """
    unpack_from = FRAME.unpack_from
    crc32 = zlib.crc32
    data = b""
    pos = 0
    base = HEADER_SIZE  # file offset of data[0]
    with file:
        while True:
            size = len(data)
            bad = ""  # why the record at data[pos] is bad, once one is
            # The hot loop: every record completely inside the current chunk.
            while pos + FRAME_SIZE <= size:
                length, stored_crc = unpack_from(data, pos)
                start = pos + FRAME_SIZE
                end = start + length
                if end > size:
                    break
                payload = data[start:end]
                if crc32(payload) != stored_crc or not length:
                    # No event is empty: eight zero bytes are not a record, though their CRC matches.
                    bad = (
                        f"CRC mismatch (stored {stored_crc:#010x}, computed {crc32(payload):#010x})"
                        if length
                        else "empty payload"
                    )
                    break
                try:
                    item = decode(payload)
                except DecodeError as error:
                    bad = f"undecodable payload: {error}"
                    break
                yield item
                pos = end
            if not bad:
                # Need more bytes: keep the partial record and read at least the rest of it.
                remaining = size - pos
                needed = FRAME_SIZE
                if remaining >= FRAME_SIZE:
                    length, _ = unpack_from(data, pos)
                    needed = FRAME_SIZE + length
                    if length > MAX_RECORD_BYTES:
                        bad = f"implausible record length {length}"
                if not bad:
                    file_left = max(os.fstat(file.fileno()).st_size - file.tell(), 0)
                    chunk = b""
                    if remaining + file_left >= needed:
                        chunk = file.read(max(_READ_CHUNK, needed - remaining))
                    if remaining + len(chunk) >= needed:
                        data = data[pos:] + chunk if remaining else chunk
                        base += pos
                        pos = 0
                        continue
                    # Too few bytes left for the next record (or the file shrank under us).
                    have = remaining + max(file_left, len(chunk))
                    if have == 0:
                        return
                    if have < FRAME_SIZE:
                        bad = f"short header ({have} of {FRAME_SIZE} bytes)"
                    else:
                        bad = f"short payload ({have - FRAME_SIZE} of {needed - FRAME_SIZE} bytes)"
            base = _resync(file, base + pos, bad, on_damage)
            data = b""
            pos = 0


def _resync(file: BinaryIO, offset: int, reason: str, on_damage: OnDamage | None) -> int:
    """Where reading resumes after the bad record at ``offset``: the next valid frame, with
    ``file`` positioned there and the skipped range reported to ``on_damage``. Raises
    ``TornRecordError`` when strict (no ``on_damage``) or when no valid frame follows."""
    if on_damage is not None:
        resume = _next_frame(file, offset, os.fstat(file.fileno()).st_size)
        if resume is not None:
            file.seek(resume)
            on_damage(DamagedRange(offset, resume, reason))
            return resume
    raise TornRecordError(offset, reason)


def _next_frame(file: BinaryIO, after: int, size: int) -> int | None:
    """The offset of the first valid frame (``_valid_frame``) after byte ``after`` and
    before ``size``, or None. Moves the file position."""
    unpack_from = FRAME.unpack_from
    match_frame_start = _FRAME_START.match
    first = after + 1  # file offset of window[0]
    while first + FRAME_SIZE < size:  # a frame needs its header and one payload byte
        file.seek(first)
        # A window overlaps the next, so that every candidate in it can be matched whole.
        window = file.read(_SCAN_WINDOW + _FRAME_START_BYTES)
        for map_byte in _MAP_BYTE.finditer(window, FRAME_SIZE):
            at = map_byte.start() - FRAME_SIZE
            if at >= _SCAN_WINDOW:
                break
            if not match_frame_start(window, at):
                continue
            length, stored_crc = unpack_from(window, at)
            offset = first + at
            if length > MAX_RECORD_BYTES or offset + FRAME_SIZE + length > size:
                continue
            start = at + FRAME_SIZE
            if start + length <= len(window):
                payload = window[start : start + length]
            else:
                file.seek(offset + FRAME_SIZE)
                payload = file.read(length)
            if _valid_frame(payload, stored_crc):
                return offset
        first += _SCAN_WINDOW
    return None


def _valid_frame(payload: bytes, stored_crc: int) -> bool:
    """Whether a record of ``payload`` with ``stored_crc`` is one to resume at: its CRC
    matches and it decodes as an event."""
    if _crc32(payload) != stored_crc:
        return False
    try:
        _decode(payload)
    except DecodeError:
        return False
    return True


def check_appendable(path: str | os.PathLike[str]) -> None:
    """What ``EventLogWriter(path, repair=True)`` would refuse, asked without writing: an
    existing file that is not an event log (``NotAnEventLogError``), one this process may not
    read and write (``PermissionError``), or one another writer holds (``RuntimeError``). A
    missing file is fine (the writer creates it)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_file():
        raise NotAnEventLogError(f"{path}: not a regular file")
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(errno.EACCES, "the event log is not readable and writable", str(path))
    with open(path, "rb") as file:
        head = file.read(HEADER_SIZE)
        if head:
            try:
                _check_magic(head, path)
            except TornRecordError:
                pass  # a header cut short by a crash: the writer repairs it
        if fcntl is not None:
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"{path}: event log is already open by another writer") from None


class EventLogWriter:
    """Appends events to a log; every ``append``/``append_many`` is one ``write`` system
    call, so what it appended is in the OS before it returns (a crash of the process
    loses nothing it appended).

    A new or empty file gets the header. An existing log is validated and appended to
    (resume). Damage in its middle (valid records after it) is left as it is and listed in
    ``damaged``; the records after it stay, and appends go after the last one. If its tail
    is torn (no valid record after the damage), opening fails with ``TornRecordError``
    unless ``repair=True``: then the bytes from the torn record on are copied, behind the
    magic, to ``<log>.torn-<offset>`` (never overwriting an existing file; replay reads it
    as a log that is torn at its first record) and the log is truncated to its last
    complete record. ``fsync=True`` also forces every append to stable storage. Only one
    writer may hold a log at a time (an advisory ``flock``).

    An append that fails part-way (a full disk) cuts its partial record off again before
    it raises, so the log still ends at a record boundary; if even that fails, the writer
    refuses further appends rather than write after a torn record.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False, repair: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.torn_copy: Path | None = None
        """Where a repaired torn tail was saved, if one was."""
        self.damaged: list[DamagedRange] = []
        """The damaged ranges in the middle of the log when it was opened (left as they are)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Open read-write without truncating; create if missing.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        file = os.fdopen(fd, "r+b")
        self._file: io.BufferedRandom | io.RawIOBase = file
        try:
            self._lock()
            self._offset = self._prepare(repair)
            file.flush()
        except BaseException:
            file.close()
            raise
        # From here on every byte goes straight to the file descriptor, unbuffered.
        self._file = file.detach()
        os.lseek(fd, self._offset, os.SEEK_SET)
        self._fd = fd
        self._broken: str | None = None

    @property
    def offset(self) -> int:
        """The file offset where the next record will start."""
        return self._offset

    @property
    def closed(self) -> bool:
        return self._file.closed

    def _lock(self) -> None:
        if fcntl is None:
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{self.path}: event log is already open by another writer") from None

    def _prepare(self, repair: bool) -> int:
        """Validate (or create) the header, list damage in the middle, handle a torn tail,
        return the append offset."""
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            self._file.write(MAGIC)
            self._file.flush()
            return HEADER_SIZE
        try:
            end, torn = scan_log(self.path, on_damage=self.damaged.append)
        except TornRecordError as header_torn:
            end, torn = 0, header_torn
        if torn is not None:
            if not repair:
                raise TornRecordError(
                    torn.offset,
                    f"{torn.reason}; {self.path} has a torn tail, refusing to append "
                    f"(open with repair=True to move bytes {torn.offset}..{size} to "
                    f"{self.path}.torn-{torn.offset} and truncate)",
                )
            self._repair(end, size)
            if end == 0:
                self._file.write(MAGIC)
                end = HEADER_SIZE
        self._file.seek(end)
        return end

    def _repair(self, end: int, size: int) -> None:
        """Copy bytes ``end..size`` aside behind the magic (exclusively created), then
        truncate to ``end``."""
        copy_path = self.path.with_name(f"{self.path.name}.torn-{end}")
        self._file.seek(end)
        tail = self._file.read(size - end)
        with open(copy_path, "xb") as copy:
            copy.write(MAGIC + tail)
            copy.flush()
            os.fsync(copy.fileno())
        self.torn_copy = copy_path
        self._file.truncate(end)
        self._file.seek(end)
        os.fsync(self._file.fileno())

    def append(self, event: Event) -> int:
        """Append one event with one ``write``; returns the record's offset."""
        payload = _encode(event)
        return self._write(_pack_frame(len(payload), _crc32(payload)) + payload)

    def append_many(self, events: Iterable[Event]) -> int:
        """Append events with one ``write``; returns the first record's offset.

        The records are exactly those ``append`` writes one by one. Every event is encoded
        before anything is written, so an unencodable event leaves the log unchanged.
        """
        parts: list[bytes] = []
        add = parts.append
        for payload in list(map(_encode, events)):
            add(_pack_frame(len(payload), _crc32(payload)))
            add(payload)
        if not parts:
            return self._offset
        return self._write(b"".join(parts))

    def _write(self, data: bytes) -> int:
        if self._broken is not None or self._file.closed:
            raise ValueError(f"{self.path}: event log writer is {self._broken or 'closed'}")
        offset = self._offset
        written = os.write(self._fd, data)  # nothing is written when this raises
        if written != len(data):
            self._write_rest(data, written)
        self._offset = offset + len(data)
        if self.fsync:
            os.fsync(self._fd)
        return offset

    def _write_rest(self, data: bytes, written: int) -> None:
        """Finish a short write; if that fails, cut the partial record off and raise."""
        view = memoryview(data)
        try:
            while written < len(data):
                count = os.write(self._fd, view[written:])
                if count == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += count
        except BaseException:
            try:
                os.ftruncate(self._fd, self._offset)
                os.lseek(self._fd, self._offset, os.SEEK_SET)
            except OSError as error:
                self._broken = (
                    f"broken: a failed append left a partial record at byte {self._offset} "
                    f"that could not be cut off ({error})"
                )
            raise

    def flush(self) -> None:
        """Force appends to disk when ``fsync`` (they are already in the OS)."""
        if not self._file.closed and self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Flush and close; closing twice is harmless."""
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
