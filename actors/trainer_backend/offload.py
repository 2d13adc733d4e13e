"""A trainer group's offload and onload as the facts that say so (``run.offload_train``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from actors.trainer_backend.base import TrainerBackend
from schemas.events import MemoryOffloaded, MemoryOnloaded, MemoryPart, MemoryTarget


async def _moved(
    move: Callable[[], list[MemoryPart]],
    fact: type[MemoryOffloaded] | type[MemoryOnloaded],
    target: MemoryTarget,
    rollout_id: int | None,
    request_id: str,
) -> MemoryOffloaded | MemoryOnloaded:
    started = time.perf_counter()
    parts = await anyio.to_thread.run_sync(move)
    seconds = time.perf_counter() - started
    return fact(target=target, rollout_id=rollout_id, request_id=request_id, parts=parts, seconds=seconds)


async def offload_group(
    backend: TrainerBackend, target: MemoryTarget, rollout_id: int | None = None, request_id: str = ""
) -> MemoryOffloaded | MemoryOnloaded:
    """Offload a trainer group (off the event loop): the ``MemoryOffloaded`` that says so."""
    return await _moved(backend.offload, MemoryOffloaded, target, rollout_id, request_id)


async def onload_group(
    backend: TrainerBackend, target: MemoryTarget, rollout_id: int | None = None, request_id: str = ""
) -> MemoryOffloaded | MemoryOnloaded:
    """Onload a trainer group (off the event loop): the ``MemoryOnloaded`` that says so."""
    return await _moved(backend.onload, MemoryOnloaded, target, rollout_id, request_id)
