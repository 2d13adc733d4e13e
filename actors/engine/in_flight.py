"""Weight loads that land between the decode steps of a generation in progress.

With ``rollout.partial``, a publication does not wait for the rollout being generated: the
embedded engine's decode loop stops at its next step boundary, the weights are loaded (and
fingerprinted), and the requests in flight go on with the new weights, each token recording
the version that sampled it. A load and a decode step never overlap; a generation that does
not stop at step boundaries (the static and CUDA-graph decoders) takes a load between its
chunks of requests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class InFlightUpdates:
    """Decode loops yield to waiting loads at their step boundaries."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._decoding = 0
        """Decode loops running a step (not parked at a boundary)."""
        self._waiting = 0
        """Loads waiting for every decode loop to reach a boundary."""
        self._loading = False

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around a whole generation: it starts once no load runs."""
        with self._changed:
            while self._loading or self._waiting:
                self._changed.wait()
            self._decoding += 1
        try:
            yield
        finally:
            with self._changed:
                self._decoding -= 1
                self._changed.notify_all()

    def boundary(self) -> bool:
        """A decode loop (inside ``generating``) between two steps: waiting loads run now.
        True when one did (the weights may have changed)."""
        with self._changed:
            if not self._waiting:
                return False
            self._decoding -= 1
            self._changed.notify_all()
            while self._waiting or self._loading:
                self._changed.wait()
            self._decoding += 1
            return True

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Around a load: it runs once every decode loop is at a step boundary."""
        with self._changed:
            self._waiting += 1
            while self._decoding or self._loading:
                self._changed.wait()
            self._waiting -= 1
            self._loading = True
        try:
            yield
        finally:
            with self._changed:
                self._loading = False
                self._changed.notify_all()
