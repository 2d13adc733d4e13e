"""External policy synchronizers the tests configure (``run.external_policy_sync_path``)."""

from __future__ import annotations

import asyncio
from typing import Any

from schemas.config import Config

CALLS: list[tuple[Any, ...]] = []
"""Every hook call of a ``RecordingSync`` in this process, in order."""


class RecordingSync:
    """Records its hook calls; reads the trained weights and loads them back after every
    step; stops the run after rollout ``policy_sync.peers - 1`` when ``policy_sync.peer`` is
    ``"stop"`` (the run's settings carry the test's choices)."""

    requires_exact_publication_info = True

    def __init__(self, config: Config) -> None:
        self.stop_after = config.policy_sync.peers - 1 if config.policy_sync.peer.startswith("stop") else None

    async def initialize(self, *, actor_model: Any, rollout_manager: Any, **kwargs: Any) -> None:
        CALLS.append(("initialize", rollout_manager.weight_versions(), sorted(kwargs)))

    async def after_inference_publication(
        self, *, rollout_id: Any, actor_model: Any, publication_info: Any
    ) -> None:
        CALLS.append(("after_inference_publication", rollout_id, publication_info))

    async def after_local_train(
        self, *, rollout_id: int, actor_model: Any, rollout_data: Any, **kwargs: Any
    ) -> bool:
        trained = await actor_model.weights()
        loaded = await actor_model.load_weights(trained.tensors)
        CALLS.append(("after_local_train", rollout_id, rollout_data, trained.digest, loaded))
        return self.stop_after is not None and rollout_id >= self.stop_after

    async def finalize(self) -> None:
        CALLS.append(("finalize",))


def not_a_plugin(config: Config) -> object:
    return object()


NOT_CALLABLE = 3


class NoCriticSync(RecordingSync):
    """A plugin that does not declare critic support."""


class CriticSync(RecordingSync):
    """Declares critic support; reads the critic's weights and loads them back after every step."""

    supports_critic = True

    async def after_local_train(
        self, *, rollout_id: int, actor_model: Any, rollout_data: Any, **kwargs: Any
    ) -> bool:
        critic = kwargs["critic_model"]
        trained = await critic.weights()
        CALLS.append(("critic", rollout_id, trained.digest, await critic.load_weights(trained.tensors)))
        return await super().after_local_train(
            rollout_id=rollout_id, actor_model=actor_model, rollout_data=rollout_data
        )


class HangingSync(RecordingSync):
    """A plugin whose ``initialize`` never returns."""

    async def initialize(self, *, actor_model: Any, rollout_manager: Any, **kwargs: Any) -> None:
        await asyncio.Event().wait()
