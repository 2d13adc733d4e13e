"""Files and directories removed off the caller's thread.

Removing a large file frees its pages there and then, which for gigabytes takes a
noticeable time (``bench/free.py``; figures in ``docs/benchmarks.md``). A transport's
``free`` runs on an actor's event loop, where that time holds back every event behind it
(the publication asked for with a save waits behind the release of the last save's staged
state). ``remove_later``
renames the path out of the way at once (its key can be written again, and a reader finds
it gone, as after a removal) and a daemon thread removes it. A process that exits first
leaves the renamed path in its run's directory, which the run's end removes with the rest.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FREED_PREFIX = ".freed-"
"""A path being removed is renamed ``.freed-<pid>-<n>`` in its directory: hidden, so never
a transport's key."""

_pending: queue.SimpleQueue[Path] = queue.SimpleQueue()
_counter = itertools.count()
_thread: threading.Thread | None = None
_idle = threading.Condition()
"""Guards ``_thread`` and ``_unfinished``; notified as each path is removed."""
_unfinished = 0


def remove_later(path: Path) -> None:
    """Rename ``path`` (a file or a directory) aside now and remove it on the reaper's
    thread; nothing happens where it does not exist."""
    global _thread, _unfinished
    doomed = path.with_name(f"{FREED_PREFIX}{os.getpid()}-{next(_counter)}")
    with _idle:  # counted before it is renamed: ``wait_removed`` never misses it
        _unfinished += 1
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        _done()
        return  # nothing to remove (freed before)
    except BaseException:
        _done()
        raise
    _pending.put(doomed)
    with _idle:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_reap, name="transport-reaper", daemon=True)
            _thread.start()


def wait_removed(timeout: float | None = None) -> bool:
    """Block until every path handed to ``remove_later`` so far is removed (False on
    ``timeout``)."""
    with _idle:
        return _idle.wait_for(lambda: _unfinished == 0, timeout)


def _reap() -> None:
    while True:
        path = _pending.get()
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass  # the run's end removed its directory first
        except OSError as exc:
            log.warning("could not remove freed data %s: %s", path, exc)
        finally:
            _done()


def _done() -> None:
    global _unfinished
    with _idle:
        _unfinished -= 1
        _idle.notify_all()
