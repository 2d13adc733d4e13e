"""SIGINT / SIGTERM during a run: the first stops the run after the current step, the second
cuts the step in progress at its next cancellation point, the third aborts. Each says so
on stderr, which the run's log lines reach only when ``--log-level`` asks."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from miles_events.bus.event_bus import EventBus
from schemas.events import StopRequested

logger = logging.getLogger(__name__)


class StopOnSignal:
    """Installs the handlers on the running loop; ``remove`` puts the defaults back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.signals = 0
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
        self.signals += 1
        if self.signals > 2:
            raise KeyboardInterrupt
        if self.signals == 1:
            said = "interrupted: stopping after the current step (again: cut it now; a third time: abort)"
            stop = StopRequested(reason="interrupted by signal")
        else:
            said = "interrupted again: cutting the step in progress (again to abort)"
            stop = StopRequested(reason="interrupted by signal", now=True)
        logger.info(said)
        print(said, file=sys.stderr, flush=True)
        self.task = self._loop.create_task(self.bus.publish(stop, source="session"))

    @property
    def interrupted(self) -> bool:
        return self.signals > 0

    def remove(self) -> None:
        for sig, previous in self._installed:
            self._loop.remove_signal_handler(sig)
            if previous is not None:
                signal.signal(sig, previous)  # type: ignore[arg-type]  # what was there before the run
        self._installed.clear()
