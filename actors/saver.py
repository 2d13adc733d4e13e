"""The Saver: turns the trainer's staged state into a checkpoint on disk.

It reacts to ``TrainStateStaged`` (the Trainer's answer to a ``SaveRequested``): it reads
the staged weights, optimizer and RNG bytes from the data plane, writes
``<run_dir>/checkpoints/rollout_XXXXXX`` atomically off the event loop, prunes old
checkpoints, hands the references back to their owner with ``DataReleased`` and reports
``CheckpointSaved``. Any failure becomes ``CheckpointFailed`` (the Coordinator then ends
the run with that reason), never an exception in the actor, and older checkpoints stay
as they were.

With PPO (``trainer.use_critic``) a checkpoint also holds the critic: the Saver waits for
the critic's ``CriticStateStaged`` of the same save and writes both, the critic in the
checkpoint's ``critic/``, as one atomic checkpoint.

It also writes a rollout-only run's publication evidence (``PublicationEvidenceRequested``):
created exclusively with mode 0600 and fsynced; an existing file is never replaced but
reported as ``PublicationEvidenceFailed``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import anyio.to_thread

from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.bus.errors import describe_error
from miles_events.checkpoint.format import CriticParts, write_checkpoint
from miles_events.checkpoint.prune import prune_checkpoints
from miles_events.rl.checkpoint_rollout import write_evidence
from schemas.config import Config
from schemas.events import (
    CheckpointFailed,
    CheckpointSaved,
    CriticStateStaged,
    DataReleased,
    PublicationEvidenceFailed,
    PublicationEvidenceRequested,
    PublicationEvidenceWritten,
    TrainStateStaged,
)

log = logging.getLogger(__name__)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Saver(Actor):
    """Writes checkpoints from staged trainer state; one save at a time, in bus order."""

    name = "saver"
    # A checkpoint is written whole under a hidden name and renamed into place, so a save
    # cut short by the process's death leaves nothing a resume would pick: written again.
    restartable = True

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self._policy_states: dict[int, list[TrainStateStaged]] = {}
        self._critic_states: dict[int, list[CriticStateStaged]] = {}
        """PPO: each save's two halves, until both are in (one list entry per save)."""

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        return WorkerGroup(role="service", cpus_per_rank=0.5)

    def _staged(self, event: TrainStateStaged | CriticStateStaged) -> tuple[Any, Any, Any]:
        """The weights, optimizer and RNG state ``event`` staged: the staged file where the
        transport keeps one (copied, never decoded), else what it holds."""
        reader = self.context.transport.reader
        return (
            reader.tensors_file(event.weights) or reader.get_tensors(event.weights),
            reader.state_file(event.optimizer) or reader.get_state(event.optimizer),
            reader.state_file(event.rng) or reader.get_state(event.rng),
        )

    def _write(self, event: TrainStateStaged, critic_event: CriticStateStaged | None) -> Path:
        """Read the staged state and write the checkpoint (runs in a worker thread)."""
        weights, optimizer, rng = self._staged(event)
        critic = None
        if critic_event is not None:
            critic = CriticParts(*self._staged(critic_event), critic_event.num_optimizer_steps)
        if self.config.model.path is None:
            raise ValueError("model.path is unset: no base model to copy config and tokenizer from")
        return write_checkpoint(
            run_dir=Path(self.context.run_dir),
            base_model_dir=Path(self.config.model.path),
            rollout_id=event.rollout_id,
            weights=weights,
            optimizer=optimizer,
            rng=rng,
            trainer_state=event.trainer_state,
            fsync=self.config.saver.fsync,
            critic=critic,
        )

    def _prune(self) -> None:
        # A save that landed stays a success even when cleaning up older ones fails.
        try:
            removed = prune_checkpoints(Path(self.context.run_dir), self.config.saver.keep_last)
        except OSError as exc:
            log.warning("pruning old checkpoints failed: %s", describe_error(exc))
            return
        for path in removed:
            log.info("removed old checkpoint dir %s", path)

    async def _release(self, *events: TrainStateStaged | CriticStateStaged | None) -> None:
        # The Trainer (and the critic) own the staged data and free it once told we are done with it.
        for event in events:
            if event is not None:
                for ref in (event.weights, event.optimizer, event.rng):
                    await self.publish(DataReleased(ref=ref))

    @handles(TrainStateStaged, emits=(DataReleased, CheckpointSaved, CheckpointFailed))
    async def on_train_state_staged(self, event: TrainStateStaged) -> None:
        if not self.config.trainer.use_critic:
            await self._save(event, None)
            return
        self._policy_states.setdefault(event.rollout_id, []).append(event)
        await self._save_when_whole(event.rollout_id)

    @handles(CriticStateStaged, emits=(DataReleased, CheckpointSaved, CheckpointFailed))
    async def on_critic_state_staged(self, event: CriticStateStaged) -> None:
        self._critic_states.setdefault(event.rollout_id, []).append(event)
        await self._save_when_whole(event.rollout_id)

    async def _save_when_whole(self, rollout_id: int) -> None:
        policy, critic = self._policy_states.get(rollout_id), self._critic_states.get(rollout_id)
        if policy and critic:
            first, critic_first = policy.pop(0), critic.pop(0)
            for states in (self._policy_states, self._critic_states):
                if not states[rollout_id]:
                    del states[rollout_id]
            await self._save(first, critic_first)

    async def _save(self, event: TrainStateStaged, critic: CriticStateStaged | None) -> None:
        """Save the staged state of ``event.rollout_id`` (and the critic's) and report the outcome."""
        started = time.perf_counter()
        try:
            final = await anyio.to_thread.run_sync(self._write, event, critic)
            num_bytes = await anyio.to_thread.run_sync(_dir_bytes, final)
        except Exception as exc:
            reason = describe_error(exc)
            log.error("checkpoint of rollout %d failed: %s", event.rollout_id, reason)
            await self._release(event, critic)
            await self.publish(CheckpointFailed(rollout_id=event.rollout_id, reason=reason))
            return
        await anyio.to_thread.run_sync(self._prune)
        save_seconds = time.perf_counter() - started
        await self._release(event, critic)
        log.info(
            "saved rollout %d (version %s, %d bytes) to %s in %.2fs",
            event.rollout_id,
            event.trainer_state.weight_version,
            num_bytes,
            final,
            save_seconds,
        )
        await self.publish(
            CheckpointSaved(
                rollout_id=event.rollout_id,
                path=str(final),
                weight_version=event.trainer_state.weight_version,
                num_bytes=num_bytes,
                save_seconds=save_seconds,
            )
        )

    @handles(PublicationEvidenceRequested, emits=(PublicationEvidenceWritten, PublicationEvidenceFailed))
    async def on_publication_evidence_requested(self, event: PublicationEvidenceRequested) -> None:
        try:
            await anyio.to_thread.run_sync(write_evidence, event.path, event.evidence)
        except FileExistsError:
            await self.publish(
                PublicationEvidenceFailed(
                    path=event.path, reason=f"{event.path} exists already; evidence is never overwritten"
                )
            )
            return
        except OSError as exc:
            await self.publish(PublicationEvidenceFailed(path=event.path, reason=describe_error(exc)))
            return
        log.info("wrote the checkpoint-backed publication evidence to %s", event.path)
        await self.publish(
            PublicationEvidenceWritten(
                path=event.path, served_digest=event.evidence.served_language_checksum_sha256
            )
        )
