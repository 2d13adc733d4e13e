"""Staging buffers of publications, allocated once and reused.

Each publication stages a copy of the weights (flat buckets, ``miles_events.device.buckets``)
that the engines read while the trainer trains on. Allocated afresh each time, the copy
would cost an allocation, and, shared across processes by CUDA IPC
(``miles_events.transport.cuda_ipc``), a new handle that every engine process opens (maps)
and closes again: on a GPU, most of a publication's time. Reused, the staging is one copy
per bucket into memory the engines already map.

A staging buffer is reused only once every reader has said it is done with it: the
Publisher's ``DataReleased``, after every engine reported its load. An engine reports a
load once it has read what it loaded back (its fingerprints), so its copies have run; a
reader that reads nothing back may say it is done with its copies still queued
(``Transport.done_reading``), and where they may still be running on the GPU the buffer is
given back with the readers' events (``Transport.reads_of``) and taken again only once
each has run, never where one cannot say. A buffer freed
without that word (the next publication is staged while an engine has still not answered)
is never written again: the transport keeps it alive for whoever still reads it, and the
next publication takes a new one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles_events.device.buckets import Buckets
from schemas.data import BucketLayout

if TYPE_CHECKING:
    import torch

IDLE_PER_LAYOUT = 2
"""Idle staging buffers kept for one layout and device; when more are given back, the
oldest are dropped."""


class StagingPool:
    """``take`` buckets for a publication (an idle set of the same layouts and device whose
    readers' reads have run, else new ones), ``lend`` them under the publication's key, then
    ``give_back`` the key once its readers are done (idle again) or ``forget`` it when it is
    freed before they said so (never reused)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken on the staging thread and on the event loop
        self._idle: dict[tuple[tuple[BucketLayout, ...], str], list[tuple[Buckets, tuple[Any, ...]]]] = {}
        """Buckets given back, each with the events of reads that may still be running."""
        self._lent: dict[str, Buckets] = {}
        self.num_allocated = 0
        """Sets of buckets allocated so far (each a new mapping for every engine process)."""

    def take(self, layouts: Sequence[BucketLayout], device: torch.device | str) -> Buckets:
        """Buckets laid out as ``layouts`` on ``device``: their tensors' bytes are whatever was
        staged in them last (the caller writes every one), the gaps between them zero."""
        signature = (tuple(layouts), _device_name(device))
        with self._lock:
            idle = self._idle.get(signature, [])
            for index in reversed(range(len(idle))):  # the last given back first
                done = _reads_done(idle[index][1])
                if done is not False:
                    buckets, _ = idle.pop(index)
                    if done:
                        return buckets
            self.num_allocated += 1
        return Buckets.allocate(layouts, device)

    def lend(self, key: str, buckets: Buckets) -> None:
        with self._lock:
            self._lent[key] = buckets

    def give_back(self, key: str, reads: Sequence[Any] = ()) -> None:
        """Every reader of ``key`` is done: its buckets are written again by a later staging,
        once each of ``reads`` (events of the readers' copies, ``Transport.reads_of``) has
        run."""
        with self._lock:
            buckets = self._lent.pop(key, None)
            if buckets is None:
                return
            idle = self._idle.setdefault((buckets.layouts, _device_name(buckets.device)), [])
            if len(idle) >= IDLE_PER_LAYOUT:  # the oldest dropped: one whose reads never end goes
                idle.pop(0)
            idle.append((buckets, tuple(reads)))

    def forget(self, key: str) -> None:
        """``key`` is freed while a reader may still read it: its buckets are not reused."""
        with self._lock:
            self._lent.pop(key, None)

    def drop_idle(self) -> None:
        """Free the idle buckets (an offload): the next publication allocates again."""
        with self._lock:
            self._idle.clear()

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._lent.clear()


def _reads_done(reads: Sequence[Any]) -> bool | None:
    """Whether every one of ``reads`` (CUDA events) has run; None where one cannot say (its
    reader's process is gone with its context): buckets it read are never written again."""
    try:
        return all(read.query() for read in reads)
    except RuntimeError:
        return None


def _device_name(device: torch.device | str) -> str:
    """``device`` as a tensor on it names it: ``cuda`` is the current CUDA device's index."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)
