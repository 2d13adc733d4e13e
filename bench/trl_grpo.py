"""The TRL arm of ``bench/trl_side_by_side.py``: TRL's ``GRPOTrainer`` on a run config's task.

    .venv-trl/bin/python bench/trl_grpo.py --config examples/tiny.toml --out trl.json \
        [--set run.seed=2 --set run.num_rollout=50 ...] [--work-dir DIR] [--threads N]

Runs under ``.venv-trl`` (``bash .ci/setup-trl``: TRL layered over the project's ``.venv``,
so torch, transformers and ``miles_events`` are the project's own). Everything the task is
made of comes from the project, read from the same TOML (and ``--set`` overrides) through
``miles_events.app.config.load_config``:

- the model and tokenizer: ``prepare_base_model`` writes the directory a run's actors load
  (the built-in model from ``[model.builtin]`` and ``run.seed``, or ``model.path``), and
  they are loaded from it with ``load_model`` / ``load_tokenizer``, as the actors do;
- the prompts: ``rollout_prompts(prompts, k, rollout_batch_size, seed, rollout_shuffle)``
  for every rollout ``k``, concatenated in that order (``shuffle_dataset=False``): TRL's
  rollout ``k`` gets the prompts the run's rollout ``k`` gets, as the text the run's engines
  get (chats rendered with the model's chat template where ``data.apply_chat_template``;
  ``model.gguf`` converted as a run converts it); TRL tokenizes them as the project's engine does (``add_special_tokens=True``, checked
  on the first batch) and decodes completions without special tokens, as the engine does;
- the reward: ``rollout.reward_fn`` (``exact_match`` in the embedded default), one call per
  completion with (prompt, completion, label), and the data row where it takes one;
- the GRPO settings: ``n_samples_per_prompt`` generations, ``rollout_batch_size`` prompts
  per generation, optimizer steps of ``trainer.global_batch_size`` samples (4 of 1024 per
  rollout of 4096), one pass (``num_iterations=1``), ``loss_type="bnpo"`` (a token mean per
  optimizer step, as the project's trainer), no KL (``beta=0``), the config's learning
  rate and its schedule (``trainer.lr_warmup_steps``, ``lr_decay_style``: transformers'
  ``constant_with_warmup``, ``linear`` or ``cosine_with_min_lr``; a schedule they cannot
  follow exactly is refused), clip range, gradient clipping, Adam settings and weight decay,
  float32, no gradient checkpointing, ``rollout.max_new_tokens``, temperature and top-p
  from the config, top-k off. ``max_steps`` is 4 per rollout; no saving, no reporting;
- the eval: the run's (``HeldOutEval``), at the same rollouts, in a callback, with
  ``model.generate``; TRL's own eval loop is off (``eval_strategy="no"``).

Measured per rollout (one generation of 4096 completions and its 4 optimizer steps):
``start`` (when ``_generate_and_score_completions`` is entered), ``generate_seconds`` (that
call, less the old-log-probability pass it makes, which the project's trainer counts as
training), ``sample_seconds`` (``_generate``: tokenize, ``model.generate``, decode),
``old_logprob_seconds``, ``train_seconds`` (from the end of the generation call to the end
of the 4th optimizer step, plus the old-log-probability pass), ``end``, and the rewards the
reward function returned; per eval: ``rollout_id`` (the rollout after which it ran; 0 for
the one before training), ``start``, ``seconds``, ``accuracy``, ``reward_mean``. Times are
``time.time()``; written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the project, also without .venv's editable install

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch
import transformers
import trl
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from actors.coordinator import should_run_periodic_action
from miles_events.app.config import load_config
from miles_events.app.preflight import resolve_model_source
from miles_events.rl.hf_model import (
    chat_template,
    generation_eos_ids,
    load_model,
    load_tokenizer,
    prepare_base_model,
)
from miles_events.rl.lr_schedule import LrSchedule
from miles_events.rl.prompts import load_prompts, rollout_prompts
from miles_events.rl.rewards import reward_of
from miles_events.util.registry import load_function
from schemas.config import Config

ROOT = Path(__file__).resolve().parents[1]


class Timing:
    """What the trainer subclass and the callback record, rollout by rollout."""

    def __init__(self) -> None:
        self.rollouts: list[dict[str, Any]] = []
        self.step_ends: list[float] = []
        self.train_begin: float | None = None
        self.train_end: float | None = None
        self.in_generation = False

    @property
    def current(self) -> dict[str, Any]:
        return self.rollouts[-1]


class StepTimes(TrainerCallback):
    def __init__(self, timing: Timing) -> None:
        self.timing = timing

    def on_train_begin(self, args, state, control, **kwargs):
        self.timing.train_begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.timing.step_ends.append(time.time())

    def on_train_end(self, args, state, control, **kwargs):
        self.timing.train_end = time.time()


def engine_prompt_ids(tokenizer, prompts: list[str], rendered_chats: bool = False) -> list[list[int]]:
    """The ids the project's engines get for these prompts: text as ``TorchEngine.encode``
    tokenizes it, a rendered chat without special tokens added (the Generator's ids)."""
    return [list(tokenizer(prompt, add_special_tokens=not rendered_chats)["input_ids"]) for prompt in prompts]


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the generation of each rollout timed, and its prompt ids checked
    against the project's engine on the first one."""

    timing: Timing
    rendered_chats: bool = False
    """Whether the prompts are chats rendered with the template (``data.apply_chat_template``)."""

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        record: dict[str, Any] = {
            "rollout_id": len(self.timing.rollouts),
            "start": time.time(),
            "old_logprob_seconds": 0.0,
            "sample_seconds": 0.0,
            "rewards": [],
        }
        self.timing.rollouts.append(record)
        started = time.perf_counter()
        self.timing.in_generation = True
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.timing.in_generation = False
        record["generate_and_score_seconds"] = time.perf_counter() - started
        record["generate_seconds"] = record["generate_and_score_seconds"] - record["old_logprob_seconds"]
        record["generated_end"] = time.time()
        return output

    def _generate(self, prompts):
        started = time.perf_counter()
        output = super()._generate(prompts)
        if self.timing.in_generation:
            self.timing.current["sample_seconds"] += time.perf_counter() - started
        return output

    def _tokenize_prompts(self, prompts):
        prompt_ids, images, fields = super()._tokenize_prompts(prompts)
        if self.timing.in_generation and len(self.timing.rollouts) == 1:
            expected = engine_prompt_ids(self.processing_class, prompts, self.rendered_chats)
            same = [list(ids) for ids in prompt_ids] == expected
            self.timing.current["prompt_ids_as_engine"] = same
            if not same:
                raise RuntimeError("TRL tokenizes the prompts differently from the project's engine")
        return prompt_ids, images, fields

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not self.timing.in_generation:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        started = time.perf_counter()
        output = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self.timing.current["old_logprob_seconds"] += time.perf_counter() - started
        return output


class HeldOutEval(TrainerCallback):
    """The run's evaluation, at the rollouts the run evaluates at: before the first rollout
    (unless ``run.skip_eval_before_train``) and after rollout ``k`` where the Coordinator's
    ``should_run_periodic_action(k, run.eval_interval, per_epoch)`` holds. Each eval prompt
    (``data.eval_data``, rendered as the run renders it) gets ``eval_n_samples_per_prompt``
    responses of at most ``rollout.max_new_tokens`` tokens, greedy at ``eval_temperature = 0``
    (else sampled at it), stopping at the tokenizer's and the generation config's EOS ids, as
    the embedded engine; ``accuracy`` is the fraction of rewards >= 1, as ``eval/accuracy``."""

    def __init__(self, config: Config, tokenizer: Any, model_dir: Path, steps_per_rollout: int) -> None:
        data = config.data
        template = chat_template(tokenizer) if data.apply_chat_template else None
        read = lambda path: load_prompts(  # noqa: E731
            path, data.input_key, data.label_key, chat=data.apply_chat_template, template=template
        )
        train = read(data.prompt_data)
        self.prompts = read(data.eval_data) if data.eval_data else train
        self.per_epoch = len(train) // data.rollout_batch_size or None
        self.config, self.tokenizer, self.steps_per_rollout = config, tokenizer, steps_per_rollout
        self.reward_fn = load_function(config.rollout.reward_fn)
        eos = set(generation_eos_ids(model_dir))
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_ids = sorted(eos)
        self.evals: list[dict[str, Any]] = []

    def due_after(self, rollout_id: int) -> bool:
        return should_run_periodic_action(rollout_id, self.config.run.eval_interval, self.per_epoch)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.config.run.eval_interval is not None and not self.config.run.skip_eval_before_train:
            self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.steps_per_rollout == 0:
            rollout_id = state.global_step // self.steps_per_rollout - 1
            if self.due_after(rollout_id):
                self.evaluate(model, rollout_id)

    @torch.no_grad()
    def evaluate(self, model, rollout_id: int, batch_size: int = 50) -> None:
        started, clock = time.time(), time.perf_counter()
        rollout, data = self.config.rollout, self.config.data
        tokenizer = self.tokenizer
        rendered = data.apply_chat_template
        was_training, side = model.training, tokenizer.padding_side
        model.eval()
        tokenizer.padding_side = "left"
        rewards: list[float] = []
        lengths: list[int] = []
        greedy = rollout.eval_temperature == 0
        try:
            for first in range(0, len(self.prompts), batch_size):
                batch = self.prompts[first : first + batch_size]
                ids = engine_prompt_ids(tokenizer, [p.prompt for p in batch], rendered)
                width = max(map(len, ids))
                pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
                input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
                mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
                out = model.generate(
                    input_ids=input_ids.to(model.device),
                    attention_mask=mask.to(model.device),
                    max_new_tokens=rollout.max_new_tokens,
                    do_sample=not greedy,
                    temperature=None if greedy else rollout.eval_temperature,
                    top_p=None if greedy else rollout.top_p,
                    top_k=None,
                    num_return_sequences=data.eval_n_samples_per_prompt,
                    eos_token_id=self.eos_ids,
                    pad_token_id=pad,
                )
                responses = out[:, width:].tolist()
                for index, response in enumerate(responses):
                    prompt = batch[index // data.eval_n_samples_per_prompt]
                    ends = [i for i, token in enumerate(response) if token in self.eos_ids]
                    response = response[: ends[0] + 1] if ends else response
                    lengths.append(len(response))
                    text = tokenizer.decode(response, skip_special_tokens=True)
                    rewards.append(
                        float(reward_of(self.reward_fn, prompt.prompt, text, prompt.label, dict(prompt.row)))
                    )
        finally:
            tokenizer.padding_side = side
            model.train(was_training)
        self.evals.append(
            {
                "rollout_id": rollout_id,
                "start": started,
                "seconds": time.perf_counter() - clock,
                "accuracy": statistics.fmean(float(r >= 1.0) for r in rewards),
                "reward_mean": statistics.fmean(rewards),
                "response_length_mean": statistics.fmean(lengths),
                "num_samples": len(rewards),
            }
        )
        print(
            f"eval at rollout {rollout_id}: accuracy {self.evals[-1]['accuracy']:.3f}"
            f" ({len(rewards)} samples, {self.evals[-1]['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )


def reward_function(config: Config, timing: Timing, rows: list[dict[str, Any]]):
    """The run's ``rollout.reward_fn`` as a TRL reward function (prompt, completion, label,
    and the data row where it takes one: the dataset's ``row`` column indexes ``rows``)."""
    fn = load_function(config.rollout.reward_fn)

    def reward(
        prompts: list[str], completions: list[str], label: list[str], row: list[int], **kwargs: Any
    ) -> list[float]:
        rewards = [
            float(reward_of(fn, p, c, lab, rows[r]))
            for p, c, lab, r in zip(prompts, completions, label, row, strict=True)
        ]
        if timing.in_generation:
            timing.current["rewards"].extend(rewards)
        return rewards

    reward.__name__ = config.rollout.reward_fn.rsplit(".", 1)[-1]
    return reward


def prompt_dataset(config: Config, tokenizer: Any) -> tuple[Dataset, list[dict[str, Any]]]:
    """The prompts of every rollout, in the run's order, as the text the run's engines get
    (chats rendered with the tokenizer's template where ``data.apply_chat_template``), and
    the data rows they index."""
    data = config.data
    template = chat_template(tokenizer) if data.apply_chat_template else None
    prompts = load_prompts(
        data.prompt_data, data.input_key, data.label_key, chat=data.apply_chat_template, template=template
    )
    rows = [
        {"prompt": p.prompt, "label": p.label, "row": p.index}
        for k in range(config.run.num_rollout or 0)
        for p in rollout_prompts(
            prompts, k, data.rollout_batch_size, config.run.seed, shuffle=data.rollout_shuffle
        )
    ]
    return Dataset.from_list(rows), [dict(p.row) for p in prompts]


def lr_schedule(config: Config, max_steps: int) -> dict[str, Any]:
    """The run's learning-rate schedule in transformers' terms (its schedulers warm up from
    0 and decay over the whole training): what they cannot follow exactly is refused."""
    schedule = LrSchedule.of(config)
    if schedule.warmup_init != 0.0:
        raise SystemExit("trainer.lr_warmup_init: TRL's schedulers warm up from 0")
    style = schedule.decay_style
    if style != "constant" and schedule.decay_steps != max_steps:
        raise SystemExit(
            f"trainer.lr_decay_steps: TRL's schedulers decay over the whole run ({max_steps} steps)"
        )
    if style == "linear" and schedule.min_lr != 0.0:
        raise SystemExit("trainer.min_lr: TRL's linear schedule decays to 0")
    names = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine_with_min_lr"}
    kwargs = {"min_lr": schedule.min_lr} if style == "cosine" else {}
    return {
        "lr_scheduler_type": names[style],
        "warmup_steps": schedule.warmup_steps,
        "lr_scheduler_kwargs": kwargs,
    }


def grpo_config(config: Config, output_dir: str) -> GRPOConfig:
    data, trainer, rollout = config.data, config.trainer, config.rollout
    samples = data.rollout_batch_size * data.n_samples_per_prompt
    step = trainer.global_batch_size or samples
    if samples % step:
        raise SystemExit(f"a rollout of {samples} samples is not a whole number of optimizer steps of {step}")
    if trainer.micro_batch_size != step:
        print(
            f"note: trainer.micro_batch_size = {trainer.micro_batch_size}; TRL trains each optimizer step "
            f"of {step} samples as one batch",
            file=sys.stderr,
        )
    return GRPOConfig(
        output_dir=output_dir,
        seed=config.run.seed,
        use_cpu=not torch.cuda.is_available(),
        num_generations=data.n_samples_per_prompt,
        per_device_train_batch_size=step,
        gradient_accumulation_steps=1,
        steps_per_generation=samples // step,
        num_iterations=1,
        max_steps=(samples // step) * (config.run.num_rollout or 0),
        shuffle_dataset=False,
        loss_type="bnpo",
        beta=0.0,
        scale_rewards="group" if trainer.normalize_advantage_std else "none",
        epsilon=trainer.eps_clip,
        epsilon_high=trainer.eps_clip_high if trainer.eps_clip_high is not None else trainer.eps_clip,
        learning_rate=trainer.lr,
        **lr_schedule(config, (samples // step) * (config.run.num_rollout or 0)),
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2,
        adam_epsilon=trainer.adam_eps,
        max_grad_norm=trainer.clip_grad,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=0,
        use_vllm=False,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def summary(timing: Timing, steps_per_rollout: int) -> list[dict[str, Any]]:
    rows = []
    for record in timing.rollouts:
        k = record["rollout_id"]
        last_step = (k + 1) * steps_per_rollout - 1
        if last_step >= len(timing.step_ends):
            break  # not trained (the run stopped)
        end = timing.step_ends[last_step]
        rewards = record.pop("rewards")
        rows.append(
            {
                **record,
                "end": end,
                "train_seconds": end - record["generated_end"] + record["old_logprob_seconds"],
                "num_completions": len(rewards),
                "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
                "reward_min": min(rewards, default=math.nan),
                "reward_max": max(rewards, default=math.nan),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", required=True, help="where the JSON results go")
    parser.add_argument(
        "--work-dir", help="where the base model and TRL's output_dir go (default: a temporary one)"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's default)")
    args = parser.parse_args(argv)
    started = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = resolve_model_source(load_config(args.config, args.overrides))
    if not config.run.num_rollout:
        raise SystemExit("run.num_rollout must be set (the TRL arm runs a fixed number of rollouts)")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="trl-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_base_model(config.model, work, config.run.seed)
    model = load_model(model_dir, config.model.dtype)
    tokenizer = load_tokenizer(model_dir)

    timing = Timing()
    dataset, data_rows = prompt_dataset(config, tokenizer)
    training_args = grpo_config(config, str(work / "trl-output"))
    held_out = HeldOutEval(config, tokenizer, model_dir, training_args.steps_per_generation)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward_function(config, timing, data_rows),
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes(timing), held_out],
    )
    trainer.timing = timing
    trainer.rendered_chats = config.data.apply_chat_template
    trainer.train()
    steps_per_rollout = training_args.steps_per_generation
    rollouts = summary(timing, steps_per_rollout)
    result = {
        "arm": "trl",
        "versions": {
            "trl": trl.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "process_start": started,
        "train_begin": timing.train_begin,
        "train_end": timing.train_end,
        "num_rollout": config.run.num_rollout,
        "steps_per_rollout": steps_per_rollout,
        "optimizer_steps": len(timing.step_ends),
        "model_dir": str(model_dir),
        "settings": {
            key: getattr(training_args, key)
            for key in (
                "num_generations",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "steps_per_generation",
                "generation_batch_size",
                "num_iterations",
                "max_steps",
                "loss_type",
                "beta",
                "scale_rewards",
                "epsilon",
                "epsilon_high",
                "learning_rate",
                "max_grad_norm",
                "shuffle_dataset",
                "max_completion_length",
                "temperature",
                "top_p",
                "top_k",
                "bf16",
                "gradient_checkpointing",
                "seed",
            )
        },
        "rollouts": rollouts,
        "evals": held_out.evals,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
