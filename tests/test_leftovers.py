"""What a ``kill -9`` of the driver leaves behind is cleaned by the next run
(``miles_events.runtime.leftovers``), and the shared-memory data plane is private."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from miles_events.bus.event_log import read_events
from miles_events.runtime.leftovers import (
    OWNER_FILE,
    PROCESSES_FILE,
    alive,
    claim,
    clean_dead_run,
    remove_dead_owners,
    start_time,
)
from miles_events.transport.shm import SHM_PREFIX, ShmTransport, shm_root
from schemas.events import RunStarted

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"

# A driver that starts a child, records its process tree, says so, and waits to be killed.
DRIVER = """
import subprocess, sys, time
from pathlib import Path
from miles_events.runtime.leftovers import record_processes
ray_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "ray::stand-in"])
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
record_processes(Path(sys.argv[1]))
print(ray_like.pid, other.pid, flush=True)
time.sleep(300)
"""


def start_driver(run_dir: Path) -> tuple[subprocess.Popen, int, int]:
    """A driver with a child that names Ray in its command line and one that does not."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert driver.stdout is not None
    ray_like, other = map(int, driver.stdout.readline().split())
    return driver, ray_like, other


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        started = start_time(pid)
        if started is None or Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return True
        time.sleep(0.05)
    return False


def test_the_next_run_kills_what_a_killed_driver_left_running(tmp_path):
    driver, child, other = start_driver(tmp_path)
    try:
        assert clean_dead_run(tmp_path) == 0, "a live driver's processes are left alone"
        assert start_time(child) is not None
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert start_time(child) is not None, "the orphan outlives its driver"
        assert clean_dead_run(tmp_path) == 1
        assert gone(child)
        assert start_time(other) is not None, "only Ray's processes are recorded and killed"
        assert not (tmp_path / PROCESSES_FILE).exists()
    finally:
        driver.kill()
        for pid in (child, other):
            if start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)


def test_a_reused_pid_is_never_killed(tmp_path):
    me = (os.getpid(), start_time(os.getpid()))
    (tmp_path / PROCESSES_FILE).write_text(
        json.dumps({"driver": [999_999_999, 1], "processes": [[me[0], me[1] + 1]]})
    )
    assert clean_dead_run(tmp_path) == 0 and alive(me)  # type: ignore[arg-type]


def test_shared_memory_of_a_dead_driver_is_removed_and_its_files_are_private(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone_dir = tmp_path / f"{SHM_PREFIX}dead"
    gone_dir.mkdir()
    (gone_dir / OWNER_FILE).write_text(json.dumps([int(dead.stdout), 12345]))
    unclaimed = tmp_path / f"{SHM_PREFIX}unclaimed"
    unclaimed.mkdir()
    transport = ShmTransport("live", root=tmp_path)
    claim(transport.root)
    assert remove_dead_owners(tmp_path, SHM_PREFIX) == [gone_dir]
    assert not gone_dir.exists() and unclaimed.exists() and transport.root.exists()
    ref = transport.stager.put_tensors("w", {"x": torch.ones(2)}, owner="trainer")
    assert stat.S_IMODE(transport.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((transport.root / ref.key).stat().st_mode) == 0o600
    transport.close()


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
"""127.0.0.1 and ::1 (and 127.0.0.1 mapped into IPv6) as /proc/net/tcp{,6} write them."""


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net writes them) of the listening TCP sockets the
    processes ``pids`` hold open."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                addresses.append(fields[1].split(":")[0])
    return addresses


@pytest.mark.slow
def test_kill_9_of_a_ray_driver_leaves_nothing_after_the_next_run(tmp_path):
    """Ray's servers listen on the loopback address only; what a killed driver leaves is
    gone once the next run in the directory has started."""
    args = [sys.executable, "-m", "miles_events.run", str(TINY), "--set", f'run.dir="{tmp_path}"', "--set", "metrics.port=0",
            "--set", 'console.mode="plain"', "--set", "data.rollout_batch_size=16", "--set", "data.n_samples_per_prompt=8",
            "--set", "trainer.global_batch_size=64", "--set", "trainer.micro_batch_size=64"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env
    )
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if line.startswith("rollout 0 [1/"):
                break
        record = json.loads((tmp_path / PROCESSES_FILE).read_text())
        listening = listening_addresses([pid for pid, _ in record["processes"]])
        assert listening and all(address in LOOPBACK for address in listening), listening
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
    run_id = next(e.run_id for e in read_events(tmp_path / "events.log") if isinstance(e, RunStarted))
    assert (shm_root() / f"{SHM_PREFIX}{run_id}").exists(), "the dead run's data plane is still there"
    second = subprocess.run([*args, "--set", "run.num_rollout=1", "--set", "run.overwrite=true"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)  # fmt: skip
    assert second.returncode == 0, second.stderr[-2000:]
    left = [tuple(p) for p in record["processes"] if alive(tuple(p))]  # type: ignore[arg-type]
    assert not left, f"still running after the next run: {left}"
    assert not (shm_root() / f"{SHM_PREFIX}{run_id}").exists()
    assert not (tmp_path / PROCESSES_FILE).exists(), "a clean shutdown removes its record"


# A driver whose actor starts three ranks with processes of their own (``own_processes``):
# it says their pids once rank 1 has started and rank 2 is still building (its
# ``rank-2.slow``), then waits to be killed.
RANKS_DRIVER = """
import asyncio, multiprocessing, sys
from pathlib import Path
from miles_events.bus.workers import start_in_process
from miles_events.transport.inprocess import InProcessTransport
from schemas.config import Config
from tests.test_workers import build_spawned

async def main():
    run_dir = Path(sys.argv[1])
    (run_dir / "rank-2.slow").touch()
    start = asyncio.ensure_future(start_in_process(build_spawned, 3, Config(), InProcessTransport("k"), run_dir,
                                                   own_processes=True, actor="trainer"))
    while len(multiprocessing.active_children()) < 2:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1)
    print(*(p.pid for p in multiprocessing.active_children()), flush=True)
    await start

asyncio.run(main())
"""


def test_a_driver_killed_with_kill_9_leaves_no_rank_process_behind(tmp_path):
    """Rank 1 serves calls; rank 2 is still building its object (it reads nothing from its
    driver then): both go with the driver."""
    driver = subprocess.Popen(
        [sys.executable, "-c", RANKS_DRIVER, str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    try:
        assert driver.stdout is not None
        ranks = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(ranks) == 2 and all(start_time(pid) is not None for pid in ranks)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert all(gone(pid, within=5) for pid in ranks), "a rank process outlived its driver"
    finally:
        driver.kill()


SERVER_LAUNCHER = """
import sys
from pathlib import Path
from actors.engine.server_process import ServerProcess, free_port
port = free_port()
# The server forks a child of its own: the whole group must go, not only its leader.
command = ["sh", "-c", f"sleep 300 & exec {sys.executable} -m http.server --bind 127.0.0.1 {port}"]
server = ServerProcess.start("engine-0", command, port=port, log_path=Path(sys.argv[1]) / "vllm" / "engine-0.log",
                             health_path="/", timeout=30)
target = Path(sys.argv[1]) / "targets" / "run-engine-0.json"
target.parent.mkdir()
target.write_text("[]")
server.record_file(target)
print(server.process.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_the_next_run_ends_the_servers_a_killed_launcher_left_running(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", SERVER_LAUNCHER, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    pgid = int(launcher.stdout.readline())
    record = tmp_path / "vllm" / "engine-0.processes.json"
    assert record.exists()
    launcher.kill()
    launcher.wait()
    time.sleep(0.2)
    os.killpg(pgid, 0)  # the server group outlives its launcher (a session of its own)
    assert clean_dead_run(tmp_path) >= 2, "the server and the child it forked"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server's process group is still there")
    assert not record.exists()
    assert not (tmp_path / "targets" / "run-engine-0.json").exists(), "its scrape target goes with it"
