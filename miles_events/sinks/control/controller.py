"""miles' mini fault-tolerance controller (``run.mini_ft_controller``), through the control
server's own HTTP API and token, in the driver's event loop.

Every ``control.controller_poll_seconds`` it reads the cells. A cell whose Healthy condition
is "False", or that is Suspended, is unhealthy (Unknown is not: a cell starting or being
restarted is left alone); each unhealthy cell, one after the other, is healed: suspended,
left suspended ``control.controller_suspend_seconds``, resumed (an engine resumed starts
again with the current weights). After a heal the cell rests one suspend period; after a
heal that failed (the server refused or did not answer) it waits
``min(controller_backoff_seconds * 2**n, controller_backoff_max_seconds)`` for its n-th
failure in a row. Each step is a ``CellHealing`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from miles_events.sinks.base import Sink, SinkContext
from schemas.config import Config
from schemas.events import CellHealing, Event, HealStep

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0
"""Seconds one request to the control server may take (miles' client's)."""


def unhealthy(cell: dict[str, Any]) -> bool:
    """miles' verdict on a cell as ``GET /api/v1/cells`` lists it."""
    status = cell.get("status", {})
    if any(c.get("type") == "Healthy" and c.get("status") == "False" for c in status.get("conditions", [])):
        return True
    return bool(status.get("phase") == "Suspended")


@dataclass
class Backoff:
    failures: int = 0
    next_attempt_at: float = 0.0


class MiniFtController(Sink):
    """The controller, a sink that only starts and closes: its loop reads the cells over
    HTTP and publishes what it does."""

    name = "mini_ft_controller"

    def __init__(self, config: Config, url: Callable[[], str], token: str) -> None:
        self.config = config
        self.url = url
        self.token = token
        self.backoff: dict[str, Backoff] = {}
        self._task: asyncio.Task[None] | None = None
        self._publish: Callable[[Event], Awaitable[object]] | None = None

    async def start(self, context: SinkContext) -> None:
        bus = context.bus

        async def publish(event: Event) -> None:
            await bus.publish(event, source=self.name)

        self._publish = publish
        self._task = asyncio.create_task(self.run(), name="mini-ft-controller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def run(self) -> None:
        import httpx

        control = self.config.control
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(base_url=self.url(), headers=headers, timeout=REQUEST_TIMEOUT) as client:
            while True:
                started = time.monotonic()
                try:
                    await self.poll_and_heal(client)
                except Exception as error:  # one poll's trouble is logged; the loop goes on
                    logger.warning("mini FT controller: a poll failed: %s", error)
                await asyncio.sleep(max(0.0, control.controller_poll_seconds - (time.monotonic() - started)))

    async def poll_and_heal(self, client: Any) -> None:
        response = await client.get("/api/v1/cells")
        response.raise_for_status()
        cells = response.json()["items"]
        sick = [c["metadata"]["name"] for c in cells if unhealthy(c)]
        for name in sick:
            backoff = self.backoff.setdefault(name, Backoff())
            if time.monotonic() < backoff.next_attempt_at:
                continue
            await self.heal(client, name, backoff)
        for name in [n for n in self.backoff if n not in sick]:
            del self.backoff[name]

    async def heal(self, client: Any, name: str, backoff: Backoff) -> None:
        control = self.config.control
        try:
            await self._say(name, "suspend")
            (await client.patch(f"/api/v1/cells/{name}", json={"spec": {"suspend": True}})).raise_for_status()
            await asyncio.sleep(control.controller_suspend_seconds)
            await self._say(name, "resume")
            (
                await client.patch(f"/api/v1/cells/{name}", json={"spec": {"suspend": False}})
            ).raise_for_status()
        except Exception as error:
            backoff.failures += 1
            wait = min(
                control.controller_backoff_seconds * 2.0**backoff.failures,
                control.controller_backoff_max_seconds,
            )
            backoff.next_attempt_at = time.monotonic() + wait
            await self._say(name, "failed", reason=f"{type(error).__name__}: {error}", backoff_seconds=wait)
            return
        backoff.failures = 0
        backoff.next_attempt_at = time.monotonic() + control.controller_suspend_seconds
        await self._say(name, "done")

    async def _say(
        self, cell: str, step: HealStep, *, reason: str = "", backoff_seconds: float = 0.0
    ) -> None:
        assert self._publish is not None, "the controller publishes once started"
        await self._publish(CellHealing(cell=cell, step=step, reason=reason, backoff_seconds=backoff_seconds))
