"""The wire codec: every event as msgpack (bus, event log) or JSON (humans, tools).

One encoder and one decoder typed with the ``AnyEvent`` tagged union serve the whole
process; the tag is the event's class name under ``"type"``. Decoding is tolerant of
unknown fields (msgspec ignores them unless a Struct forbids them, and events do not), so
a reader older than the writer still decodes what it knows, and a reader newer than the
writer fills fields added later with their defaults.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from schemas.events import AnyEvent, Event, TrainMetrics, TrainStepFinished

DecodeError = msgspec.DecodeError
"""Raised by every decode function for bytes that are not a valid event (or batch)."""

EVENT_ENCODER = msgspec.msgpack.Encoder()
"""The process's msgpack encoder (``encode_event`` is its ``encode``)."""
EVENT_DECODER: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(AnyEvent)
"""The process's decoder typed with ``AnyEvent`` (``decode_event`` is its ``decode``); hot
loops call its bound method directly."""
_batch_decoder: msgspec.msgpack.Decoder[list[Event]] = msgspec.msgpack.Decoder(list[AnyEvent])
_json_encoder = msgspec.json.Encoder()
_json_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(AnyEvent)


def encode_event(event: Event) -> bytes:
    """The event as one msgpack map (the tag under ``"type"``)."""
    return EVENT_ENCODER.encode(event)


def decode_event(data: bytes | bytearray | memoryview) -> Event:
    """One event from its msgpack bytes; raises ``DecodeError`` (or its ``ValidationError``)."""
    return EVENT_DECODER.decode(data)


_NO_METRICS = TrainMetrics()
_METRIC_FIELDS = TrainMetrics.__struct_fields__


def decode_logged_event(data: bytes | bytearray | memoryview) -> Event:
    """``decode_event`` for records of a log, which may predate a change of shape: a
    ``TrainStepFinished`` recorded with the backend's metrics as fields of its own (before
    they became one ``metrics`` record) gets them back under ``metrics``."""
    event = EVENT_DECODER.decode(data)
    if type(event) is TrainStepFinished and event.metrics == _NO_METRICS:
        recorded = msgspec.msgpack.decode(data)
        legacy = {name: recorded[name] for name in _METRIC_FIELDS if name in recorded}
        if legacy:
            event = msgspec.structs.replace(event, metrics=msgspec.convert(legacy, TrainMetrics))
    return event


def encode_batch(events: Iterable[Event]) -> bytes:
    """Several events as one msgpack array: one message for a cross-process delivery."""
    if not isinstance(events, list | tuple):
        events = list(events)
    return EVENT_ENCODER.encode(events)


def decode_batch(data: bytes | bytearray | memoryview) -> list[Event]:
    """The events of ``encode_batch``, in order."""
    return _batch_decoder.decode(data)


def event_to_json(event: Event) -> dict[str, Any]:
    """The event as JSON-compatible builtins, its type name under ``"type"`` first."""
    builtins: dict[str, Any] = msgspec.to_builtins(event)
    return builtins


def event_to_json_bytes(event: Event) -> bytes:
    """The event as one line of compact JSON (no newline).

    JSON has no NaN or infinity: such floats become ``null`` and do not decode back.
    """
    return _json_encoder.encode(event)


def event_from_json(data: bytes | str | dict[str, Any]) -> Event:
    """The event from JSON text or from the builtins ``event_to_json`` returned."""
    if isinstance(data, dict):
        event: Event = msgspec.convert(data, AnyEvent)
        return event
    return _json_decoder.decode(data)
