"""``python -m miles_events.run CONFIG.toml``: see ``miles_events.app.run``."""

import gc
import os
import signal
import sys


def _abort(signum: int, frame: object) -> None:
    # Once: the shutdown that follows (Ray's included) must not be interrupted again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    # Before torch loads OpenMP: a thread waiting at a barrier spins briefly, then sleeps
    # (miles_events.rl.threads says why); Ray's workers inherit it.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    # SIGTERM aborts as Ctrl-C does from the first instant, imports included (exit 130).
    signal.signal(signal.SIGTERM, _abort)
    try:
        from miles_events.app.run import main

        code = main()
        # The run is over and closed. What torch and transformers built at import (hundreds
        # of thousands of objects) need not be traced once more by the collector at exit:
        # ~0.7 s of a 2-core machine's exit. Files still flush and atexit handlers still run.
        gc.freeze()
        sys.exit(code)
    except KeyboardInterrupt:
        print("error: aborted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # stdout went away (``| head``); the run itself has finished and its log is written.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
