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
- A rollout's estimated memory (``miles_events.rl.memory``: the batch, the engine's decode
  batch and the trainer's micro-batch, counted against host memory; on CUDA only the batch is) must fit
  in the memory available now.
- ``rollout.decode = "cuda_graph"`` and ``publisher.transport = "cuda_ipc"``: a GPU visible
  on this host (``cuda_present``), unless the run joins a cluster at ``ray.address``.
- ``generator.engine = "vllm"`` with servers launched from vLLM's CPU build: an attention
  head size that build serves (``actors.engine.vllm_cpu``).
- The built-in model (``model.path`` unset): its parameters, in the float32 it is built in,
  must fit in the memory available now (``available_memory``). Only the weights are
  counted, so this refuses a shape that can never be built; a run takes several times that
  (each engine's copy, the trainer's copy with its gradients and optimizer state).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_events.app.config import ConfigError, load_config
from miles_events.rl.memory import ModelShape, available_memory, cuda_present, rollout_memory
from miles_events.rl.model_size import builtin_build_bytes, builtin_parameter_count
from miles_events.rl.prompts import DataError, load_prompts, whole_batches_per_epoch
from schemas.config import Config

if TYPE_CHECKING:
    pass

INPUT_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError)
"""What the checks raise for bad input; anything else is a bug."""

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


def check_data(config: Config) -> int:
    """Every data file the actors read, read as they read it, and the loop bounds it sets;
    returns the UTF-8 bytes of the longest prompt (a bound on its tokens)."""
    data = config.data
    counts: dict[str, int] = {}
    longest = 1
    for key, path in (("data.prompt_data", data.prompt_data), ("data.eval_data", data.eval_data)):
        if path:
            try:
                prompts = load_prompts(path, data.input_key, data.label_key)
            except DataError as error:
                raise DataError(f"{key}: {error}") from None
            counts[key] = len(prompts)
            longest = max([longest, *(len(p.prompt.encode()) for p in prompts)])
    if config.run.num_rollout is None:
        whole_batches_per_epoch(counts.get("data.prompt_data", 0), data.rollout_batch_size)
    return longest


def check_rollout_fits(config: Config, available: int | None, longest_prompt: int) -> None:
    """A rollout's estimated memory (``miles_events.rl.memory``) fits in ``available``."""
    data, rollout = config.data, config.rollout
    if available is None:
        return
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.model.dtype]
    try:
        shape = (
            ModelShape.from_model_dir(config.model.path, dtype_bytes)
            if config.model.path is not None
            else ModelShape.from_builtin(config.model.builtin, dtype_bytes)
        )
    except (OSError, ValueError):
        return  # a model directory without a readable config.json: the engines will say so
    samples = data.rollout_batch_size * data.n_samples_per_prompt
    needed = rollout_memory(
        shape,
        samples=samples,
        prompt_tokens=longest_prompt,
        max_new_tokens=rollout.max_new_tokens,
        engine_batch=rollout.max_batch_size,
        micro_batch=config.trainer.micro_batch_size,
    ).host_bytes(on_gpu=cuda_present())  # the engines and the trainer run on the GPU then
    if needed > available:
        raise ConfigError(
            f"data.n_samples_per_prompt: a rollout of {samples:,} samples (data.rollout_batch_size "
            f"{data.rollout_batch_size} x data.n_samples_per_prompt {data.n_samples_per_prompt}) needs about "
            f"{_gib(needed)} of memory, more than the {_gib(available)} available: lower them (or "
            "rollout.max_batch_size, trainer.micro_batch_size)",
            key="data.n_samples_per_prompt",
        )


def check_device(config: Config) -> None:
    """``rollout.decode = "cuda_graph"`` needs a GPU where the engines run: this host, unless
    the run joins a cluster (``ray.address``), whose hosts are not asked."""
    if config.rollout.decode != "cuda_graph" or (config.ray.address is not None and config.run.runtime == "ray"):
        return
    if not cuda_present():
        raise ConfigError(
            'rollout.decode: "cuda_graph" needs a CUDA GPU, and this host has none visible; use "auto", '
            '"static" or "eager"',
            key="rollout.decode",
        )


def check_transport_device(config: Config) -> None:
    """``publisher.transport = "cuda_ipc"`` shares weights staged on a GPU: this host needs
    one, unless the run joins a cluster (``ray.address``), whose hosts are not asked.
    Without one every publication would go through shared memory instead."""
    if config.publisher.transport != "cuda_ipc" or (config.ray.address is not None and config.run.runtime == "ray"):
        return
    if not cuda_present():
        raise ConfigError(
            'publisher.transport: "cuda_ipc" needs a CUDA GPU, and this host has none visible (weights would '
            'go through shared memory instead); use "auto", "shm" or "disk"',
            key="publisher.transport",
        )


def check_vllm_head_size(config: Config) -> None:
    """``generator.engine = "vllm"`` with servers launched from vLLM's CPU build
    (``actors.engine.vllm_cpu``): the model's attention head size is one it has kernels for
    (a CPU server accepts another at start and fails at its first request). Servers at
    ``vllm.urls`` run a build this host does not know, and are not asked."""
    from actors.engine.vllm_cpu import (
        CPU_HEAD_SIZES,
        DEFAULT_PYTHON,
        model_head_size,
        servable_heads,
        serves_on_cpu,
    )

    vllm = config.vllm
    if config.generator.engine != "vllm" or vllm.urls:
        return
    if not serves_on_cpu(Path(vllm.python) if vllm.python else DEFAULT_PYTHON):
        return
    sizes = ", ".join(map(str, CPU_HEAD_SIZES))
    served = f'has no attention kernel in vLLM on CPU (generator.engine = "vllm"), which serves {sizes}'
    if config.model.path is not None:
        found = model_head_size(Path(config.model.path))
        if found is None or found[0] in CPU_HEAD_SIZES:
            return
        config_json = Path(config.model.path) / "config.json"
        raise ConfigError(
            f"model.path: {config_json} gives a head dimension of {found[0]} ({found[1]}), which {served}; "
            'serve another model, or use generator.engine = "torch"',
            key="model.path",
        )
    builtin = config.model.builtin
    hidden, heads, kv_heads = builtin.hidden_size, builtin.num_attention_heads, builtin.num_key_value_heads
    if hidden // heads in CPU_HEAD_SIZES:
        return
    fix_heads = servable_heads(hidden, heads)
    if fix_heads is None:
        fix = "choose a model.builtin.hidden_size that one of them divides"
    else:
        fix = f"set model.builtin.num_attention_heads = {fix_heads}"
        if fix_heads % kv_heads:
            fix += f" and model.builtin.num_key_value_heads = {math.gcd(fix_heads, kv_heads)}"
        fix += f" (head dimension {hidden // fix_heads})"
    raise ConfigError(
        f"model.builtin.num_attention_heads: a head dimension of {hidden // heads} (model.builtin.hidden_size "
        f"{hidden} / model.builtin.num_attention_heads {heads}) {served}; {fix}",
        key="model.builtin.num_attention_heads",
    )


def check_input(config: Config) -> None:
    """The checks beyond ``validate``: the engines' device, the built-in model's memory, then
    the data files."""
    check_device(config)
    check_transport_device(config)
    check_vllm_head_size(config)
    available = available_memory()
    check_builtin_fits(config, available)
    check_rollout_fits(config, available, check_data(config))


def load_and_check(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Config:
    """The config of ``path`` with ``overrides``, checked as a run needs it; writes nothing."""
    config = load_config(path, overrides)
    check_input(config)
    return config
