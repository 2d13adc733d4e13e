"""How a child process ended, in the words every error line uses."""

from __future__ import annotations

import signal


def exit_status(code: int | None) -> str:
    """``killed by SIGKILL`` for a signal (a negative return code), ``exit code 3``
    otherwise; ``still running`` for None."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
