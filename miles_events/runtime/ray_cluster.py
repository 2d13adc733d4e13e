"""Ray itself for one run: the run's own one-host cluster, started lean on a thread of its
own as soon as the run knows what it will place (while the driver plans the run), or the
cluster at ``ray.address``, joined.

Lean: neither Ray's API server nor its autoscaler monitor (a fixed one-host cluster uses
neither); the raylet's two agents (dashboard, runtime env) stood in for by idle processes
unless ``ray.agents = "ray"``; a worker prestarted per CPU only when each will host one of the run's actors, and
then with what the actors' processes import (``Actor.process_modules``: torch with their
backends, the model's transformers module) imported before any actor is asked for; glibc's
arenas capped; and a teardown that kills what Ray leaves rather than waiting on its
graceful timeouts (the actors have stopped by then).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.machinery
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from miles_events.bus.actor import Actor
from miles_events.runtime.leftovers import kill_alive, ray_processes
from miles_events.runtime.malloc import MALLOC_ARENAS
from schemas.config import RayConfig

logger = logging.getLogger(__name__)


UNUSED_HEAD_SERVICES = ("start_api_server", "start_monitor")
"""What a Ray head starts that a run's own one-host cluster never uses: the API server (with
``include_dashboard=False`` still a process, serving usage stats, which the run turns off)
and the autoscaler's monitor (a fixed cluster never scales). Each is a Python process of
its own; ``ray.init`` waits for the API server to come up, and ``ray.shutdown`` for it
to go (it outlives its SIGTERM)."""


AGENT_STAND_IN = ("/bin/sh", "-c", "exec cat >/dev/null")
"""What the raylet runs in place of each of its two agents (``ray.agents = "stand_in"``): a
process that lives exactly as long as the raylet (it reads the pipe the raylet gives each
agent as its stdin, which closes when the raylet goes) and offers no service. The raylet
fate-shares with its agents, so one must run; the ports they would serve are reported as
-1 ("not in use", as Ray's own minimal dashboard agent reports its metrics ports) before
the raylet starts, in the files the raylet waits for."""

AGENT_COMMAND_FLAGS = ("--dashboard_agent_command=", "--runtime_env_agent_command=")

AGENT_PIPE_SETTING = "RAY_enable_pipe_based_agent_to_parent_health_check"
"""Ray's setting that gives each agent the raylet's pipe as its stdin (on by default); the
stand-in lives on that pipe, so with it off Ray's own agents run."""


def stands_in_for_agents(ray_config: RayConfig) -> bool:
    """Whether the run's own cluster runs ``AGENT_STAND_IN`` for the raylet's agents."""
    if ray_config.agents != "stand_in":
        return False
    if os.environ.get(AGENT_PIPE_SETTING, "1").strip().lower() in ("0", "false"):
        logger.warning(
            "%s is off: the raylet's agents are Ray's own (ray.agents = \"stand_in\" needs it)",
            AGENT_PIPE_SETTING,
        )
        return False
    return True


def _agents_stood_in(command: list[str]) -> list[str]:
    """The raylet's ``command`` with its agents replaced by ``AGENT_STAND_IN``, their ports
    reported as not in use (in Ray's own port files, by Ray's own function)."""
    # Ray's _raylet.pyi declares a few of the compiled module's names, not these.
    from ray._raylet import (  # type: ignore[attr-defined]
        DASHBOARD_AGENT_LISTEN_PORT_NAME,
        METRICS_AGENT_PORT_NAME,
        METRICS_EXPORT_PORT_NAME,
        RUNTIME_ENV_AGENT_PORT_NAME,
        persist_port,
    )

    flags = dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)
    for port in (
        METRICS_AGENT_PORT_NAME,
        METRICS_EXPORT_PORT_NAME,
        DASHBOARD_AGENT_LISTEN_PORT_NAME,
        RUNTIME_ENV_AGENT_PORT_NAME,
    ):
        persist_port(flags["session_dir"], flags["node_id"], port, -1)
    stand_in = subprocess.list2cmdline(AGENT_STAND_IN)
    return [
        next((flag + stand_in for flag in AGENT_COMMAND_FLAGS if arg.startswith(flag)), arg)
        for arg in command
    ]


@contextlib.contextmanager
def _lean_head(stand_in_agents: bool) -> Iterator[None]:
    """While ``ray.init`` starts a local cluster: skip ``UNUSED_HEAD_SERVICES`` (where this
    Ray has them) and, with ``stand_in_agents``, start the raylet with ``AGENT_STAND_IN`` for
    its agents; drop two of Ray's warnings: that, started from a thread, it leaves SIGTERM
    alone (the driver's own handler stays, which is what the run wants), and that it turned
    token authentication on (it stays on; nothing is asked of the user)."""
    from ray._private import ray_constants, services
    from ray._private.node import Node

    saved = {name: Node.__dict__[name] for name in UNUSED_HEAD_SERVICES if name in Node.__dict__}
    for name in saved:
        setattr(Node, name, lambda self, *args, **kwargs: None)
    start_ray_process = services.start_ray_process

    def start_without_agents(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == ray_constants.PROCESS_TYPE_RAYLET:
            command = _agents_stood_in(command)
        return start_ray_process(command, process_type, *args, **kwargs)

    if stand_in_agents:
        services.start_ray_process = start_without_agents
    quiet = {
        logging.getLogger("ray._private.worker"): _DropMessage("SIGTERM handler is not set"),
        logging.getLogger("ray._private.authentication.authentication_token_setup"): _DropMessage(
            "Token authentication is enabled"
        ),
    }
    for ray_logger, drop in quiet.items():
        ray_logger.addFilter(drop)
    try:
        yield
    finally:
        services.start_ray_process = start_ray_process
        for ray_logger, drop in quiet.items():
            ray_logger.removeFilter(drop)
        for name, method in saved.items():
            setattr(Node, name, method)


ARENAS_MARK = "MILES_EVENTS_SET_MALLOC_ARENA_MAX"
"""Marks ``MALLOC_ARENA_MAX`` as the runtime's, not the user's: an actor process drops both
(``RemoteActorHost``), so what it starts in turn (an inference server) has glibc's default."""


@contextlib.contextmanager
def _cluster_environment() -> Iterator[None]:
    """The environment Ray's servers start with (the workers they start inherit it); the
    driver's own is as it was once they have started."""
    added = (
        {} if "MALLOC_ARENA_MAX" in os.environ else {"MALLOC_ARENA_MAX": str(MALLOC_ARENAS), ARENAS_MARK: "1"}
    )
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def join_the_drivers_log() -> None:
    """What Ray says in the driver goes where the driver's log lines go: the run's log, and
    the terminal only when ``--log-level`` asks. Its ``ray`` logger writes to stderr itself,
    and the messages its cluster sends the driver (a worker that died, with how and why) are
    printed to stdout by a thread of Ray's; both are logged instead, at WARNING."""
    from ray._private import worker

    ray_logger = logging.getLogger("ray")
    for handler in list(ray_logger.handlers):
        if type(handler).__name__ == "PlainRayHandler":
            ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    if hasattr(worker, "print_to_stdstream"):
        worker.print_to_stdstream = _log_cluster_message


def _log_cluster_message(data: dict[str, Any], ignore_prefix: bool = False) -> None:
    for line in data.get("lines", ()):
        logger.warning("ray (%s): %s", data.get("pid", "?"), line)


def importable_by_workers(module: str) -> bool:
    """Whether a Ray worker can import ``module`` before it is given a job: its package is
    installed (or on the path) for this interpreter, not found only in the driver's working
    directory, which a prestarted worker does not have on its path yet."""
    top = module.partition(".")[0]
    here = {"", os.getcwd()}
    if importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if p not in here]) is not None:
        return True
    others = [f for f in sys.meta_path if f is not importlib.machinery.PathFinder and hasattr(f, "find_spec")]
    return any(f.find_spec(top, None) is not None for f in others)


class RayCluster:
    """Ray for one run, started on a thread of its own (``start``) so that the driver goes
    on meanwhile: the run's own cluster where ``ray.address`` is unset, sized for
    ``bundles`` (the CPUs and GPUs the run's placement groups ask for) and for ``remote``
    (the actor classes that get processes), else the cluster at that address, joined.

    The thread stays until ``shutdown``: the servers Ray starts are tied to the thread that
    started them (Ray fate-shares them with it: they are killed when it ends).
    """

    def __init__(
        self,
        ray_config: RayConfig,
        bundles: list[dict[str, float]],
        remote: list[type[Actor]],
        modules: list[str] | None = None,
    ) -> None:
        """``modules``: what a prestarted worker imports before it is given an actor (the
        remote actors' ``process_modules``); None: each remote actor's own module."""
        self.ray_config = ray_config
        self.own = ray_config.address is None
        needed = math.ceil(sum(b.get("CPU", 0.0) for b in bundles))
        self.num_cpus = ray_config.num_cpus or max(needed, os.cpu_count() or 1)
        self.num_gpus = math.ceil(sum(b.get("GPU", 0.0) for b in bundles))
        # Ray can start a worker per CPU ahead of any actor: worth it only while each will
        # host one of the run's actors (beyond that they idle), and then as soon as the
        # raylet is up, each importing the actors' modules before it is given one.
        self.prestart = self.num_cpus <= len(remote)
        wanted = [cls.__module__ for cls in remote] if modules is None else modules
        self.preload = sorted({module for module in wanted if importable_by_workers(module)})
        self.up: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._released = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_here = False

    def fits(self, bundles: list[dict[str, float]]) -> bool:
        """Whether this cluster (as sized) holds ``bundles``: a joined one is taken as it is."""
        if not self.own:
            return True
        cpus = math.ceil(sum(b.get("CPU", 0.0) for b in bundles))
        gpus = math.ceil(sum(b.get("GPU", 0.0) for b in bundles))
        return cpus <= self.num_cpus and gpus <= self.num_gpus

    def start(self) -> RayCluster:
        if self._thread is not None:
            return self
        self.up.set_running_or_notify_cancel()

        def run() -> None:
            try:
                self._init()
            except BaseException as error:
                self.up.set_exception(error)
                return
            self.up.set_result(None)
            self._released.wait()

        self._thread = threading.Thread(target=run, name="ray-init", daemon=True)
        self._thread.start()
        return self

    def _init(self) -> None:
        import ray

        if ray.is_initialized():
            return
        join_the_drivers_log()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Ray's processes keep what they print (the actors' and Ray's own, a dead worker's
        # report among them) in their logs in Ray's session directory; the actors log into
        # the run's log (miles_events.runtime.run_log).
        kwargs: dict[str, Any] = dict(
            include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
        )
        if not self.own:
            ray.init(address=self.ray_config.address, **kwargs)
            return
        kwargs["num_cpus"] = self.num_cpus
        if self.num_gpus:
            kwargs["num_gpus"] = self.num_gpus
        system_config: dict[str, Any] = {
            "prestart_worker_first_driver": False,
            "enable_worker_prestart": self.prestart,
        }
        if self.prestart and self.preload:
            system_config["preload_python_modules"] = self.preload
        kwargs["_system_config"] = system_config
        kwargs["_node_ip_address"] = "127.0.0.1"
        # A cluster of this host only: every Ray server (GCS, raylet, agents, workers)
        # binds the loopback address, not every interface. Ray takes the node address
        # from the loopback only when it believes clusters are disabled; the variable
        # reaches the processes it starts, the constant this one.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
        began = time.monotonic()
        with _lean_head(stands_in_for_agents(self.ray_config)), _cluster_environment():
            ray.init(**kwargs)
        self.started_here = True
        logger.info("local ray cluster (%d CPUs) up in %.1fs", self.num_cpus, time.monotonic() - began)

    def shutdown(self) -> None:
        """End the run's own cluster (once it is up, if it is still starting); a joined one
        outlives the run. What Ray leaves behind is killed, not waited on."""
        if self._thread is None:
            return
        concurrent.futures.wait([self.up])
        try:
            import ray

            if self.started_here and ray.is_initialized():
                began = time.monotonic()
                started = ray_processes()
                ray.shutdown()
                killed = kill_alive(started)
                self.started_here = False
                logger.info(
                    "local ray cluster shut down in %.1fs (%d processes killed after)",
                    time.monotonic() - began,
                    killed,
                )
        finally:
            self._released.set()
