"""``python -m miles_events.run CONFIG.toml``: see ``miles_events.app.run``."""

import os
import sys

from miles_events.app.run import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        # stdout went away (``| head``); the run itself has finished and its log is written.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
