"""What a protocol's step takes (a fact) and returns (a command).

Facts are what the Coordinator heard, put the way a protocol needs them: the run began,
every engine answered the weight check asked for, the publication asked for is through, the
evidence file is written. A command is an event to publish (a weight check, a publication,
the evidence), ``Done`` (the protocol is through: the loop goes on), ``Failed`` (the run
fails with that reason) or ``Ignored`` (the fact is not one the protocol awaits now).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas.events import (
    PublicationEvidenceRequested,
    PublishRequested,
    WeightsCheckFinished,
    WeightsCheckRequested,
)

# --- facts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The run began (``RunStarted``)."""


@dataclass(frozen=True)
class ChecksFinished:
    """Every engine answered one weight check: their replies, in engine order."""

    replies: tuple[WeightsCheckFinished, ...]


@dataclass(frozen=True)
class Published:
    """The publication the protocol asked for is through: verified, let through
    (``verifier.continue_on_mismatch``), or published where nothing verifies."""


@dataclass(frozen=True)
class EvidenceWritten:
    """The evidence file the protocol asked for is written."""

    path: str


Fact = Started | ChecksFinished | Published | EvidenceWritten

STARTED = Started()
PUBLISHED = Published()

# --- commands --------------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    """The protocol is through: the loop goes on."""


@dataclass(frozen=True)
class Failed:
    """The protocol failed: the run finishes failed with ``reason`` (one line)."""

    reason: str


@dataclass(frozen=True)
class Ignored:
    """The fact is not one the protocol awaits in its state: nothing changes."""


Command = WeightsCheckRequested | PublishRequested | PublicationEvidenceRequested | Done | Failed | Ignored

DONE = Done()
IGNORED = Ignored()


class EngineReplies:
    """The replies to one weight check (by its ``request_id``), until every engine answered."""

    def __init__(self, request_id: str, engines: Sequence[str]) -> None:
        self.request_id = request_id
        self.engines = tuple(engines)
        self._replies: dict[str, WeightsCheckFinished] = {}

    def add(self, reply: WeightsCheckFinished) -> bool:
        """Take ``reply`` if it answers this check; whether every engine has answered now."""
        if reply.request_id != self.request_id:
            return False
        self._replies[reply.engine] = reply
        return set(self._replies) >= set(self.engines)

    def finished(self) -> ChecksFinished:
        """The fact, once every engine answered."""
        return ChecksFinished(tuple(self._replies[engine] for engine in self.engines))
