"""Cancellation points for long steps: a flag set from outside, checked inside.

A stop that must reach a step in progress (the second signal, or a first one whose step
outlives ``run.stop_grace_seconds``) sets the ``Cancellation`` of every actor whose
handlers run long; their loops call ``check`` at each cancellation point (every decode
step of generation, every micro-batch of training before its first optimizer step) and
leave by ``Cancelled``. The check is one flag read, thread-safe: the work runs in worker
threads, the flag is set from the event loop.
"""

from __future__ import annotations

import threading


class Cancelled(Exception):
    """The step was cancelled at a cancellation point; ``args[0]`` says why."""


class Cancellation:
    def __init__(self) -> None:
        self._set = threading.Event()
        self.reason = ""

    def cancel(self, reason: str) -> None:
        self.reason = reason
        self._set.set()

    @property
    def cancelled(self) -> bool:
        return self._set.is_set()

    def check(self) -> None:
        """A cancellation point: raise ``Cancelled`` once ``cancel`` was called."""
        if self._set.is_set():
            raise Cancelled(self.reason)
