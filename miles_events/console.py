"""Plain progress lines on the console, one per rollout, as a bus subscriber."""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from schemas.events import (
    CheckpointSaved,
    EvalFinished,
    Event,
    PublicationMismatch,
    PublicationVerified,
    RolloutGenerated,
    RunFinished,
    RunStarted,
    TrainStepFinished,
    WeightsPublished,
)

from miles_events.bus import EventBus

SHOWN = (
    RunStarted,
    RolloutGenerated,
    TrainStepFinished,
    WeightsPublished,
    PublicationVerified,
    PublicationMismatch,
    EvalFinished,
    CheckpointSaved,
    RunFinished,
)


class ProgressPrinter:
    """Summarises each rollout in one line: reward, loss, step time split, versions."""

    def __init__(self, bus: EventBus, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.mailbox = bus.subscribe("console", SHOWN)
        self.num_rollout = 0
        self.reward: dict[int, RolloutGenerated] = {}
        self.train: dict[int, TrainStepFinished] = {}
        self.verified = 0
        self.task = asyncio.create_task(self._print(), name="console")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    async def _print(self) -> None:
        while (event := await self.mailbox.get()) is not None:
            self.show(event)

    def show(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.num_rollout = event.num_rollout
            resumed = f", resumed at weight version {event.weight_version}" if event.resumed else ""
            self._line(
                f"run {event.run_id} ({event.runtime}): rollouts {event.start_rollout_id}..{event.num_rollout - 1}, "
                f"engines {', '.join(event.engines)}{resumed}"
            )
        elif isinstance(event, RolloutGenerated):
            self.reward[event.rollout_id] = event
        elif isinstance(event, TrainStepFinished):
            self.train[event.rollout_id] = event
        elif isinstance(event, PublicationVerified):
            self.verified += 1
            self._rollout_line(event.rollout_id, f"v{event.weight_version} verified")
        elif isinstance(event, WeightsPublished) and event.rollout_id is None:
            self._line(f"initial weights published as version {event.weight_version} in {event.publish_seconds:.2f}s")
        elif isinstance(event, PublicationMismatch):
            self._line(
                f"weight version {event.weight_version}: MISMATCH in {len(event.mismatches)} tensor(s), "
                f"e.g. {event.mismatches[0].engine}:{event.mismatches[0].tensor}"
            )
        elif isinstance(event, EvalFinished):
            metrics = " ".join(f"{k}={v:.3f}" for k, v in sorted(event.metrics.items()))
            self._line(f"eval at rollout {event.rollout_id}: {metrics}")
        elif isinstance(event, CheckpointSaved):
            self._line(f"checkpoint rollout {event.rollout_id} (version {event.weight_version}) -> {event.path}")
        elif isinstance(event, RunFinished):
            reason = f": {event.reason}" if event.reason else ""
            self._line(f"run {event.status}{reason}")

    def _rollout_line(self, rollout_id: int | None, publication: str) -> None:
        if rollout_id is None:
            self._line(f"initial publication {publication}")
            return
        generated, train = self.reward.pop(rollout_id, None), self.train.pop(rollout_id, None)
        if generated is None or train is None:
            return
        self._line(
            f"rollout {rollout_id + 1}/{self.num_rollout}: reward {generated.reward_mean:.3f} "
            f"loss {train.loss:+.4f} kl {train.kl:.4f} grad {train.grad_norm:.3f} | "
            f"gen {generated.generate_seconds:.2f}s train {train.train_seconds:.2f}s | {publication}"
        )
