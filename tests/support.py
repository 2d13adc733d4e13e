"""Test support: drive a sink the way a session does; read a run's output and processes.
(An actor is fed events with ``miles_events.bus.testing``.)"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

import msgspec

from miles_events.bus.clock import SYSTEM_CLOCK, ManualClock
from miles_events.bus.event_bus import EventBus
from miles_events.sinks.base import Sink, SinkContext, SinkHost
from schemas.config import Config
from schemas.events import Event, RankStep, RunStarted, TrainStepFinished

__all__ = [
    "cli_env",
    "cmdline",
    "drive_sink",
    "flip_byte",
    "not_console",
    "tiny_command",
    "torch_save_bytes",
    "with_ranks",
]

ROOT = Path(__file__).resolve().parents[1]


def tiny_command(run_dir: Path, *overrides: str) -> list[str]:
    """The CLI on ``examples/tiny.toml``, run in ``run_dir``, with each of ``overrides`` a ``--set``."""
    args = [sys.executable, "-m", "miles_events.run", str(ROOT / "examples" / "tiny.toml")]
    for override in (f'run.dir="{run_dir}"', *overrides):
        args += ["--set", override]
    return args


def cli_env(**extra: str) -> dict[str, str]:
    """The environment a test's CLI run gets: this checkout first on the path."""
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


CONSOLE_LINE = re.compile(
    r"(metrics: |run |initial |republication |weights republished |eval at |rollout |rollouts |checkpoint |"
    r"actor |weight version |the engines serve |publication evidence |events: |trainer: )"
)
"""How each line the plain console (and the CLI around it) prints to stdout begins."""


def not_console(stdout: str) -> list[str]:
    """The lines of a run's stdout that are not the plain console's."""
    return [line for line in stdout.splitlines() if not CONSOLE_LINE.match(line)]


def with_ranks(events: list[Event], ranks: int, sharding: str = "fsdp2") -> list[Event]:
    """``events`` as a trainer of ``ranks`` ranks would have reported them: rank r of rollout
    i took ``0.1 * (i + 1) + 0.01 * r`` seconds, peaked at ``400 + 10 * r`` MiB and held
    ``90 + r`` MiB of state."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, RunStarted):
            event = msgspec.structs.replace(event, trainer_ranks=ranks, trainer_sharding=sharding)
        elif isinstance(event, TrainStepFinished):
            reports = [
                RankStep(
                    rank=r,
                    pid=1000 + r,
                    step_seconds=0.1 * (event.rollout_id + 1) + 0.01 * r,
                    peak_memory_bytes=(400 + 10 * r) << 20,
                    state_bytes=(90 + r) << 20,
                )
                for r in range(ranks)
            ]
            event = msgspec.structs.replace(event, ranks=reports)
        out.append(event)
    return out


async def drive_sink(
    sink: Sink,
    events: list[Event],
    config: Config | None = None,
    run_dir: Path | None = None,
    settle: float = 0.0,
    run_id: str = "test-run",
    clock: ManualClock | None = None,
) -> SinkHost:
    """Run ``sink`` as a session does, over a real bus: start, every event (one loop turn
    each), ``settle`` seconds (on ``clock`` when given), drain, close. Returns its host
    (mailbox and task)."""
    config = config or Config()
    bus = EventBus(run_id, clock=clock or SYSTEM_CLOCK)

    async def fail(reason: str) -> None:
        raise AssertionError(f"the sink failed the run: {reason}")

    await sink.start(SinkContext(run_id, run_dir or Path("."), config, bus, fail))
    host = SinkHost(sink, bus, config.bus.max_batch)
    for event in events:
        await bus.publish(event)
        await asyncio.sleep(0)
    if settle:
        await (clock.advance(settle) if clock is not None else asyncio.sleep(settle))
    bus.close()
    await host.join()
    await sink.close()
    return host


def cmdline(pid: int) -> bytes:
    """The command line of process ``pid``; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def flip_byte(path: Path, offset: int, mask: int = 0x40) -> None:
    """Damage the file ``path``: flip the bits ``mask`` of its byte at ``offset``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def torch_save_bytes(obj: object) -> bytes:
    """``torch.save`` of ``obj`` into memory."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example_script(name: str) -> ModuleType:
    """The script ``examples/<name>.py``, imported as a module of that name."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
