"""The Generator: inference engines that turn prompts into scored rollout samples.

It owns ``generator.num_engines`` engines ("engine-0", "engine-1", ...) of the backend
``generator.engine``, all bootstrapped from ``model.path`` and serving version ``"default"``.
Each engine is a rank of the Generator's worker group (``actors.engine.worker``), with a
CPU (and its GPUs) reserved for it: on the ray runtime engine 0 runs in the Generator's process
and every other engine in a Ray actor process of its own, in its own bundle; on the local
runtime all run in the one process. Engines start at once (servers launch and load their
models concurrently), and every call below goes to all of them at once. It reacts to:

- ``RolloutRequested``: samples ``n_samples_per_prompt`` completions for each prompt of the
  rollout (one group per prompt; groups go to engines round-robin), scores them with the
  reward function, puts the ``RolloutBatch`` in the data plane and emits
  ``RolloutGenerated`` (with ``rollout.log_samples`` of the samples, texts cut short, for
  the event log). Each engine samples with a ``torch.Generator`` seeded from
  (run seed, rollout_id, engine index), so a resumed run regenerates identical samples.
- ``EvalRequested``: the same on the eval prompts at ``eval_temperature``; ``EvalFinished``.
- ``WeightsStaged``: every engine loads the staged weights from their handle and
  fingerprints what it now serves; one ``WeightsLoaded`` per engine (digest, counts and the
  checksum manifest, written once per digest under ``<run_dir>/checksums/``; with the
  publication's behavioural probe, the engine's answer to it), in engine order, each as soon
  as it and the engines before it are done.
- ``WeightsCheckRequested``: SGLang's weight-checker action on every engine; one
  ``WeightsCheckFinished`` per engine, in engine order.
- ``OffloadRequested`` / ``OnloadRequested`` of ``rollout``: every engine releases or
  resumes its memory of the tags asked for (``run.offload_rollout``); one
  ``MemoryOffloaded`` / ``MemoryOnloaded`` with a part per engine.
- ``DataReleased`` of a batch it owns: frees it.

A failure on one engine fails the handler with the engine's name in its message.

The embedded ``torch`` engines run on CUDA when their process sees a GPU (engine i on GPU i
modulo the count), on CPU otherwise. Each engine samples with ``rollout.num_threads``
torch threads (0: the cores it may use, shared by all engines) while it generates
(``miles_events.device.threads``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

import anyio
import msgspec

from actors.engine import engine_module
from actors.engine.base import Completion, GenerateRequest, SamplingParams
from actors.engine.worker import EngineWorker, engine_worker
from miles_events.bus.actor import (
    Actor,
    ActorContext,
    Worker,
    WorkerFactory,
    WorkerGroup,
    close_workers,
    handles,
)
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.bus.errors import describe_error
from miles_events.rl.hf_model import chat_template, load_tokenizer, modeling_module
from miles_events.rl.prompts import Prompt, load_prompts, rollout_prompts, with_template_ids
from miles_events.rl.rewards import RewardFn, reward_of
from miles_events.rl.sample_excerpts import kept_samples
from miles_events.rl.versions import engine_names
from miles_events.util.registry import load_function
from schemas.config import Config, skip_tensor_list
from schemas.events import (
    DataReleased,
    EvalFinished,
    EvalRequested,
    Event,
    MemoryOffloaded,
    MemoryOnloaded,
    MemoryPart,
    OffloadRequested,
    OnloadRequested,
    RolloutGenerated,
    RolloutRequested,
    StepCancelled,
    StopRequested,
    WeightsCheckFinished,
    WeightsCheckRequested,
    WeightsLoaded,
    WeightsStaged,
)
from schemas.rollout import RolloutBatch, Sample

P = ParamSpec("P")
R = TypeVar("R")


class Generator(Actor):
    """Rollout generation, evaluation and weight loading over a set of inference engines."""

    name = "generator"

    build_worker: ClassVar[WorkerFactory[EngineWorker]] = staticmethod(engine_worker)
    """How each engine rank is built where it runs (a module-level function)."""

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self.cancel = Cancellation()
        self.engines: list[Worker[EngineWorker]] = []
        """One worker-group rank per engine, in engine order (``engine_names``)."""
        self.engine_names: list[str] = []
        self.prompts: list[Prompt] = []
        self.eval_prompts: list[Prompt] = []
        self.reward_fn: RewardFn | None = None

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        # A rank per engine: on the ray runtime engine 0 shares the Generator's process and
        # each other engine gets a process, and a bundle of CPUs and GPUs, of its own.
        return WorkerGroup(role="rollout", num_ranks=config.generator.num_engines, cpus_per_rank=1)

    @classmethod
    def process_modules(cls, config: Config) -> list[str]:
        # Its engine backend, and for the embedded engine the model's transformers module.
        engine = config.generator.engine
        modeling = modeling_module(config.model) if engine == "torch" else None
        return [cls.__module__, engine_module(engine), *([modeling] if modeling else [])]

    async def start(self) -> None:
        rollout, data = self.config.rollout, self.config.data
        if self.config.model.path is None:
            raise RuntimeError(
                "model.path is unset: the session sets it to the base model before actors start"
            )
        tokenizer = load_tokenizer(self.config.model.path) if data.apply_chat_template else None
        template = chat_template(tokenizer) if tokenizer is not None else None
        read = partial(
            load_prompts,
            input_key=data.input_key,
            label_key=data.label_key,
            chat=data.apply_chat_template,
            template=template,
        )
        if data.prompt_data:
            self.prompts = read(data.prompt_data)
        self.eval_prompts = read(data.eval_data) if data.eval_data else self.prompts
        if tokenizer is not None:

            def encode(texts: list[str]) -> list[list[int]]:
                return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

            same = self.eval_prompts is self.prompts
            self.prompts = with_template_ids(self.prompts, encode)
            self.eval_prompts = self.prompts if same else with_template_ids(self.eval_prompts, encode)
        self.reward_fn = load_function(rollout.reward_fn)
        # Every engine starts at once: servers launch and load their models concurrently.
        self.engine_names = list(engine_names(self.config))
        self.engines = await self.context.start_workers(type(self).build_worker, len(self.engine_names))

    async def stop(self) -> None:
        engines, self.engines = self.engines, []
        await close_workers(engines)

    # --- rollouts and evaluation ------------------------------------------------------------

    def _sampling(self, temperature: float) -> SamplingParams:
        rollout = self.config.rollout
        return SamplingParams(
            temperature=temperature,
            top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens,
            stop=tuple(rollout.stop),
        )

    def interrupt(self, event: StopRequested) -> None:
        if event.now:
            self.cancel.cancel(event.reason)
            for engine in self.engines:
                engine.notify(EngineWorker.cancel, event.reason)

    @handles(RolloutRequested, emits=(RolloutGenerated, StepCancelled))
    async def on_rollout_requested(self, event: RolloutRequested) -> None:
        data, rollout = self.config.data, self.config.rollout
        if not self.prompts:
            raise ValueError("no prompt data: set data.prompt_data to generate rollouts")
        prompts = rollout_prompts(
            self.prompts,
            event.rollout_id,
            data.rollout_batch_size,
            self.config.run.seed,
            data.rollout_shuffle,
        )
        sampling = self._sampling(rollout.temperature)
        started = time.perf_counter()
        try:
            samples = await self._sample_groups(
                prompts, data.n_samples_per_prompt, sampling, "rollout", event.rollout_id
            )
        except Cancelled as cancelled:
            await self.publish(
                StepCancelled(rollout_id=event.rollout_id, phase="generate", reason=str(cancelled))
            )
            return
        batch = RolloutBatch(rollout_id=event.rollout_id, samples=samples)
        payload = msgspec.msgpack.encode(batch)
        ref = self.context.transport.stager.put_bytes(f"rollout-{event.rollout_id}", payload, owner=self.name)
        await self.publish(
            RolloutGenerated(
                rollout_id=event.rollout_id,
                batch=ref,
                num_samples=len(samples),
                reward_mean=_mean([s.reward for s in samples]),
                weight_versions=sorted_versions(s.weight_version for s in samples),
                response_tokens=sum(len(s.response_ids) for s in samples),
                generate_seconds=time.perf_counter() - started,
                samples=kept_samples(samples, rollout.log_samples, rollout.log_sample_chars),
            )
        )

    @handles(EvalRequested, emits=(EvalFinished, StepCancelled))
    async def on_eval_requested(self, event: EvalRequested) -> None:
        """Evaluate on ``eval_data`` (or the prompt data) at ``eval_temperature``.

        ``eval/accuracy`` is the fraction of samples with reward >= 1.0 (full credit), which
        is the pass rate for the usual 0/1 rewards and counts only full marks otherwise.
        """
        rollout = self.config.rollout
        if not self.eval_prompts:
            raise ValueError("no eval data: set data.eval_data or data.prompt_data to evaluate")
        sampling = self._sampling(rollout.eval_temperature)
        started = time.perf_counter()
        try:
            samples = await self._sample_groups(
                self.eval_prompts,
                self.config.data.eval_n_samples_per_prompt,
                sampling,
                "eval",
                event.rollout_id,
            )
        except Cancelled as cancelled:
            await self.publish(
                StepCancelled(rollout_id=event.rollout_id, phase="eval", reason=str(cancelled))
            )
            return
        rewards = [s.reward for s in samples]
        metrics = {
            "eval/reward_mean": _mean(rewards),
            "eval/accuracy": _mean([float(r >= 1.0) for r in rewards]),
            "eval/response_length_mean": _mean([float(len(s.response_ids)) for s in samples]),
            "eval/truncated_ratio": _mean([float(s.finish_reason == "length") for s in samples]),
            "eval/num_samples": float(len(samples)),
        }
        await self.publish(
            EvalFinished(
                rollout_id=event.rollout_id,
                metrics=metrics,
                weight_versions=sorted_versions(s.weight_version for s in samples),
                eval_seconds=time.perf_counter() - started,
                samples=kept_samples(samples, rollout.log_samples, rollout.log_sample_chars),
            )
        )

    async def _sample_groups(
        self, prompts: Sequence[Prompt], n_samples: int, sampling: SamplingParams, kind: str, rollout_id: int
    ) -> list[Sample]:
        """``n_samples`` scored samples per prompt, ordered by group; engines run concurrently."""
        num_engines = len(self.engines)
        per_engine = [list(range(i, len(prompts), num_engines)) for i in range(num_engines)]
        results: list[list[Sample]] = [[] for _ in self.engines]

        async def run(index: int) -> None:
            groups = per_engine[index]
            requests: list[GenerateRequest] = [
                prompts[g].prompt if prompts[g].ids is None else list(prompts[g].ids or ())
                for g in groups
                for _ in range(n_samples)
            ]
            seed = engine_seed(self.config.run.seed, kind, rollout_id, index)
            completions = await self._on_engine(index, EngineWorker.generate, requests, sampling, seed)
            self.cancel.check()
            results[index] = await anyio.to_thread.run_sync(
                self._score, self.engine_names[index], prompts, groups, n_samples, completions
            )

        tasks = [asyncio.ensure_future(run(index)) for index, groups in enumerate(per_engine) if groups]
        if not tasks:
            return []
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if pending:
                # An engine failed: the rollout is lost, so the others stop at their next
                # decode step; every call is waited for (none is left running on its own).
                for engine in self.engines:
                    engine.notify(EngineWorker.cancel, "another engine failed this rollout")
                await asyncio.wait(pending)
        finally:
            for task in tasks:
                task.cancel()  # only if this handler itself was cancelled
        failures = [error for t in tasks if not t.cancelled() and (error := t.exception()) is not None]
        # One engine's failure is the rollout's; a cancellation is one, not one per engine.
        other = [f for f in failures if not isinstance(f, Cancelled)]
        if other:
            raise other[0]
        if failures:
            raise Cancelled(self.cancel.reason)
        return sorted((s for samples in results for s in samples), key=lambda s: s.group)

    async def _on_engine(
        self, index: int, method: Callable[Concatenate[EngineWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method(*args, **kwargs)`` of engine ``index``; a failure whose message does not
        name the engine (a rank process that died, an HTTP error) is raised as
        ``EngineFailed`` naming it."""
        name = self.engine_names[index]
        try:
            return await self.engines[index].call(method, *args, **kwargs)
        except Exception as error:
            if isinstance(error, Cancelled) or name in str(error):
                raise
            raise EngineFailed(f"{name}: {describe_error(error)}") from error

    def _score(
        self,
        engine: str,
        prompts: Sequence[Prompt],
        groups: list[int],
        n_samples: int,
        completions: Sequence[Completion],
    ) -> list[Sample]:
        assert self.reward_fn is not None, "start() loads the reward function"
        samples: list[Sample] = []
        for position, completion in enumerate(completions):
            group = groups[position // n_samples]
            prompt = prompts[group]
            samples.append(
                Sample(
                    index=prompt.index,
                    group=group,
                    prompt=prompt.prompt,
                    label=prompt.label,
                    prompt_ids=completion.prompt_ids,
                    response_ids=completion.response_ids,
                    response_logprobs=completion.response_logprobs,
                    response=completion.response,
                    reward=float(
                        reward_of(
                            self.reward_fn, prompt.prompt, completion.response, prompt.label, prompt.row
                        )
                    ),
                    weight_version=completion.weight_version,
                    engine=engine,
                    finish_reason=completion.finish_reason,
                )
            )
        return samples

    # --- weights ------------------------------------------------------------------------------

    @handles(WeightsStaged, emits=(WeightsLoaded,))
    async def on_weights_staged(self, event: WeightsStaged) -> None:
        # Every engine loads at once and resolves the handle itself (the staged data belongs
        # to the trainer).
        # The skip list applies here as on the trainer: digests are compared whole.
        skip = skip_tensor_list(self.config)

        async def load(index: int) -> Event:
            started = time.perf_counter()
            loaded = await self._on_engine(
                index, EngineWorker.load, event.weights, event.weight_version, skip, event.probe
            )
            return msgspec.structs.replace(loaded, load_seconds=time.perf_counter() - started)

        await self._on_every_engine(load)

    async def _on_every_engine(self, work: Callable[[int], Awaitable[Event]]) -> None:
        """``work(index)`` for every engine at once; the events they return are published in
        engine order (each as soon as it and those before it are done), so a run's event log
        does not depend on which engine was faster. After a failure the rest are waited for,
        and the first failure (in engine order) is raised."""
        tasks = [asyncio.ensure_future(work(index)) for index in range(len(self.engines))]
        first: BaseException | None = None
        try:
            for task in tasks:
                # Every call is waited for, a failed one's included: none is left running.
                try:
                    event = await task
                except Exception as error:
                    first = first or error
                    continue
                if first is None:
                    await self.publish(event)
        finally:
            for task in tasks:
                task.cancel()  # only if this handler itself was cancelled
        if first is not None:
            raise first

    @handles(WeightsCheckRequested, emits=(WeightsCheckFinished,))
    async def on_weights_check_requested(self, event: WeightsCheckRequested) -> None:
        async def check(index: int) -> Event:
            return await self._on_engine(index, EngineWorker.check, event)

        await self._on_every_engine(check)

    # --- offload and onload ----------------------------------------------------------------

    @handles(OffloadRequested, emits=(MemoryOffloaded,))
    async def on_offload_requested(self, event: OffloadRequested) -> None:
        """The seed's ``rollout_manager.offload(tags)``: every engine releases its memory of
        kinds ``event.tags`` (``release_memory_occupation``); one ``MemoryOffloaded``."""
        if event.target == "rollout":
            started = time.perf_counter()
            parts = await self._on_memory(EngineWorker.release_memory, event.tags)
            seconds = time.perf_counter() - started
            await self.publish(MemoryOffloaded(**_memory_reply(event), parts=parts, seconds=seconds))

    @handles(OnloadRequested, emits=(MemoryOnloaded,))
    async def on_onload_requested(self, event: OnloadRequested) -> None:
        """The seed's ``onload_weights`` / ``onload_kv``: every engine resumes its memory of
        kinds ``event.tags``; one ``MemoryOnloaded``."""
        if event.target == "rollout":
            started = time.perf_counter()
            parts = await self._on_memory(EngineWorker.resume_memory, event.tags)
            seconds = time.perf_counter() - started
            await self.publish(MemoryOnloaded(**_memory_reply(event), parts=parts, seconds=seconds))

    async def _on_memory(
        self, method: Callable[[EngineWorker, Sequence[str]], MemoryPart], tags: Sequence[str]
    ) -> list[MemoryPart]:
        """``method(tags)`` on every engine at once; their parts in engine order."""
        return list(
            await asyncio.gather(
                *(self._on_engine(index, method, list(tags)) for index in range(len(self.engines)))
            )
        )

    @handles(DataReleased, emits=())
    async def on_data_released(self, event: DataReleased) -> None:
        if event.ref.owner == self.name:
            self.context.transport.stager.free(event.ref)


class EngineFailed(RuntimeError):
    """A call on one engine failed; the message starts with the engine's name."""


def _memory_reply(event: OffloadRequested | OnloadRequested) -> dict[str, Any]:
    """The fields a memory fact copies from the request it answers."""
    return {
        "target": event.target,
        "tags": list(event.tags),
        "rollout_id": event.rollout_id,
        "request_id": event.request_id,
    }


def engine_seed(run_seed: int, kind: str, rollout_id: int, engine_index: int) -> int:
    """The sampling seed of one engine for one rollout (``kind`` keeps eval draws apart)."""
    key = f"{kind}:{run_seed}:{rollout_id}:{engine_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def sorted_versions(versions: Iterable[str]) -> list[str]:
    """Distinct weight versions, oldest first: "default", then numeric versions in order."""

    def key(version: str) -> tuple[int, int, str]:
        if version == "default":
            return (0, 0, "")
        if version.isdigit():
            return (1, int(version), "")
        return (2, 0, version)

    return sorted(set(versions), key=key)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
