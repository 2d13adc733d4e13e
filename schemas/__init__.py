"""Typed messages of miles-events: events, config sections, checkpoint and checksum records.

This package imports nothing else of the project."""

from schemas.config import Config
from schemas.data import DataRef
from schemas.events import EVENT_TYPES, EVENT_TYPES_BY_NAME, AnyEvent, Event

__all__ = ["EVENT_TYPES", "EVENT_TYPES_BY_NAME", "AnyEvent", "Config", "DataRef", "Event"]
