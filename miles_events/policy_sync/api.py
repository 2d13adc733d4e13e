"""What an external policy synchronizer implements, and what its hooks are given.

The hooks, as the seed calls them (every argument by keyword):

- ``initialize(actor_model=, rollout_manager=[, critic_model=])``: once, before the first
  publication (``critic_model`` only in a run with a critic);
- ``after_inference_publication(rollout_id=, actor_model=[, publication_info=])``: after
  every publication is through (verified): ``rollout_id`` None for the initial one, else the
  step it published; ``publication_info`` only to a plugin with a truthy
  ``requires_exact_publication_info``;
- ``after_local_train(rollout_id=, actor_model=, rollout_data=[, critic_model=])``: after
  every step's training, before its save and its publication; a truthy result stops the run
  after that publication;
- ``finalize()``: once, before a completed or stopped run ends.

A plugin declares ``supports_critic`` (truthy) to run with a critic (``trainer.use_critic``);
a run with a critic refuses a plugin that does not.

The facades do their work by commands on the bus and the replies to them (never by calling
an actor): ``ModelFacade.weights`` asks the trainer (or the critic) to stage its weights in
the data plane and reads them back; ``ModelFacade.load_weights`` stages the plugin's and asks
it to load them, keeping its optimizer state (the policy's next publication publishes them,
verified as every publication is). A request unanswered within
``policy_sync.request_timeout_seconds`` raises ``PolicySyncTimeout``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from miles_events.device.fingerprint import weights_digest
from schemas.data import DataRef
from schemas.events import (
    DataReleased,
    Event,
    ModelRole,
    ModelWeightsLoaded,
    ModelWeightsLoadRequested,
    ModelWeightsRequested,
    ModelWeightsStaged,
)

if TYPE_CHECKING:
    import torch

    from miles_events.transport.base import Transport

EXACT_INFO_MISSING = "external policy identity requires the exact weight-publication engines"
"""The seed's error for a plugin that requires the publication info when there is none."""


class PolicySyncError(RuntimeError):
    """A facade's request failed (a reply that says so, weights that do not match their digest)."""


class PolicySyncTimeout(PolicySyncError):
    """A facade's request had no reply in time."""


class PublicationInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What one publication put on the engines, exactly."""

    weight_version: str
    engines: list[str]
    """The engines that loaded it (every engine of the run)."""
    digest: str
    """The trainer's digest of what it published, which every engine matched when verified."""
    num_tensors: int
    rollout_id: int | None
    """The step it published; None for the initial publication."""
    verified: bool
    """The Verifier verified it (False only with ``verifier.enabled = false``)."""


class RolloutSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The rollout a step trained on (``after_local_train``'s ``rollout_data``)."""

    rollout_id: int
    num_samples: int
    reward_mean: float
    weight_versions: list[str]
    """The weight versions its samples were generated with."""


class TrainedWeights(msgspec.Struct, frozen=True, kw_only=True):
    """A model's weights as read back: Hugging Face names, in the dtype it trains in."""

    tensors: dict[str, Any]
    """Name -> ``torch.Tensor`` (a copy: the plugin may keep and change it)."""
    digest: str
    """``weights_digest(tensors)``."""
    weight_version: str
    """The policy's version (the one last published); "" for the critic."""


@runtime_checkable
class PolicySync(Protocol):
    """The hooks a plugin implements (see the module's docstring). ``after_inference_publication``
    may be left out; ``supports_critic`` and ``requires_exact_publication_info`` are optional
    attributes, False when absent."""

    async def initialize(
        self, *, actor_model: ModelFacade, rollout_manager: RolloutManager, **kwargs: Any
    ) -> None: ...

    async def after_local_train(
        self, *, rollout_id: int, actor_model: ModelFacade, rollout_data: RolloutSummary, **kwargs: Any
    ) -> Any: ...

    async def finalize(self) -> None: ...


Publish = Callable[[Event], Awaitable[None]]


class Requests:
    """Commands awaiting their reply, by request id."""

    def __init__(self, publish: Publish, timeout: float, prefix: str = "sync") -> None:
        self.publish = publish
        self.timeout = timeout
        self._ids = (f"{prefix}-{n}" for n in itertools.count(1))
        self._waiting: dict[str, asyncio.Future[Event]] = {}

    def new_id(self) -> str:
        return next(self._ids)

    async def ask(self, command: Any, what: str) -> Any:
        """Publish ``command`` (which carries a fresh ``request_id``) and return its reply."""
        request_id = command.request_id
        future: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            await self.publish(command)
            return await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise PolicySyncTimeout(f"{what}: no reply within {self.timeout:g}s") from None
        finally:
            self._waiting.pop(request_id, None)

    def answer(self, request_id: str, reply: Event) -> None:
        """A reply came: whoever waits for it has it (one nobody waits for is dropped)."""
        future = self._waiting.get(request_id)
        if future is not None and not future.done():
            future.set_result(reply)


class ModelFacade:
    """The trainer (``actor_model``) or the critic (``critic_model``), as a plugin sees it."""

    def __init__(self, role: ModelRole, requests: Requests, transport: Transport, owner: str) -> None:
        self.role = role
        self._requests = requests
        self._transport = transport
        self._owner = owner

    async def weights(self) -> TrainedWeights:
        """The model's current weights, read back from the data plane and checked against
        the digest the model staged them with."""
        requests = self._requests
        staged: ModelWeightsStaged = await requests.ask(
            ModelWeightsRequested(request_id=requests.new_id(), role=self.role),
            f"reading the {self.role}'s weights",
        )
        try:
            tensors = await asyncio.to_thread(self._read, staged.weights)
        finally:
            await requests.publish(DataReleased(ref=staged.weights))
        digest = await asyncio.to_thread(weights_digest, tensors)
        if digest != staged.digest:
            raise PolicySyncError(
                f"the {self.role}'s weights read back do not match the digest they were staged with "
                f"({digest[:16]} != {staged.digest[:16]})"
            )
        return TrainedWeights(tensors=tensors, digest=digest, weight_version=staged.weight_version)

    def _read(self, ref: DataRef) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self._transport.reader.get_tensors(ref).items()}

    async def load_weights(self, tensors: dict[str, torch.Tensor]) -> str:
        """Load ``tensors`` (every tensor of ``weights()``, same names, shapes and dtypes)
        into the live model, keeping its optimizer state; returns the digest of the model's
        weights after the load."""
        requests = self._requests
        request_id = requests.new_id()
        digest = await asyncio.to_thread(weights_digest, tensors)
        stager = self._transport.stager
        ref = await asyncio.to_thread(stager.put_tensors, f"policy-sync-{request_id}", tensors, self._owner)
        try:
            loaded: ModelWeightsLoaded = await requests.ask(
                ModelWeightsLoadRequested(request_id=request_id, role=self.role, weights=ref, digest=digest),
                f"loading weights into the {self.role}",
            )
        finally:
            stager.free(ref)  # the reply (or the failure) means nobody reads it any more
        if loaded.error:
            raise PolicySyncError(f"the {self.role} did not load the weights: {loaded.error}")
        return loaded.digest


class RolloutManager:
    """The engines, as a plugin sees them: what each serves, and the last publication."""

    def __init__(self, engines: tuple[str, ...] = ()) -> None:
        self.engine_versions: dict[str, str] = dict.fromkeys(engines, "default")
        """Engine -> the version it serves: ``"default"`` (its bootstrap weights) until it
        loads a publication."""
        self.last_publication: PublicationInfo | None = None

    def weight_versions(self) -> dict[str, str]:
        """Engine -> the weight version it serves now."""
        return dict(self.engine_versions)

    def publication_info(self) -> PublicationInfo | None:
        """The last publication that went through; None before the first."""
        return self.last_publication
