"""The policy-sync driver: runs the hooks of the external policy synchronizer that
``run.external_policy_sync_path`` names (the seed's plugin), when the Coordinator asks.

It exists only in a run that names one. At start it builds the plugin (``policy_sync.peer``
unset becomes the run id). On ``PolicySyncRequested(hook, rollout_id)`` it runs the hook in a
task of its own (a hook awaits replies that reach this actor's handlers), one hook at a
time, and answers ``PolicySyncFinished`` (with the truthy result of ``after_local_train`` as
``stop``) or ``PolicySyncFailed`` with one line. A stop ``now`` (a second signal, or a step
past ``run.stop_grace_seconds``) cuts the hook in progress: it fails, and the run with it,
since what a cut plugin left behind is unknown. Its handlers meanwhile keep what the hooks
are given: the replies to the facades' commands, each engine's served version and the last
publication (``rollout_manager``, ``publication_info``), the last rollout (``rollout_data``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.policy_sync.api import (
    EXACT_INFO_MISSING,
    ModelFacade,
    PublicationInfo,
    Requests,
    RolloutManager,
    RolloutSummary,
)
from miles_events.policy_sync.loader import load_policy_sync
from schemas.config import Config
from schemas.events import (
    DataReleased,
    Event,
    ModelWeightsLoaded,
    ModelWeightsLoadRequested,
    ModelWeightsRequested,
    ModelWeightsStaged,
    PolicySyncFailed,
    PolicySyncFinished,
    PolicySyncRequested,
    PublicationVerified,
    RolloutGenerated,
    StopRequested,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)

logger = logging.getLogger(__name__)

HOOK_EMITS = (
    ModelWeightsRequested,
    ModelWeightsLoadRequested,
    DataReleased,
    PolicySyncFinished,
    PolicySyncFailed,
)
"""What a hook's task publishes: the facades' commands, what they release, the answer."""


class PolicySyncDriver(Actor):
    name = "policy_sync"

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self.plugin: Any = None
        self.requests = Requests(self.publish, config.policy_sync.request_timeout_seconds)
        self.rollout_manager = RolloutManager(context.plan.engines)
        self.actor_model = ModelFacade("actor", self.requests, context.transport, self.name)
        self.critic_model = (
            ModelFacade("critic", self.requests, context.transport, self.name)
            if config.trainer.use_critic
            else None
        )
        self._one_at_a_time = asyncio.Lock()
        self._running: asyncio.Task[None] | None = None
        """The task of the hook in progress."""
        self._cut: str | None = None
        """Why the hook in progress was cut (a stop ``now``)."""
        self._staged: dict[str, WeightsStaged] = {}
        """Weight version -> its staging (the digest a publication's info carries)."""
        self._rollouts: dict[int, RolloutSummary] = {}

    @classmethod
    def wanted(cls, config: Config) -> bool:
        return config.run.external_policy_sync_path is not None

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        # Beside the Coordinator: its hooks are the seed's driver-side calls.
        return WorkerGroup(role="driver")

    async def start(self) -> None:
        settings = self.config.policy_sync
        named = msgspec.structs.replace(settings, peer=settings.peer or self.context.run_id)
        self.plugin = load_policy_sync(msgspec.structs.replace(self.config, policy_sync=named))

    # -- the hooks ----------------------------------------------------------------------

    @handles(PolicySyncRequested, emits=())
    async def on_policy_sync_requested(self, event: PolicySyncRequested) -> None:
        self.spawn(self._run_hook(event), emits=HOOK_EMITS)

    def interrupt(self, event: Event) -> None:
        if (
            isinstance(event, StopRequested)
            and event.now
            and self._running is not None
            and not self._running.done()
        ):
            self._cut = event.reason
            self._running.cancel()

    async def _run_hook(self, event: PolicySyncRequested) -> None:
        async with self._one_at_a_time:
            started = time.perf_counter()
            self._running, self._cut = asyncio.current_task(), None
            try:
                result = await self._call(event)
            except asyncio.CancelledError:
                if self._cut is None:
                    raise  # the run is ending: nobody waits for an answer
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                reason = f"cut by a stop: {self._cut}"
                await self.publish(
                    PolicySyncFailed(hook=event.hook, rollout_id=event.rollout_id, reason=reason)
                )
                return
            except Exception as error:  # the run fails with it, named
                logger.debug("policy sync %s failed", event.hook, exc_info=True)
                reason = (
                    f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
                )
                await self.publish(
                    PolicySyncFailed(hook=event.hook, rollout_id=event.rollout_id, reason=reason)
                )
                return
            await self.publish(
                PolicySyncFinished(
                    hook=event.hook,
                    rollout_id=event.rollout_id,
                    stop=bool(result) if event.hook == "after_local_train" else False,
                    seconds=time.perf_counter() - started,
                )
            )

    async def _call(self, event: PolicySyncRequested) -> Any:
        plugin, critic = self.plugin, self.critic_model
        with_critic: dict[str, Any] = {"critic_model": critic} if critic is not None else {}
        if event.hook == "initialize":
            return await plugin.initialize(
                actor_model=self.actor_model, rollout_manager=self.rollout_manager, **with_critic
            )
        if event.hook == "after_local_train":
            assert event.rollout_id is not None
            summary = self._rollouts.pop(event.rollout_id, None) or RolloutSummary(
                rollout_id=event.rollout_id, num_samples=0, reward_mean=0.0, weight_versions=[]
            )
            return await plugin.after_local_train(
                rollout_id=event.rollout_id, actor_model=self.actor_model, rollout_data=summary, **with_critic
            )
        if event.hook == "after_inference_publication":
            callback = getattr(plugin, "after_inference_publication", None)
            if callback is None:
                return None
            kwargs: dict[str, Any] = {"rollout_id": event.rollout_id, "actor_model": self.actor_model}
            if getattr(plugin, "requires_exact_publication_info", False):
                info = self.rollout_manager.last_publication
                if info is None or info.rollout_id != event.rollout_id:
                    raise RuntimeError(EXACT_INFO_MISSING)
                kwargs["publication_info"] = info
            return await callback(**kwargs)
        return await plugin.finalize()

    # -- replies to the facades ------------------------------------------------------------

    @handles(ModelWeightsStaged, emits=())
    async def on_model_weights_staged(self, event: ModelWeightsStaged) -> None:
        self.requests.answer(event.request_id, event)

    @handles(ModelWeightsLoaded, emits=())
    async def on_model_weights_loaded(self, event: ModelWeightsLoaded) -> None:
        self.requests.answer(event.request_id, event)

    # -- what the hooks are given ------------------------------------------------------------

    @handles(RolloutGenerated, emits=())
    async def on_rollout_generated(self, event: RolloutGenerated) -> None:
        self._rollouts[event.rollout_id] = RolloutSummary(
            rollout_id=event.rollout_id,
            num_samples=event.num_samples,
            reward_mean=event.reward_mean,
            weight_versions=list(event.weight_versions),
        )

    @handles(WeightsStaged, emits=())
    async def on_weights_staged(self, event: WeightsStaged) -> None:
        self._staged = {event.weight_version: event}  # the one in flight

    @handles(WeightsLoaded, emits=())
    async def on_weights_loaded(self, event: WeightsLoaded) -> None:
        self.rollout_manager.engine_versions[event.engine] = event.weight_version

    @handles(WeightsPublished, emits=())
    async def on_weights_published(self, event: WeightsPublished) -> None:
        if not self.config.verifier.enabled:
            self._record(event.weight_version, event.engines, event.rollout_id, verified=False)

    @handles(PublicationVerified, emits=())
    async def on_publication_verified(self, event: PublicationVerified) -> None:
        self._record(event.weight_version, event.engines, event.rollout_id, verified=True)

    def _record(self, version: str, engines: list[str], rollout_id: int | None, verified: bool) -> None:
        staged = self._staged.get(version)
        self.rollout_manager.last_publication = PublicationInfo(
            weight_version=version,
            engines=list(engines),
            digest=staged.digest if staged is not None else "",
            num_tensors=staged.num_tensors if staged is not None else 0,
            rollout_id=rollout_id,
            verified=verified,
        )
