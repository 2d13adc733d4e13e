"""``python -m miles_events.run CONFIG.toml``: see ``miles_events.app.run``."""

import os
import signal
import sys


def _abort(signum: int, frame: object) -> None:
    # Once: the shutdown that follows (Ray's included) must not be interrupted again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    # Before torch loads OpenMP: a thread waiting at a barrier spins briefly, then sleeps
    # (miles_events.device.threads says why); Ray's workers inherit it.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    # SIGTERM aborts as Ctrl-C does from the first instant, imports included (exit 130).
    signal.signal(signal.SIGTERM, _abort)
    try:
        from miles_events.app.run import exit_process, main

        exit_process(main())
    except KeyboardInterrupt:
        print("error: aborted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # stdout went away (``| head``); the run itself has finished and its log is written.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
