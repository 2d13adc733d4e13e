"""SIGINT / SIGTERM during a run: the first asks the run to stop, the second aborts."""

from __future__ import annotations

import asyncio
import logging
import signal

from miles_events.bus.event_bus import EventBus
from schemas.events import StopRequested

logger = logging.getLogger(__name__)


class StopOnSignal:
    """Installs the handlers on the running loop; ``remove`` puts the defaults back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.interrupted = False
        self.task: asyncio.Task[object] | None = None
        self._loop = asyncio.get_running_loop()
        self._installed: list[tuple[signal.Signals, object]] = []
        for sig in self.SIGNALS:
            previous = signal.getsignal(sig)
            try:
                self._loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError):
                continue
            self._installed.append((sig, previous))

    def _on_signal(self) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        logger.warning("interrupted: stopping after the current step (again to abort)")
        self.task = self._loop.create_task(
            self.bus.publish(StopRequested(reason="interrupted by signal"), source="session")
        )

    def remove(self) -> None:
        for sig, previous in self._installed:
            self._loop.remove_signal_handler(sig)
            if previous is not None:
                signal.signal(sig, previous)  # type: ignore[arg-type]  # what was there before the run
        self._installed.clear()
