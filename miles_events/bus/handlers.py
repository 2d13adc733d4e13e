"""The one dispatch style of the house: ``@handles`` tables, shared by actors and sinks.

A class marks its handler methods with ``@handles(EventType, ..., emits=(...))``; the table
(event type -> method name) is built once per class, and ``dispatch_name`` finds the method
for an event's type, walking the type's bases, so a handler of ``Event`` sees every event.
``emits`` declares what a handler may publish: the docs say from it who emits and who
handles each event, and an actor that publishes an undeclared type fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from schemas.events import Event

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Route:
    """One handler: the event types it takes, its method, and what it may emit
    (``None``: not declared)."""

    handles: tuple[type[Event], ...]
    method: str
    emits: tuple[type[Event], ...] | None


def handles(*event_types: type[Event], emits: tuple[type[Event], ...] | None = None) -> Callable[[F], F]:
    """Mark a method as the handler of ``event_types``; ``emits``: the event types it may publish."""
    if not event_types:
        raise TypeError("@handles needs at least one event type")

    def mark(method: F) -> F:
        method.__handles__ = event_types  # type: ignore[attr-defined]
        method.__emits__ = None if emits is None else tuple(emits)  # type: ignore[attr-defined]
        return method

    return mark


class HandlerTable:
    """Builds the ``@handles`` table of each subclass and finds the handler of an event."""

    _handler_table: ClassVar[dict[type[Event], str]] = {}
    _routes: ClassVar[tuple[Route, ...]] = ()
    _dispatch_cache: ClassVar[dict[type[Event], str | None]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Base classes first: a subclass's handler of a type replaces its base's.
        table: dict[type[Event], str] = {}
        routes: dict[str, Route] = {}
        for klass in reversed(cls.__mro__):
            own: dict[type[Event], str] = {}
            for attr, value in vars(klass).items():
                event_types = getattr(value, "__handles__", None)
                if event_types is None:
                    routes.pop(attr, None)  # overridden without @handles: no longer a handler
                    continue
                routes[attr] = Route(tuple(event_types), attr, value.__emits__)
                for event_type in event_types:
                    if event_type in own:
                        raise TypeError(
                            f"{klass.__name__}: {event_type.__name__} is handled by both {own[event_type]} and {attr}"
                        )
                    own[event_type] = attr
            table.update(own)
        # A method a subclass redefined for other types no longer takes the base's types.
        table = {e: m for e, m in table.items() if m in routes and e in routes[m].handles}
        cls._handler_table = table
        cls._routes = tuple(r for r in routes.values() if any(table.get(e) == r.method for e in r.handles))
        cls._dispatch_cache = {}

    @classmethod
    def handlers(cls) -> dict[type[Event], str]:
        """Event type -> name of the method that handles it."""
        return cls._handler_table

    @classmethod
    def routes(cls) -> tuple[Route, ...]:
        """Every handler with what it takes and what it may emit."""
        return cls._routes

    def handler_for(self, event: Event) -> Callable[[Any], Any] | None:
        """The bound handler of ``event``, if this class handles its type."""
        method = self.dispatch_name(type(event))
        return getattr(self, method) if method is not None else None

    @classmethod
    def dispatch_name(cls, event_type: type[Event]) -> str | None:
        """The handler method of ``event_type`` (or of its nearest handled base), if any."""
        try:
            return cls._dispatch_cache[event_type]
        except KeyError:
            pass
        table = cls._handler_table
        name = next((table[base] for base in event_type.__mro__ if base in table), None)
        cls._dispatch_cache[event_type] = name
        return name
