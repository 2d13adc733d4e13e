"""Before anything is written: every check of a run's input, from the config file to the
data it names and the memory the built-in model takes.

``load_and_check(path, overrides)`` is what ``python -m miles_events.run`` does before it
takes the run directory or starts anything: ``load_config`` (strict decoding and
``validate``), then ``check_input``. A problem raises one of ``INPUT_ERRORS`` with a message
of one line that names the key (the CLI's exit 2). What is checked here and not in
``validate`` reads files or asks the host, so a recorded config can be loaded anywhere:

- ``data.prompt_data`` and ``data.eval_data``, each when set, parsed as the actors will
  parse them (UTF-8 JSONL, one object with the input and label keys a line, at least one;
  the input a string or a number, never null, a chat-message list or an object; no lone
  surrogate in the input or the label); with ``run.num_rollout`` unset, at least one whole
  rollout batch of prompts.
- ``data.n_samples_per_prompt`` at least 2 where the run trains: GRPO's advantage (with or
  without ``trainer.normalize_advantage_std``) is 0 in a group of one.
- ``model.path``, when set, as the actors load it (``miles_events.rl.model_dir``): the
  directory, ``config.json`` naming an architecture transformers has as a causal LM, the
  tokenizer (tokenizer files there, ``AutoTokenizer`` from local files), and every
  safetensors file's header, its tensors covering the file (``safe_open``). No weights are
  loaded.
- Every prompt encodes to at least one token with the run's tokenizer (``model.path``'s,
  or the built-in model's as the actors load it from its directory), and
  ``rollout.max_new_tokens`` after the longest prompt fits in the model's
  ``max_position_embeddings``. These and the ``model.path`` checks need transformers: on
  the local runtime they run in this process, which imports it for the run anyway; on ray
  in a child process, as the driver of a ray run imports neither torch nor transformers.
  The built-in tokenizer is saved with its config into a temporary directory (removed at
  once) to load it as the actors do: nothing of the run's is written.
- ``rollout.reward_fn`` takes ``(prompt, response, label)`` and scores the first prompt,
  with its label as the response, as a finite real number, within
  ``REWARD_CHECK_SECONDS``; a raising one is named with its exception.
- A rollout's estimated memory (``miles_events.app.memory``: the batch, the engine's decode
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

import inspect
import math
import numbers
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from miles_events.app.config import ConfigError, check_megatron_model, load_config
from miles_events.app.memory import ModelShape, available_memory, cuda_present, rollout_memory
from miles_events.rl.gguf import GgufError, converted_dir, find_gguf, is_converted, resolve_gguf
from miles_events.rl.lr_schedule import LrSchedule, ScheduleError
from miles_events.rl.model_dir import ModelDir, ModelDirError, inspect_model_dir
from miles_events.rl.model_size import DTYPE_BYTES, builtin_build_bytes, builtin_parameter_count
from miles_events.rl.prompts import ChatTemplate, DataError, Prompt, load_prompts, whole_batches_per_epoch
from miles_events.rl.rewards import reward_of, takes_row
from miles_events.util.registry import load_function
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


def read_data(config: Config, template: ChatTemplate | None = None) -> dict[str, tuple[str, list[Prompt]]]:
    """Every data file the actors read, read as they read it: ``{key: (path, prompts)}``
    (chats rendered with ``template``, the run's tokenizer's, where given)."""
    data = config.data
    read: dict[str, tuple[str, list[Prompt]]] = {}
    for key, path in (("data.prompt_data", data.prompt_data), ("data.eval_data", data.eval_data)):
        if path:
            try:
                read[key] = (
                    path,
                    load_prompts(
                        path, data.input_key, data.label_key, chat=data.apply_chat_template, template=template
                    ),
                )
            except DataError as error:
                raise DataError(f"{key}: {error}") from None
    return read


def check_data(config: Config, read: dict[str, tuple[str, list[Prompt]]] | None = None) -> int:
    """Every data file the actors read (``read_data``, unless given), and the loop bounds it
    sets; returns the UTF-8 bytes of the longest prompt (a bound on its tokens)."""
    read = read_data(config) if read is None else read
    longest = max([1, *(len(p.prompt.encode()) for _, prompts in read.values() for p in prompts)])
    if config.run.num_rollout is None:
        num_prompts = len(read["data.prompt_data"][1]) if "data.prompt_data" in read else 0
        whole_batches_per_epoch(num_prompts, config.data.rollout_batch_size)
    return longest


def check_group_size(config: Config) -> None:
    """More than one sample per prompt where the run trains: GRPO's advantage (the trainer's
    only estimator, with or without ``trainer.normalize_advantage_std``) is a sample's reward
    less its group's mean, always 0 in a group of one."""
    trains = not config.run.rollout_only_from_checkpoint and config.run.num_rollout != 0
    if trains and config.data.n_samples_per_prompt == 1:
        raise ConfigError(
            "data.n_samples_per_prompt: 1 sample per prompt trains nothing: GRPO's advantage is a sample's "
            "reward less the mean of its prompt's group, 0 in a group of one; sample at least 2",
            key="data.n_samples_per_prompt",
        )


def check_model_path(config: Config) -> ModelDir | None:
    """``model.path``, when set, loads as the actors load it (``miles_events.rl.model_dir``:
    its config, tokenizer and safetensors headers, not its weights); returns its tokenizer
    and positions."""
    if config.model.path is None:
        return None
    try:
        return inspect_model_dir(config.model.path)
    except ModelDirError as error:
        raise ConfigError(f"model.path: {error}", key="model.path") from None


def _shown(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def check_chat_template(config: Config, model: ModelDir | None) -> ChatTemplate | None:
    """With ``data.apply_chat_template``, the run's tokenizer's chat template (an error where
    it has none)."""
    if not config.data.apply_chat_template:
        return None
    from miles_events.rl.hf_model import NoChatTemplate, builtin_tokenizer, chat_template

    tokenizer = builtin_tokenizer(config.model.builtin) if model is None else model.tokenizer
    whose = "the built-in model's tokenizer" if model is None else f"the tokenizer of {config.model.path}"
    try:
        return chat_template(tokenizer)
    except NoChatTemplate:
        raise ConfigError(
            f"data.apply_chat_template: {whose} has no chat template; give the prompts as text and turn it off",
            key="data.apply_chat_template",
        ) from None


def check_prompts(config: Config, read: dict[str, tuple[str, list[Prompt]]], model: ModelDir | None) -> None:
    """Every prompt encodes to at least one token with the run's tokenizer (``model`` from
    ``check_model_path``, else the built-in model's, as the actors load it), and the longest
    leaves room for ``rollout.max_new_tokens`` within the model's positions."""
    if not read:
        return
    if model is None:
        from miles_events.rl.hf_model import builtin_tokenizer

        tokenizer = builtin_tokenizer(config.model.builtin)
        whose = "the built-in model's tokenizer"
        positions: int | None = config.model.builtin.max_position_embeddings
        positions_key = "model.builtin.max_position_embeddings"
    else:
        tokenizer, whose = model.tokenizer, f"the tokenizer of {config.model.path}"
        positions = model.max_positions
        positions_key = f"max_position_embeddings of {os.path.join(str(config.model.path), 'config.json')}"
    longest = (0, "", "", 0)  # tokens, key, path, line
    for key, (path, prompts) in read.items():
        try:
            # A rendered chat carries the template's own special tokens; text gets the tokenizer's.
            special = not config.data.apply_chat_template
            encoded = tokenizer([p.prompt for p in prompts], add_special_tokens=special)["input_ids"]
        except Exception as error:  # the user's text and the user's tokenizer
            raise DataError(
                f"{key}: {path}: {whose} cannot encode its prompts ({type(error).__name__}: {error})"
            ) from None
        for prompt, ids in zip(prompts, encoded, strict=True):
            if not ids:
                raise DataError(
                    f"{key}: {path}:{prompt.line}: the prompt {_shown(prompt.prompt)} has no tokens with {whose}"
                )
            if len(ids) > longest[0]:
                longest = (len(ids), key, path, prompt.line)
    tokens, key, path, line = longest
    new = config.rollout.max_new_tokens
    if positions is not None and tokens + new > positions:
        raise ConfigError(
            f"rollout.max_new_tokens: {new} after the longest prompt ({tokens} tokens, {key} {path}:{line}) make "
            f"{tokens + new} tokens, more than the model's {positions} positions ({positions_key}); "
            + (
                f"lower rollout.max_new_tokens to {positions - tokens} or less"
                if tokens < positions
                else "the prompt alone fills them"
            ),
            key="rollout.max_new_tokens",
        )


REWARD_CHECK_SECONDS = 60.0
"""How long the reward function may take to score the first sample."""


def _real(value: object) -> float | None:
    """``value`` as a float where it is a real number (a bool, an int, a float, a numpy or
    torch scalar), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def check_reward_fn(config: Config, read: dict[str, tuple[str, list[Prompt]]]) -> None:
    """``rollout.reward_fn`` takes ``(prompt, response, label)`` and scores the first prompt
    of the data, with its label as the response (a right answer), as a finite real number
    within ``REWARD_CHECK_SECONDS``."""
    if not read:
        return
    name = config.rollout.reward_fn
    reward_fn = load_function(name)
    key, (path, prompts) = next(iter(read.items()))
    first = prompts[0]
    try:
        signature = inspect.signature(reward_fn)
    except (TypeError, ValueError):  # a builtin or an object that does not say
        signature = None
    if signature is not None:
        try:
            if takes_row(reward_fn):
                signature.bind(first.prompt, first.label, first.label, row=first.row)
            else:
                signature.bind(first.prompt, first.label, first.label)
        except TypeError:
            takes = ", ".join(
                str(p.replace(annotation=p.empty, default=p.empty)) for p in signature.parameters.values()
            )
            raise ConfigError(
                f"rollout.reward_fn: {name} takes ({takes}), not (prompt, response, label) or (prompt, response, label, *, row)",
                key="rollout.reward_fn",
            ) from None
    where = f"on the first prompt of {key} ({path}:{first.line}) with its label as the response"
    outcome: list[tuple[str, object]] = []

    def score() -> None:
        try:
            outcome.append(
                ("returned", reward_of(reward_fn, first.prompt, first.label, first.label, first.row))
            )
        except BaseException as error:  # SystemExit too: this thread's end, not the process's
            outcome.append(("raised", error))

    thread = threading.Thread(target=score, name="reward-check", daemon=True)
    thread.start()
    thread.join(REWARD_CHECK_SECONDS)
    if not outcome:
        raise ConfigError(
            f"rollout.reward_fn: {name} did not return within {REWARD_CHECK_SECONDS:g} s {where}",
            key="rollout.reward_fn",
        )
    how, value = outcome[0]
    if how == "raised":
        lines = str(value).strip().splitlines()
        raised = f"{type(value).__name__}: {lines[0]}" if lines else type(value).__name__
        raise ConfigError(f"rollout.reward_fn: {name} raised {raised}, {where}", key="rollout.reward_fn")
    real = _real(value)
    if real is None:
        raise ConfigError(
            f"rollout.reward_fn: {name} returned {_shown(str(value)) if isinstance(value, str) else _shown(repr(value))}"
            f" (a {type(value).__name__}), not a number, {where}",
            key="rollout.reward_fn",
        )
    if not math.isfinite(real):
        raise ConfigError(
            f"rollout.reward_fn: {name} returned {real}, not a finite number, {where}",
            key="rollout.reward_fn",
        )


def check_rollout_fits(config: Config, available: int | None, longest_prompt: int) -> None:
    """A rollout's estimated memory (``miles_events.app.memory``) fits in ``available``."""
    data, rollout = config.data, config.rollout
    if available is None:
        return
    dtype_bytes = DTYPE_BYTES[config.model.dtype]
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


def gpu_settings(config: Config) -> list[tuple[str, str]]:
    """The settings of ``config`` that need a CUDA GPU where the actors run, each as its key
    and the line that says so and what to use instead."""
    needs: list[tuple[str, str]] = []
    if config.rollout.decode == "cuda_graph":
        needs.append(
            (
                "rollout.decode",
                '"cuda_graph" needs a CUDA GPU, and this host has none visible; use "auto", "static" or "eager"',
            )
        )
    if config.publisher.transport == "cuda_ipc":
        needs.append((
            "publisher.transport",
            '"cuda_ipc" needs a CUDA GPU, and this host has none visible (weights would go through shared '
            'memory instead); use "auto", "shm" or "disk"',
        ))  # fmt: skip
    if config.trainer.backend == "megatron" and config.megatron.transformer_impl == "transformer_engine":
        needs.append((
            "megatron.transformer_impl",
            '"transformer_engine" needs a CUDA GPU, and this host has none visible; use "local" (or "auto")',
        ))  # fmt: skip
    if config.trainer.backend == "megatron" and config.trainer.autocast == "bfloat16":
        needs.append((
            "trainer.autocast",
            '"bfloat16" with the megatron trainer backend needs a CUDA GPU (its linear layers keep '
            "autocast through their backward on CUDA only), and this host has none visible; use \"off\", "
            'or model.dtype = "bfloat16"',
        ))  # fmt: skip
    if config.trainer.gpus_per_rank > 0:
        needs.append((
            "trainer.gpus_per_rank",
            f"{config.trainer.gpus_per_rank:g} needs a CUDA GPU for each trainer rank, and this host has none "
            "visible; use 0 (the ranks train on the CPU, over gloo)",
        ))  # fmt: skip
    return needs


def check_device(config: Config) -> None:
    """``rollout.decode = "cuda_graph"`` and ``publisher.transport = "cuda_ipc"`` need a GPU
    where the actors run: this host, unless the run joins a cluster (``ray.address``), whose
    hosts are not asked."""
    if config.ray.address is not None and config.run.runtime == "ray":
        return
    needs = gpu_settings(config)
    if needs and not cuda_present():
        key, why = needs[0]
        raise ConfigError(f"{key}: {why}", key=key)


def check_vllm_offload(config: Config) -> None:
    """``run.offload_rollout`` with vLLM servers launched from its CPU build: refused, since
    vLLM on CPU refuses sleep mode (``--enable-sleep-mode``), which releasing an engine's
    memory needs."""
    from actors.engine.vllm_cpu import DEFAULT_PYTHON, serves_on_cpu

    vllm = config.vllm
    if not config.run.offload_rollout or config.generator.engine != "vllm" or vllm.urls:
        return
    if serves_on_cpu(Path(vllm.python) if vllm.python else DEFAULT_PYTHON):
        raise ConfigError(
            "run.offload_rollout: vLLM on CPU has no sleep mode, which releasing an engine's memory needs "
            '(generator.engine = "vllm"); leave it off, or use generator.engine = "torch"',
            key="run.offload_rollout",
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


MODEL_CHECK_SECONDS = 300.0
"""How long the model directory's and the prompts' checks may take in their own process."""

REPO_ROOT = Path(__file__).resolve().parents[2]


class _Outcome(msgspec.Struct):
    """What the checks in a child process found: nothing, or the error to raise here."""

    kind: Literal["config", "data"] | None = None
    message: str = ""
    key: str | None = None


def check_model_and_prompts(config: Config, read: dict[str, tuple[str, list[Prompt]]]) -> None:
    """``check_model_path`` then ``check_prompts``, which need transformers (and with it
    torch): in this process on the local runtime, whose run imports them anyway, else in a
    child process (the driver of a ray run imports neither), the same checks with the same
    one-line errors."""
    if config.run.runtime == "local":
        model = check_model_path(config)
        template = check_chat_template(config, model)
        check_prompts(config, read if template is None else read_data(config, template), model)
        return
    code = "from miles_events.app.preflight import model_checks_child; model_checks_child()"
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            input=msgspec.msgpack.encode(config),
            capture_output=True,
            timeout=MODEL_CHECK_SECONDS,
            env={**os.environ, "PYTHONPATH": python_path},
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DataError(
            f"data.prompt_data: the model directory and the prompts' tokens were not checked within "
            f"{MODEL_CHECK_SECONDS:g} s"
        ) from None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or not lines:
        stderr = done.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError(
            f"the model checks' process exited {done.returncode}: {stderr[-1] if stderr else ''}"
        )
    outcome = msgspec.json.decode(lines[-1], type=_Outcome)
    if outcome.kind == "config":
        raise ConfigError(outcome.message, key=outcome.key)
    if outcome.kind == "data":
        raise DataError(outcome.message)


def model_checks_child() -> None:
    """The child process of ``check_model_and_prompts``: the config (msgpack) on stdin, the
    ``_Outcome`` (JSON) as the last line of stdout."""
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=Config)
    try:
        model = check_model_path(config)
        check_prompts(config, read_data(config, check_chat_template(config, model)), model)
        outcome = _Outcome()
    except ConfigError as error:
        outcome = _Outcome(kind="config", message=str(error), key=error.key)
    except DataError as error:
        outcome = _Outcome(kind="data", message=str(error))
    sys.stdout.buffer.write(b"\n" + msgspec.json.encode(outcome) + b"\n")
    sys.stdout.flush()


def check_lr_schedule(config: Config) -> None:
    """The learning-rate schedule can be followed (``miles_events.rl.lr_schedule``)."""
    try:
        LrSchedule.of(config)
    except ScheduleError as error:
        raise ConfigError(str(error), key=str(error).partition(":")[0]) from None


def check_input(config: Config) -> None:
    """The checks beyond ``validate``: the engines' device, the group size, the built-in
    model's memory, the data files, the model directory, the prompts with the run's
    tokenizer, the reward function, then a rollout's memory."""
    check_device(config)
    check_megatron_model(config)
    check_vllm_head_size(config)
    check_vllm_offload(config)
    check_group_size(config)
    check_lr_schedule(config)
    available = available_memory()
    check_builtin_fits(config, available)
    read = read_data(config)
    longest = check_data(config, read)
    check_model_and_prompts(config, read)
    check_reward_fn(config, read)
    check_rollout_fits(config, available, longest)


def resolve_model_source(config: Config) -> Config:
    """The config with ``model.gguf`` resolved: its converted checkpoint (``miles_events.rl.
    gguf``, converted into ``model.cache_dir`` where it is not there yet) as ``model.path``."""
    model = config.model
    if model.gguf is None:
        return config
    try:
        target = converted_dir(find_gguf(model.gguf), model.cache_dir)
        if not is_converted(target):
            print(f"model.gguf: converting {model.gguf} into {target} (once)", file=sys.stderr, flush=True)
        path = resolve_gguf(model.gguf, model.cache_dir)
    except GgufError as error:
        raise ConfigError(f"model.gguf: {error}", key="model.gguf") from None
    return msgspec.structs.replace(config, model=msgspec.structs.replace(model, path=str(path), gguf=None))


def load_and_check(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Config:
    """The config of ``path`` with ``overrides``, checked as a run needs it; writes nothing."""
    config = resolve_model_source(load_config(path, overrides))
    check_input(config)
    return config
