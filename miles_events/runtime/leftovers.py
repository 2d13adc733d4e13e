"""What a run killed with ``kill -9`` leaves behind, and the next run's cleanup of it.

A driver killed without a chance to shut down leaves the local Ray cluster's helper
processes (its dashboard and runtime-env agents, workers) orphaned, the inference servers
it launched (each its own process group, recorded beside its log), and its shared-memory
data plane in ``/dev/shm``. So a run on the ray runtime records, in its run directory, the
processes of the cluster it started (``ray-processes.json``: each pid with its start time,
so a reused pid is never mistaken for one of them) and removes the record when it shuts
down. The next run in that directory, having taken the directory's lock, finds a record
whose driver is gone and kills what is left of it; and any run opening the shared-memory
transport removes the data of runs whose driver is gone (each keeps an ``owner`` file).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PROCESSES_FILE = "ray-processes.json"
OWNER_FILE = "owner"

Process = tuple[int, int]
"""(pid, start time in clock ticks since boot): one process, even across pid reuse."""


_PPID, _PGRP, _STARTTIME = 1, 2, 19
"""Indices of ``/proc/<pid>/stat`` fields 4, 5 and 22 in what ``_stat`` returns."""


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on), None when
    the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    return stat[stat.rindex(")") + 2 :].split()


def _every_process() -> Iterator[tuple[int, list[str]]]:
    """(pid, ``_stat`` fields) of every live process."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            yield int(entry.name), fields


def start_time(pid: int) -> int | None:
    """The process's start time (``/proc/<pid>/stat`` field 22), None when it is gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[_STARTTIME])


def alive(process: Process) -> bool:
    return start_time(process[0]) == process[1]


def this_process() -> Process:
    pid = os.getpid()
    started = start_time(pid)
    return (pid, started if started is not None else 0)


def descendants(pid: int) -> list[Process]:
    """Every live process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, fields in _every_process():
        children.setdefault(int(fields[_PPID]), []).append(child)
    found: list[Process] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        started = start_time(child)
        if started is not None:
            found.append((child, started))
        stack.extend(children.get(child, []))
    return found


def is_ray_process(pid: int) -> bool:
    """Whether ``pid`` is one of Ray's: its workers and agents title themselves ``ray::...``,
    its servers run from Ray's package directory. Other children of the driver (whatever the
    path they run from, a tracking service, a py-spy dump) are never recorded or killed."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.startswith((b"ray::", *_ray_package())) for arg in args)


@functools.cache
def _ray_package() -> tuple[bytes, ...]:
    """Ray's package directory (as found, and resolved; with a trailing separator), found
    without importing Ray; none without Ray."""
    try:
        spec = importlib.util.find_spec("ray")
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    found = next(iter(spec.submodule_search_locations))
    return tuple(
        {os.fsencode(os.path.join(where, "")) for where in (os.path.abspath(found), os.path.realpath(found))}
    )


def ray_processes() -> list[Process]:
    """The Ray processes below this driver (the cluster it started)."""
    return [p for p in descendants(os.getpid()) if is_ray_process(p[0])]


def kill_alive(processes: list[Process]) -> int:
    """``SIGKILL`` each of ``processes`` still alive (the very process, not a reused pid);
    returns how many."""
    killed = 0
    for process in processes:
        if alive(process):
            try:
                os.kill(process[0], signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def record_processes(run_dir: Path) -> None:
    """Record this driver and the Ray processes below it (the cluster it started)."""
    record = {"driver": this_process(), "processes": ray_processes()}
    path = Path(run_dir) / PROCESSES_FILE
    partial = path.with_name(f".{PROCESSES_FILE}.partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


def forget_processes(run_dir: Path) -> None:
    (Path(run_dir) / PROCESSES_FILE).unlink(missing_ok=True)


SERVER_RECORDS = "*/*.processes.json"
"""The records of inference servers a run launched (``actors.engine.server_process``:
``<run.dir>/<backend>/<engine>.processes.json``): the launcher and the server's process
group, which a dead launcher leaves running (the group is a session of its own)."""


def clean_dead_run(run_dir: Path) -> int:
    """Kill what a dead driver's run left (its recorded processes still alive, and the
    process groups of servers whose launcher is gone); returns how many. A record of a live
    driver is left alone."""
    # The cluster first: on ray a server's launcher is one of the cluster's workers, dead
    # once the cluster's record is cleaned (it may linger a moment as a zombie).
    dead = _clean_record(Path(run_dir) / PROCESSES_FILE, set())
    killed = len(dead)
    for path in sorted(Path(run_dir).glob(SERVER_RECORDS)):
        killed += len(_clean_record(path, dead))
    return killed


def _group_members(pgid: int, since: int) -> list[Process]:
    """The live processes of process group ``pgid`` started at ``since`` or later."""
    return [
        (pid, int(fields[_STARTTIME]))
        for pid, fields in _every_process()
        if int(fields[_PGRP]) == pgid and int(fields[_STARTTIME]) >= since
    ]


def _clean_record(path: Path, dead: set[Process]) -> set[Process]:
    """Kill what the record at ``path`` names if its driver is gone (or in ``dead``, just
    killed); returns the processes killed."""
    try:
        record = json.loads(path.read_text())
        driver = tuple(record["driver"])
        processes = [tuple(p) for p in record["processes"]]
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("%s cannot be read (%s); removed", path, error)
        path.unlink(missing_ok=True)
        return set()
    if alive(driver) and driver not in dead:
        return set()
    if "group" in record and processes:
        members = _group_members(int(record["group"]), int(processes[0][1]))
        processes = list(dict.fromkeys([*processes, *members]))
    killed = {p for p in processes if alive(p)}
    kill_alive(sorted(killed))
    for leftover in record.get("files", []):  # what described the dead server (a scrape target)
        Path(leftover).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    if killed:
        logger.warning(
            "killed %d process(es) left by a run whose driver died (pid %d)", len(killed), driver[0]
        )
    return killed


def claim(directory: Path) -> None:
    """Mark ``directory`` as this driver's (the shared-memory data of this run)."""
    (directory / OWNER_FILE).write_text(json.dumps(this_process()))


def remove_dead_owners(root: Path, prefix: str) -> list[Path]:
    """Remove the ``prefix*`` directories under ``root`` whose owner is gone."""
    removed = []
    for directory in root.glob(f"{prefix}*"):
        try:
            owner = tuple(json.loads((directory / OWNER_FILE).read_text()))
        except (OSError, ValueError):
            continue  # not claimed (or not ours to judge)
        if len(owner) == 2 and not alive(owner):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    if removed:
        logger.warning(
            "removed the data of %d run(s) whose driver died: %s", len(removed), ", ".join(map(str, removed))
        )
    return removed
