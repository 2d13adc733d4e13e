"""An exception as the one line an error message quotes."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (a library's may run to a page), or its type's
    name where it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
