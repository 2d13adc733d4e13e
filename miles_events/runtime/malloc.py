"""glibc's malloc arenas, capped for every process of a run.

glibc gives each thread that allocates while another holds the main arena an arena of its
own, up to 8 per core, and an arena keeps what it once held. A run's processes have many
threads (an engine rank's, the trainer's, the handlers' worker threads, Ray's): a trainer
process holds more at its peak with the default, and runs no faster for it. The ray runtime starts its cluster with ``MALLOC_ARENA_MAX``; the
process of ``python -m miles_events.run`` caps its own with ``mallopt``. A value the user
set in ``MALLOC_ARENA_MAX`` is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

MALLOC_ARENAS = 2
"""Arenas per process of a run (``MALLOC_ARENA_MAX``), unless the user set it."""
M_ARENA_MAX = -8
"""``mallopt``'s parameter number for the arena cap (glibc's ``malloc.h``)."""


def cap_this_process() -> bool:
    """Cap this process's arenas at ``MALLOC_ARENAS`` (arenas already made stay): whether
    it did; not where ``MALLOC_ARENA_MAX`` is set or the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname (find_library would run ldconfig)
        return bool(libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):  # not glibc: no mallopt, or no arenas of this kind
        logger.debug("malloc arenas not capped: no glibc mallopt", exc_info=True)
        return False
