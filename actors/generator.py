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
  the event log). The embedded engine seeds each sample on its own, from (run seed,
  rollout_id, prompt position in the rollout, sample number): its draws do not depend on
  the engine, batch or chunk that decodes it; SGLang servers get those seeds as each
  request's ``sampling_seed``. vLLM seeds from (run seed, rollout_id, engine index). Either
  way a resumed run regenerates identical samples.
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
import contextvars
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

import anyio
import msgspec

from actors.engine import engine_module
from actors.engine.base import Completion, GenerateRequest, SamplingParams
from actors.engine.cells import CellState, EngineCell, stand_in
from actors.engine.worker import EngineWorker, engine_worker
from actors.protocols.healing import check_restart, deliver_fault, restart_backoff
from miles_events.bus.actor import (
    Actor,
    ActorContext,
    Worker,
    WorkerFactory,
    WorkerGroup,
    brief_error,
    close_workers,
    handles,
)
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.bus.clock import wait_for
from miles_events.bus.errors import describe_error
from miles_events.rl.hf_model import chat_template, load_tokenizer, modeling_module
from miles_events.rl.prompts import Prompt, load_prompts, rollout_prompts, with_template_ids
from miles_events.rl.rewards import RewardFn, reward_of
from miles_events.rl.sample_excerpts import kept_samples
from miles_events.rl.versions import engine_names, version_number
from miles_events.util.registry import load_function
from schemas.config import Config, engines_heal, engines_isolated, skip_tensor_list, staleness_bound
from schemas.events import (
    CellFailed,
    CellHealth,
    CellRestarted,
    CellResumed,
    CellSuspended,
    CellSuspendRequested,
    DataReleased,
    EvalFinished,
    EvalRequested,
    Event,
    FaultInjected,
    FaultInjectionRequested,
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
    WeightsLoadStarted,
    WeightsStaged,
)
from schemas.rollout import RolloutBatch, Sample, VersionSpan

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


_BESIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("beside", default=False)
"""Set in a task whose engine calls run beside the call in progress (``call_beside``)."""

HEALING: tuple[type[Event], ...] = (CellFailed, CellRestarted, WeightsLoaded)
"""What a handler publishes when an engine it calls fails and is restarted."""


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
        self.heals = engines_heal(config)
        self.cells: list[EngineCell] = []
        """The engines as cells, in engine order (their state when they heal)."""
        self.served: WeightsStaged | None = None
        """The publication every engine loaded last: what a restarted engine loads again."""
        self.rollout_in_flight: int | None = None
        self._beside: dict[str, asyncio.Task[None]] = {}
        """``rollout.partial``: publications being loaded beside the rollout in flight, by version."""
        self._load_started = 0
        """The version number of the last publication whose load began (beside a rollout or
        in turn): publications come one at a time, in version order."""
        self._watcher: asyncio.Task[None] | None = None

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        # A rank per engine: on the ray runtime engine 0 shares the Generator's process and
        # each other engine gets a process, and a bundle of CPUs and GPUs, of its own.
        # Engines that heal each have a process of their own, engine 0 included: on ray the
        # group then holds a bundle for the Generator and one per engine.
        isolated = engines_isolated(config)
        return WorkerGroup(
            role="rollout", num_ranks=config.generator.num_engines + int(isolated), cpus_per_rank=1
        )

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
        self.engines = await self.context.start_workers(
            type(self).build_worker,
            len(self.engine_names),
            own_processes=("all" if engines_isolated(self.config) else False),
        )
        self.cells = [EngineCell(index, name) for index, name in enumerate(self.engine_names)]
        if self.heals:
            await asyncio.gather(*(self._describe(index) for index in range(len(self.cells))))

    async def _describe(self, index: int) -> None:
        """Learn engine ``index``'s processes and health route (once it started)."""
        cell, worker = self.cells[index], self.engines[index]
        cell.pids = await worker.call(EngineWorker.process_ids)
        cell.health_url = await worker.call(EngineWorker.health_url)

    async def ready(self) -> None:
        if self.heals:
            self._watcher = self.spawn(self._watch_health(), emits=(CellHealth, CellFailed))

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
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

    interrupt_types = (StopRequested, FaultInjectionRequested, CellSuspendRequested, WeightsStaged)

    def interrupt(self, event: Event) -> None:
        # Faults and suspensions land beside the handler in progress (mid-rollout); so does a
        # publication with ``rollout.partial``, between the engines' decode steps.
        if isinstance(event, WeightsStaged):
            started = version_number(event.weight_version) <= self._load_started  # handled in turn
            if self.config.rollout.partial and self.rollout_in_flight is not None and not started:
                self._beside[event.weight_version] = self.spawn(
                    self._load_beside(event), emits=(WeightsLoadStarted, WeightsLoaded)
                )
        elif isinstance(event, FaultInjectionRequested) and event.cell.startswith("rollout-"):
            self.spawn(self._inject(event), emits=(FaultInjected,))
        elif isinstance(event, CellSuspendRequested) and event.suspend:
            self.spawn(self._suspend(event), emits=(CellSuspended,))
        elif isinstance(event, StopRequested) and event.now:
            self.cancel.cancel(event.reason)
            for engine in self.engines:
                engine.notify(EngineWorker.cancel, event.reason)

    @handles(RolloutRequested, emits=(RolloutGenerated, StepCancelled, *HEALING))
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
        self.rollout_in_flight = event.rollout_id
        try:
            samples = await self._sample_groups(
                prompts, data.n_samples_per_prompt, sampling, "rollout", event.rollout_id
            )
        except Cancelled as cancelled:
            await self.publish(
                StepCancelled(rollout_id=event.rollout_id, phase="generate", reason=str(cancelled))
            )
            return
        finally:
            self.rollout_in_flight = None  # a failure after generation names no rollout
        batch = RolloutBatch(rollout_id=event.rollout_id, samples=samples)
        payload = msgspec.msgpack.encode(batch)
        ref = self.context.transport.stager.put_bytes(f"rollout-{event.rollout_id}", payload, owner=self.name)
        await self.publish(
            RolloutGenerated(
                rollout_id=event.rollout_id,
                batch=ref,
                num_samples=len(samples),
                reward_mean=_mean([s.reward for s in samples]),
                weight_versions=sorted_versions(
                    span.weight_version for s in samples for span in s.version_spans
                ),
                response_tokens=sum(len(s.response_ids) for s in samples),
                generate_seconds=time.perf_counter() - started,
                samples=kept_samples(samples, rollout.log_samples, rollout.log_sample_chars),
            )
        )

    @handles(EvalRequested, emits=(EvalFinished, StepCancelled, *HEALING))
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
            seeds = [
                sample_seed(self.config.run.seed, kind, rollout_id, g, k)
                for g in groups
                for k in range(n_samples)
            ]
            completions = await self._generate(index, requests, sampling, seed, seeds)
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

    async def _generate(
        self,
        index: int,
        requests: list[GenerateRequest],
        sampling: SamplingParams,
        seed: int,
        sample_seeds: list[int],
    ) -> list[Completion]:
        """Engine ``index``'s share of a rollout, sampled with its seed: on the engine itself,
        or while it is suspended on a stand-in (the same seed, so the same samples where the
        weights are the same); an engine that fails and is restarted samples it again."""
        while True:
            target: int | None = index
            if self.cells and self.cells[index].state is CellState.SUSPENDED:
                target = stand_in(self.cells, index)
            if target is None:
                raise EngineFailed("every engine is suspended: no engine can sample")
            if not self.cells:
                return await self._on_engine(
                    target, EngineWorker.generate, requests, sampling, seed, sample_seeds
                )
            cell = self.cells[target]
            async with cell.busy:
                if cell.state is CellState.SUSPENDED:
                    continue  # suspended while it waited: choose again
                try:
                    return await self._on_engine(
                        target, EngineWorker.generate, requests, sampling, seed, sample_seeds
                    )
                except Exception:
                    if cell.suspended:
                        continue  # suspended mid-call: a stand-in samples it
                    raise

    async def _on_engine(
        self, index: int, method: Callable[Concatenate[EngineWorker, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method(*args, **kwargs)`` of engine ``index``; a failure whose message does not
        name the engine (a rank process that died, an HTTP error) is raised as
        ``EngineFailed`` naming it. When engines heal, one that fails is restarted (with the
        current weights) and the call made again on it."""
        name = self.engine_names[index]
        while True:
            cell = self.cells[index] if self.cells else None
            if cell is not None and cell.state is CellState.FAILED:
                await self._restart(index)
            worker = self.engines[index]
            try:
                if _BESIDE.get():
                    return await worker.call_beside(method, *args, **kwargs)
                return await worker.call(method, *args, **kwargs)
            except Exception as error:
                if isinstance(error, Cancelled):
                    raise
                failure = error if name in str(error) else EngineFailed(f"{name}: {describe_error(error)}")
                if not self.heals or cell is None or cell.state is CellState.SUSPENDED:
                    if failure is error:
                        raise
                    raise failure from error
                if self.engines[index] is worker and cell.state is CellState.RUNNING:
                    await self._failed(index, brief_error(failure), hung=False)

    # --- healing --------------------------------------------------------------------------------
    #
    # Restarts happen only inside handlers (a call that failed, or ``CellFailed`` handled in
    # turn), never beside one: a restarted engine loads the publication every engine serves,
    # and no publication can move on meanwhile. What runs beside the handlers (the health
    # checks, a fault, a suspension) only kills an engine and says so.

    async def _failed(self, index: int, reason: str, *, hung: bool) -> None:
        """Engine ``index`` died or hung: it is stopped and ``CellFailed`` says so; the next
        call on it, or the Generator's own ``CellFailed`` handler, restarts it."""
        cell = self.cells[index]
        if cell.suspended:
            return  # stopped on purpose meanwhile: its resume starts it
        cell.state = CellState.FAILED
        cell.failure = reason
        worker = self.engines[index]
        await self.publish(
            CellFailed(
                cell=cell.name,
                reason=reason,
                hung=hung,
                restarts=cell.restarts,
                rollout_id=self.rollout_in_flight,
            )
        )
        await close_workers([worker], timeout=1.0)

    @handles(CellFailed, emits=(CellFailed, CellRestarted, WeightsLoaded))
    async def on_cell_failed(self, event: CellFailed) -> None:
        """An engine the health checks found dead or hung (or one a call saw fail that no
        call has restarted yet): restart it now, not at its next use."""
        cell = next((c for c in self.cells if c.name == event.cell), None)
        if cell is not None and cell.state is CellState.FAILED:
            await self._restart(cell.index)

    async def _restart(self, index: int) -> None:
        """Restart failed engine ``index``, after its backoff, and give it the publication
        every engine serves; a start that fails is another failure. ``RestartsSpent`` (the
        run fails) past ``control.max_restarts``."""
        cell = self.cells[index]
        control = self.config.control
        failed_at = time.perf_counter()
        while True:
            attempt = check_restart(f"{cell.name} ({cell.engine})", cell.restarts, control, cell.failure)
            cell.restarts = attempt
            await self.context.clock.sleep(restart_backoff(attempt, control))
            try:
                version = await self._start_engine(index)
            except Exception as error:
                if cell.suspended:
                    return  # suspended meanwhile: its resume starts it
                await self._failed(
                    index, f"{cell.engine} did not start again: {brief_error(error)}", hung=False
                )
                continue
            if cell.suspended:  # suspended while it started: it stays stopped until resumed
                await close_workers([self.engines[index]], timeout=1.0)
                return
            cell.state = CellState.RUNNING
            cell.failed_checks, cell.healthy = 0, True
            await self.publish(
                CellRestarted(
                    cell=cell.name,
                    attempt=attempt,
                    pid=cell.pids[0] if cell.pids else 0,
                    weight_version=version,
                    restart_seconds=time.perf_counter() - failed_at,
                )
            )
            return

    async def _start_engine(self, index: int) -> str:
        """Start engine ``index`` again and give it the publication every engine serves;
        returns the version it serves."""
        (worker,) = await self.context.start_workers(
            type(self).build_worker,
            len(self.engine_names),
            own_processes="all" if engines_isolated(self.config) else False,
            only=[index],
        )
        self.engines[index] = worker
        if self.cells[index].suspended:
            await close_workers([worker], timeout=1.0)
            raise EngineFailed(f"{self.engine_names[index]} was suspended while it started")
        # A new engine that hangs in its first calls is a failed start, not a stuck run.
        bound = self.config.publisher.load_timeout
        await wait_for(self._describe(index), bound, self.context.clock)
        served = self.served
        if served is None:
            return "default"  # nothing published yet: the base model, as the others serve
        skip = skip_tensor_list(self.config)
        started = time.perf_counter()
        loaded = await wait_for(
            worker.call(EngineWorker.load, served.weights, served.weight_version, skip, served.probe),
            bound,
            self.context.clock,
        )
        if loaded.digest != served.digest or (
            served.canary and loaded.canary is not None and loaded.canary != served.canary
        ):
            raise EngineFailed(
                f"{self.engine_names[index]} loaded weight version {served.weight_version} again but "
                f"serves digest {loaded.digest or '-'}, not {served.digest}"
            )
        await self.publish(
            msgspec.structs.replace(loaded, load_seconds=time.perf_counter() - started, restore=True)
        )
        return served.weight_version

    async def _watch_health(self) -> None:
        """Check every running engine each ``control.heartbeat_interval_seconds``: its
        server's health route, or (an embedded engine) a call answered by its process. An
        engine whose process died, or that fails ``heartbeat_max_failures`` checks in a row
        (hung), is killed and reported failed."""
        control = self.config.control
        while True:
            await self.context.clock.sleep(control.heartbeat_interval_seconds)
            await asyncio.gather(*(self._check(index) for index in range(len(self.cells))))

    async def _check(self, index: int) -> None:
        control = self.config.control
        if index >= len(self.engines):
            return  # stopping
        cell, worker = self.cells[index], self.engines[index]
        if cell.state is not CellState.RUNNING:
            return
        timeout = control.heartbeat_timeout_seconds
        died = False
        try:
            if cell.health_url is not None:
                reason = await anyio.to_thread.run_sync(_http_health, cell.engine, cell.health_url, timeout)
            else:
                reason = await wait_for(
                    worker.call(EngineWorker.health, timeout), timeout, self.context.clock
                )
        except TimeoutError:
            reason = f"{cell.engine} did not answer its heartbeat within {timeout:g}s"
        except Exception as error:
            reason, died = f"{cell.engine}: {brief_error(error)}", True
        if self.engines[index] is not worker or cell.state is not CellState.RUNNING:
            return  # failed, restarted or suspended meanwhile
        if not reason:
            if not cell.healthy:
                cell.healthy = True
                await self.publish(CellHealth(cell=cell.name, healthy=True))
            cell.failed_checks = 0
            return
        cell.failed_checks += 1
        if cell.healthy:
            cell.healthy = False
            await self.publish(CellHealth(cell=cell.name, healthy=False, reason=reason))
        if died:
            await self._failed(index, reason, hung=False)
        elif cell.failed_checks >= control.heartbeat_max_failures:
            await self._failed(index, f"{reason} ({cell.failed_checks} checks in a row)", hung=True)

    async def _inject(self, event: FaultInjectionRequested) -> None:
        """Deliver a fault to process ``sub_index`` of the cell's engine."""
        cell = next((c for c in self.cells if c.name == event.cell), None)
        error = ""
        pid = 0
        if cell is None:
            error = f"{event.cell}: no such rollout cell"
        elif cell.state is not CellState.RUNNING:
            error = f"{event.cell}: not running ({cell.state.value})"
        else:
            pid, error = deliver_fault(event.cell, cell.pids, event.sub_index, event.mode)
        if error:
            logger.warning("fault not injected: %s", error)
        await self.publish(
            FaultInjected(cell=event.cell, mode=event.mode, pid=pid, sub_index=event.sub_index, error=error)
        )

    async def _suspend(self, event: CellSuspendRequested) -> None:
        """Stop the engine now: its share of a rollout goes to a stand-in, publications go on
        without it."""
        cell = next((c for c in self.cells if c.name == event.cell), None)
        if cell is None or cell.state is CellState.SUSPENDED:
            return
        if stand_in(self.cells, cell.index) is None:
            logger.warning("%s not suspended: it is the last running engine", cell.name)
            return
        cell.state = CellState.SUSPENDED
        await close_workers([self.engines[cell.index]], timeout=1.0)
        await self.publish(CellSuspended(cell=cell.name))

    @handles(CellSuspendRequested, emits=(CellResumed, CellFailed, CellRestarted, WeightsLoaded))
    async def on_cell_suspend_requested(self, event: CellSuspendRequested) -> None:
        """A resume (a suspension is taken at once, out of band): start the engine again
        with the publication every engine serves."""
        cell = next((c for c in self.cells if c.name == event.cell), None)
        if event.suspend or cell is None or cell.state is not CellState.SUSPENDED:
            return
        cell.state = CellState.RESUMING
        try:
            version = await self._start_engine(cell.index)
        except Exception as error:
            if cell.suspended:
                return  # suspended again while it started
            await self._failed(cell.index, f"{cell.engine} did not resume: {brief_error(error)}", hung=False)
            await self._restart(cell.index)
            return
        if cell.suspended:  # suspended again while it started
            await close_workers([self.engines[cell.index]], timeout=1.0)
            return
        cell.state = CellState.RUNNING
        cell.failed_checks, cell.healthy = 0, True
        await self.publish(
            CellResumed(cell=cell.name, pid=cell.pids[0] if cell.pids else 0, weight_version=version)
        )

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
                    version_spans=[VersionSpan(start, version) for start, version in completion.version_spans]
                    or [VersionSpan(0, completion.weight_version)],
                    engine=engine,
                    finish_reason=completion.finish_reason,
                )
            )
        return samples

    # --- weights ------------------------------------------------------------------------------

    async def _load_beside(self, event: WeightsStaged) -> None:
        """``rollout.partial``: the publication loaded while a rollout is generated, each
        engine's load landing between two of its decode steps."""
        _BESIDE.set(True)
        await self._load_everywhere(event)

    @handles(WeightsStaged, emits=(WeightsLoadStarted, WeightsLoaded, *HEALING))
    async def on_weights_staged(self, event: WeightsStaged) -> None:
        beside = self._beside.pop(event.weight_version, None)
        if beside is not None:
            await asyncio.wait([beside])  # loaded mid-rollout (its failure is the actor's already)
            return
        await self._load_everywhere(event)

    async def _load_everywhere(self, event: WeightsStaged) -> None:
        self._load_started = max(self._load_started, version_number(event.weight_version))
        if staleness_bound(self.config):  # it may have waited behind a rollout: its clock starts now
            await self.publish(WeightsLoadStarted(weight_version=event.weight_version))
        # Every engine loads at once and resolves the handle itself (the staged data belongs
        # to the trainer). A suspended engine loads it when it resumes.
        # The skip list applies here as on the trainer: digests are compared whole.
        skip = skip_tensor_list(self.config)

        async def load(index: int) -> Event | None:
            cell = self.cells[index] if self.cells else None
            if cell is not None and cell.state is CellState.SUSPENDED:
                return None
            started = time.perf_counter()
            try:
                loaded = await self._on_engine(
                    index, EngineWorker.load, event.weights, event.weight_version, skip, event.probe
                )
            except Exception:
                if cell is not None and cell.suspended:
                    return None  # suspended mid-load: it loads what every engine serves on resume
                raise
            return msgspec.structs.replace(loaded, load_seconds=time.perf_counter() - started)

        await self._on_every_engine(load)
        self.served = event

    async def _on_every_engine(self, work: Callable[[int], Awaitable[Event | None]]) -> None:
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
                if first is None and event is not None:
                    await self.publish(event)
        finally:
            for task in tasks:
                task.cancel()  # only if this handler itself was cancelled
        if first is not None:
            raise first

    @handles(WeightsCheckRequested, emits=(WeightsCheckFinished, *HEALING))
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


class ServerGone(ConnectionError):
    """An engine's server refuses connections: its process is gone."""


def _http_health(engine: str, url: str, timeout: float) -> str:
    """An engine server's health check, made from the Generator: "" when it answered 200;
    ``ServerGone`` when nothing listens there any more."""
    import httpx

    try:
        status = httpx.get(url, timeout=timeout).status_code
    except httpx.ConnectError as error:
        raise ServerGone(f"{url} refuses connections: the server is gone") from error
    except httpx.HTTPError as error:
        return f"{engine}: {url} did not answer: {type(error).__name__}"
    return "" if status == 200 else f"{engine}: {url} answered {status}"


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


def sample_seed(run_seed: int, kind: str, rollout_id: int, group: int, sample: int) -> int:
    """The sampling seed of one sample: the ``sample``-th of the rollout's ``group``-th
    prompt (the embedded engine seeds each sample so, whatever engine or batch decodes it)."""
    key = f"{kind}:{run_seed}:{rollout_id}:{group}:{sample}".encode()
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
