"""Errors as one line: what a user reads of an exception, wherever it was raised."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def innermost(error: BaseException) -> BaseException:
    """The exception itself, out of the groups that task groups wrap single errors in."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def describe_error(error: BaseException) -> str:
    """One line: the exception type and message, and where it was raised."""
    error = innermost(error)
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = _ANSI.sub("", str(error)).strip()
    message = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {message}{where}" if message else f"{type(error).__name__}{where}"
