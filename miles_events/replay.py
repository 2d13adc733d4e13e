"""``python -m miles_events.replay LOG``: see ``miles_events.app.replay``."""

import sys

from miles_events.app.replay import main

if __name__ == "__main__":
    sys.exit(main())
