"""The central event bus: typed subscriptions, one bounded mailbox per subscriber.

Guarantees:
- ``seq`` strictly increases in publish order, and every mailbox receives its events in
  ``seq`` order: an event is stamped and delivered to all its mailboxes in one step.
- Backpressure, never drops: publishing into a full mailbox waits until the subscriber
  makes room, holding nothing meanwhile. A publish that waits longer than
  ``stall_warning_seconds`` logs the mailbox that holds it up.
- ``close()`` stops new publications; each mailbox then drains what it holds and its
  consumer sees the end.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from miles_events.bus.clock import SYSTEM_CLOCK, Clock
from schemas.events import Event

logger = logging.getLogger(__name__)


class BusClosed(RuntimeError):
    """Publishing on a closed bus."""


@dataclass(frozen=True)
class MailboxStatistics:
    """A snapshot of one mailbox (as trio's channel ``statistics()``)."""

    name: str
    depth: int
    max_size: int
    delivered: int
    high_water_mark: int
    closed: bool


class Mailbox:
    """A bounded FIFO of events for one subscriber."""

    def __init__(self, name: str, max_size: int, types: tuple[type[Event], ...]) -> None:
        self.name = name
        self.max_size = max_size
        self.types = types
        self._items: deque[Event] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self._delivered = 0
        self._high_water_mark = 0
        self._closed = False

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            name=self.name,
            depth=len(self._items),
            max_size=self.max_size,
            delivered=self._delivered,
            high_water_mark=self._high_water_mark,
            closed=self._closed,
        )

    @staticmethod
    def _wake(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def wait_for_room(self) -> None:
        """Return once the mailbox has room (or is closed); reserves nothing."""
        while len(self._items) >= self.max_size and not self._closed:
            waiter = asyncio.get_running_loop().create_future()
            self._putters.append(waiter)
            await waiter

    async def put(self, event: Event) -> None:
        await self.wait_for_room()
        self.put_nowait(event)

    def put_nowait(self, event: Event) -> bool:
        """Enqueue if there is room; False when full."""
        if len(self._items) >= self.max_size:
            return False
        self._items.append(event)
        depth = len(self._items)
        if depth > self._high_water_mark:
            self._high_water_mark = depth
        if self._getters:
            self._wake(self._getters)
        return True

    async def _wait_for_items(self) -> bool:
        while not self._items:
            if self._closed:
                return False
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            await waiter
        return True

    async def get(self) -> Event | None:
        """The next event, or None once the mailbox is closed and drained."""
        items = self._items
        while not items:
            if self._closed:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            await waiter
        event = items.popleft()
        self._delivered += 1
        if self._putters:
            self._wake(self._putters)
        return event

    async def get_batch(self, max_items: int) -> list[Event]:
        """Up to ``max_items`` events (at least one), or [] once closed and drained."""
        if not await self._wait_for_items():
            return []
        count = min(max_items, len(self._items))
        batch = [self._items.popleft() for _ in range(count)]
        self._delivered += count
        for _ in range(min(count, len(self._putters))):
            self._wake(self._putters)
        return batch

    def close(self) -> None:
        self._closed = True
        for waiters in (self._getters, self._putters):
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)


class EventBus:
    """Stamps, orders and fans out events to the mailboxes subscribed to their types."""

    def __init__(
        self,
        run_id: str,
        mailbox_size: int = 4096,
        stall_warning_seconds: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.run_id = run_id
        self.clock = clock
        self.mailbox_size = mailbox_size
        self.stall_warning_seconds = stall_warning_seconds
        self._mailboxes: list[Mailbox] = []
        self._routes: dict[type[Event], list[Mailbox]] = {}
        self._seq = 0
        self._closed = False
        self._blocked: tuple[Mailbox, str, float] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def last_seq(self) -> int:
        return self._seq

    def subscribe(self, name: str, types: Iterable[type[Event]], max_size: int | None = None) -> Mailbox:
        """A new mailbox receiving every event that is an instance of one of ``types``."""
        mailbox = Mailbox(name, max_size or self.mailbox_size, tuple(types))
        self._mailboxes.append(mailbox)
        self._routes.clear()
        return mailbox

    def mailboxes(self) -> list[Mailbox]:
        return list(self._mailboxes)

    def statistics(self) -> list[MailboxStatistics]:
        return [m.statistics() for m in self._mailboxes]

    def _route(self, event_type: type[Event]) -> list[Mailbox]:
        route = self._routes.get(event_type)
        if route is None:
            route = [m for m in self._mailboxes if issubclass(event_type, m.types)]
            self._routes[event_type] = route
        return route

    def _stamp(self, event: Event, source: str | None) -> Event:
        self._seq += 1
        return msgspec.structs.replace(
            event,
            run_id=self.run_id,
            seq=self._seq,
            time=event.time or self.clock.time(),
            source=event.source or source or "",
        )

    async def publish(self, event: Event, source: str | None = None) -> Event:
        """Stamp ``event`` and deliver it to every subscribed mailbox; returns the stamped event.

        The event is stamped and delivered in one step without yielding, once every target
        mailbox has room, so each mailbox receives events in ``seq`` order. Until then the
        publisher waits (backpressure) without holding anything that another publisher
        needs: the consumer of a full mailbox can always publish elsewhere.
        """
        route = self._route(type(event))
        while True:
            if self._closed:
                raise BusClosed(f"bus closed; cannot publish {type(event).__name__}")
            full = next((m for m in route if len(m._items) >= m.max_size), None)
            if full is None:
                stamped = self._stamp(event, source)
                for mailbox in route:
                    mailbox.put_nowait(stamped)
                return stamped
            await self._wait_for_room(full, event)

    async def _wait_for_room(self, mailbox: Mailbox, event: Event) -> None:
        blocked = (mailbox, type(event).__name__, self.clock.monotonic())
        self._blocked = blocked
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_stalls(), name="bus-watchdog")
        try:
            await mailbox.wait_for_room()
        finally:
            if self._blocked is blocked:
                self._blocked = None

    async def _watch_stalls(self) -> None:
        """Warn about a publish held up by a full mailbox (a slow or stuck subscriber)."""
        warned: object = None
        while not self._closed:
            await self.clock.sleep(self.stall_warning_seconds / 4)
            blocked = self._blocked
            if blocked is None or blocked is warned:
                continue
            mailbox, event_type, since = blocked
            waited = self.clock.monotonic() - since
            if waited >= self.stall_warning_seconds:
                warned = blocked
                logger.warning(
                    "bus: publishing %s has waited %.1fs on the full mailbox %r (%d events)",
                    event_type,
                    waited,
                    mailbox.name,
                    mailbox.statistics().depth,
                )

    def close(self) -> None:
        """No more publications; mailboxes drain what they hold, then report the end."""
        self._closed = True
        for mailbox in self._mailboxes:
            mailbox.close()
        if self._watchdog is not None:
            self._watchdog.cancel()

    @property
    def closed(self) -> bool:
        return self._closed
