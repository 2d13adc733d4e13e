"""The actors of a run, in start order, and every sink class (for the events reference)."""

from __future__ import annotations

from actors.coordinator import Coordinator
from actors.critic import Critic
from actors.generator import Generator
from actors.policy_sync import PolicySyncDriver
from actors.publisher import Publisher
from actors.saver import Saver
from actors.trainer import Trainer
from actors.verifier import Verifier
from miles_events.bus.actor import Actor
from miles_events.sinks.base import Sink
from miles_events.sinks.console import ConsoleSink
from miles_events.sinks.control.server import ControlServer
from miles_events.sinks.event_log import EventLogSink
from miles_events.sinks.metrics import RunMetrics
from miles_events.sinks.tracking import TrackingSink

ACTORS: tuple[type[Actor], ...] = (
    Generator,
    Trainer,
    Critic,
    Publisher,
    Verifier,
    Saver,
    PolicySyncDriver,
    Coordinator,
)
"""Every actor a run may have; a run has those ``wanted`` by its config."""
SINKS: tuple[type[Sink], ...] = (EventLogSink, RunMetrics, ConsoleSink, TrackingSink, ControlServer)
