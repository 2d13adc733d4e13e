"""A trainer group's offload and onload as the facts that say so (``run.offload_train``)."""

from __future__ import annotations

import time

import anyio

from actors.trainer_backend.base import TrainerBackend
from schemas.events import MemoryOffloaded, MemoryOnloaded, MemoryTarget


async def offload_group(
    backend: TrainerBackend, target: MemoryTarget, rollout_id: int | None = None, request_id: str = ""
) -> MemoryOffloaded:
    """Offload a trainer group (off the event loop): the fact that says so."""
    started = time.perf_counter()
    parts = await anyio.to_thread.run_sync(backend.offload)
    return MemoryOffloaded(
        target=target,
        rollout_id=rollout_id,
        request_id=request_id,
        parts=parts,
        seconds=time.perf_counter() - started,
    )


async def onload_group(
    backend: TrainerBackend, target: MemoryTarget, rollout_id: int | None = None, request_id: str = ""
) -> MemoryOnloaded:
    """Onload a trainer group (off the event loop): the fact that says so."""
    started = time.perf_counter()
    parts = await anyio.to_thread.run_sync(backend.onload)
    return MemoryOnloaded(
        target=target,
        rollout_id=rollout_id,
        request_id=request_id,
        parts=parts,
        seconds=time.perf_counter() - started,
    )
