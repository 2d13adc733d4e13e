"""The event log: every event of a run, msgpack-framed and appended to one file.

File layout::

    b"MILESEV1"                                   8-byte magic and format version
    then per record:
        length   4 bytes, big-endian, of the payload
        crc32    4 bytes, big-endian, zlib.crc32 of the payload
        payload  one event as msgpack (``miles_events.bus.codec``)

A crash can leave the last record incomplete ("torn"). Readers yield every complete record
and then raise ``TornRecordError`` with the byte offset of the first bad one. The log is
never truncated silently: ``EventLogWriter`` refuses to append after a torn tail unless it
is opened with ``repair=True``, in which case the torn bytes are first copied to
``<log>.torn-<offset>`` and only then cut off.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
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
    that is still being appended to is read up to its size when a chunk runs out.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.end_offset = 0

    def records(self) -> Iterator[tuple[int, Event]]:
        """Every complete record in order; raises ``TornRecordError`` at the first bad one."""
        offset = self.end_offset = HEADER_SIZE
        for length, event in _records(_open_log(self.path), _sized_event):
            end = offset + FRAME_SIZE + length
            self.end_offset = end
            yield offset, event
            offset = end

    def __iter__(self) -> Iterator[Event]:
        for _, event in self.records():
            yield event


def _sized_event(payload: bytes) -> tuple[int, Event]:
    return len(payload), _decode(payload)


def read_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Every event of the log in order.

    Raises at once ``FileNotFoundError`` for a missing file and ``NotAnEventLogError``
    for a file without the magic (``TornRecordError`` for a header cut short). While
    iterating, raises ``TornRecordError`` (after yielding every complete record before
    it) at the first record that is short, fails its CRC or does not decode.
    """
    return _records(_open_log(Path(path)), _decode)


def scan_log(path: str | os.PathLike[str]) -> tuple[int, TornRecordError | None]:
    """The end offset of the last record with a valid frame and CRC, and the tear if any.

    Only framing and CRCs are checked (payloads are not decoded): a record from a newer
    writer with an event type this reader does not know is still a complete record.
    """
    end = HEADER_SIZE
    try:
        for length in _records(_open_log(Path(path)), len):
            end += FRAME_SIZE + length
    except TornRecordError as torn:
        return end, torn
    return end, None


def _records(file: BinaryIO, decode: Callable[[bytes], _T]) -> Iterator[_T]:
    """``decode(payload)`` of every complete record of ``file`` (positioned after the
    header; closed when done). Raises ``TornRecordError`` at the first record that is
    short, fails its CRC or does not decode (``DecodeError``).

    The file is read in large chunks, and everything per record is a few C calls in this
    one loop: the payload is sliced out of the chunk as ``bytes`` (for records of events'
    size that is cheaper than a ``memoryview`` slice, and faster to CRC and decode).
    """
    unpack_from = FRAME.unpack_from
    crc32 = zlib.crc32
    data = b""
    pos = 0
    base = HEADER_SIZE  # file offset of data[0]
    with file:
        while True:
            size = len(data)
            # The hot loop: every record completely inside the current chunk.
            while pos + FRAME_SIZE <= size:
                length, stored_crc = unpack_from(data, pos)
                start = pos + FRAME_SIZE
                end = start + length
                if end > size:
                    break
                payload = data[start:end]
                if crc32(payload) != stored_crc:
                    raise TornRecordError(
                        base + pos,
                        f"CRC mismatch (stored {stored_crc:#010x}, computed {crc32(payload):#010x})",
                    )
                try:
                    item = decode(payload)
                except DecodeError as error:
                    raise TornRecordError(base + pos, f"undecodable payload: {error}") from None
                yield item
                pos = end
            # Need more bytes: keep the partial record and read at least the rest of it.
            remaining = size - pos
            needed = FRAME_SIZE
            if remaining >= FRAME_SIZE:
                length, _ = unpack_from(data, pos)
                if length > MAX_RECORD_BYTES:
                    raise TornRecordError(base + pos, f"implausible record length {length}")
                needed = FRAME_SIZE + length
            file_left = max(os.fstat(file.fileno()).st_size - file.tell(), 0)
            chunk = b""
            if remaining + file_left >= needed:
                chunk = file.read(max(_READ_CHUNK, needed - remaining))
            if remaining + len(chunk) < needed:
                # Too few bytes left for the next record (or the file shrank under us).
                have = remaining + max(file_left, len(chunk))
                if have == 0:
                    return
                if have < FRAME_SIZE:
                    reason = f"short header ({have} of {FRAME_SIZE} bytes)"
                else:
                    reason = f"short payload ({have - FRAME_SIZE} of {needed - FRAME_SIZE} bytes)"
                raise TornRecordError(base + pos, reason)
            data = data[pos:] + chunk if remaining else chunk
            base += pos
            pos = 0


class EventLogWriter:
    """Appends events to a log; every ``append``/``append_many`` is one ``write`` system
    call, so what it appended is in the OS before it returns (a crash of the process
    loses nothing it appended).

    A new or empty file gets the header. An existing log is validated and appended to
    (resume). If its tail is torn, opening fails with ``TornRecordError`` unless
    ``repair=True``: then the bytes from the torn record on are copied to
    ``<log>.torn-<offset>`` (never overwriting an existing file) and the log is truncated
    to its last complete record. ``fsync=True`` also forces every append to stable
    storage. Only one writer may hold a log at a time (an advisory ``flock``).

    An append that fails part-way (a full disk) cuts its partial record off again before
    it raises, so the log still ends at a record boundary; if even that fails, the writer
    refuses further appends rather than write after a torn record.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False, repair: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.torn_copy: Path | None = None
        """Where a repaired torn tail was saved, if one was."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Open read-write without truncating; create if missing.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        file: BinaryIO = os.fdopen(fd, "r+b")
        self._file = file
        try:
            self._lock()
            self._offset = self._prepare(repair)
            file.flush()
        except BaseException:
            file.close()
            raise
        # From here on every byte goes straight to the file descriptor, unbuffered.
        self._file = file.detach()  # type: ignore[assignment]
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
        """Validate (or create) the header, handle a torn tail, return the append offset."""
        size = os.fstat(self._file.fileno()).st_size
        if size == 0:
            self._file.write(MAGIC)
            self._file.flush()
            return HEADER_SIZE
        try:
            end, torn = scan_log(self.path)
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
        """Copy bytes ``end..size`` aside (exclusively created), then truncate to ``end``."""
        copy_path = self.path.with_name(f"{self.path.name}.torn-{end}")
        self._file.seek(end)
        tail = self._file.read(size - end)
        with open(copy_path, "xb") as copy:
            copy.write(tail)
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
