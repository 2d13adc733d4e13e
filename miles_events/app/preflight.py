"""Before anything is written: every check of a run's input, from the config file to the
data it names and the memory the built-in model takes.

``load_and_check(path, overrides)`` is what ``python -m miles_events.run`` does before it
takes the run directory or starts anything: ``load_config`` (strict decoding and
``validate``), then ``check_input``. A problem raises one of ``INPUT_ERRORS`` with a message
of one line that names the key (the CLI's exit 2). What is checked here and not in
``validate`` reads files or asks the host, so a recorded config can be loaded anywhere:

- ``data.prompt_data`` and ``data.eval_data``, each when set, parsed as the actors will
  parse them (UTF-8 JSONL, one object with the input and label keys a line, at least one);
  with ``run.num_rollout`` unset, at least one whole rollout batch of prompts.
- The built-in model (``model.path`` unset): its parameters, in the float32 it is built in,
  must fit in the memory available now (``available_memory``). Only the weights are
  counted, so this refuses a shape that can never be built; a run takes several times that
  (each engine's copy, the trainer's copy with its gradients and optimizer state).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from miles_events.app.config import ConfigError, load_config
from miles_events.rl.model_size import builtin_build_bytes, builtin_parameter_count
from miles_events.rl.prompts import DataError, load_prompts, whole_batches_per_epoch
from schemas.config import Config

INPUT_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError)
"""What the checks raise for bad input; anything else is a bug."""

MEMINFO = Path("/proc/meminfo")


def available_memory() -> int | None:
    """Bytes the host can give a new allocation without swapping: Linux's ``MemAvailable``
    (``/proc/meminfo``), else the free physical pages (``os.sysconf``); None when neither is
    known. A container's own memory limit is not read."""
    try:
        for line in MEMINFO.read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.1f} GiB"


def check_builtin_fits(config: Config, available: int | None) -> None:
    """The built-in model's float32 parameters fit in ``available`` bytes (None: unknown,
    not checked)."""
    if config.model.path is not None or available is None:
        return
    builtin = config.model.builtin
    needed = builtin_build_bytes(builtin)
    if needed > available:
        raise ConfigError(
            f"model.builtin: {builtin_parameter_count(builtin):,} parameters (hidden_size {builtin.hidden_size}, "
            f"intermediate_size {builtin.intermediate_size}, num_hidden_layers {builtin.num_hidden_layers}) "
            f"take {_gib(needed)} in float32, more than the {_gib(available)} of memory available; "
            "choose smaller sizes or set model.path",
            key="model.builtin",
        )


def check_data(config: Config) -> None:
    """Every data file the actors read, read as they read it, and the loop bounds it sets."""
    data = config.data
    counts: dict[str, int] = {}
    for key, path in (("data.prompt_data", data.prompt_data), ("data.eval_data", data.eval_data)):
        if path:
            try:
                counts[key] = len(load_prompts(path, data.input_key, data.label_key))
            except DataError as error:
                raise DataError(f"{key}: {error}") from None
    if config.run.num_rollout is None:
        whole_batches_per_epoch(counts.get("data.prompt_data", 0), data.rollout_batch_size)


def check_input(config: Config) -> None:
    """The checks beyond ``validate``: the built-in model's memory, then the data files."""
    check_builtin_fits(config, available_memory())
    check_data(config)


def load_and_check(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Config:
    """The config of ``path`` with ``overrides``, checked as a run needs it; writes nothing."""
    config = load_config(path, overrides)
    check_input(config)
    return config
