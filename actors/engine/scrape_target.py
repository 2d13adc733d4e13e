"""A server engine's Prometheus target: while the engine runs, a file_sd file naming its
server's ``/metrics`` with the labels the dashboard selects by (``run``, ``engine``,
``backend``), in ``metrics.engine_targets_dir``; removed when the engine closes.

Prometheus reads the directory with ``file_sd_configs`` (``grafana/prometheus.yml``, job
``inference-engines``), so the servers' own metrics (``vllm:*``, ``sglang:*``) land beside
the run's ``miles_*`` ones without a port being known in advance. The label the server
itself gives its series as ``engine`` (vLLM's engine index) is overridden by the target's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit


def target_path(directory: str | os.PathLike[str], run_id: str, engine: str) -> Path:
    return Path(directory) / f"{run_id}-{engine}.json"


def write_target(
    directory: str | os.PathLike[str], *, run_id: str, engine: str, backend: str, metrics_url: str
) -> Path:
    """Write (atomically) the target of one engine's server; returns the file's path."""
    address = urlsplit(metrics_url)
    if not address.hostname or not address.port:
        raise ValueError(f"{engine}: cannot scrape {metrics_url!r}: it names no host and port")
    path = target_path(directory, run_id, engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        "targets": [f"{address.hostname}:{address.port}"],
        "labels": {"run": run_id, "engine": engine, "backend": backend},
    }
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps([entry], indent=1) + "\n")
    os.replace(partial, path)
    return path


def remove_target(path: Path) -> None:
    path.unlink(missing_ok=True)
