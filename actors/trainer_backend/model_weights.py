"""A model's weights for an external policy synchronizer: staged for it to read, and its
weights loaded into the live model (the Trainer's and the Critic's ``ModelWeights*``
handlers share these)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from miles_events.device.fingerprint import weights_digest
from miles_events.transport.base import Transport
from schemas.data import DataRef
from schemas.events import (
    ModelWeightsLoaded,
    ModelWeightsLoadRequested,
    ModelWeightsRequested,
    ModelWeightsStaged,
)

if TYPE_CHECKING:
    from actors.trainer_backend.base import TrainerBackend


def stage_weights(
    backend: TrainerBackend, transport: Transport, key: str, owner: str
) -> tuple[DataRef, str, int]:
    """The model's weights (``named_weights``, in the dtype it trains in) staged under
    ``key``; returns (reference, ``weights_digest``, tensor count)."""
    weights = backend.named_weights()
    digest = weights_digest(weights)
    return transport.stager.put_tensors(key, weights, owner=owner), digest, len(weights)


def load_weights(backend: TrainerBackend, transport: Transport, ref: DataRef, digest: str) -> str:
    """Load the weights behind ``ref`` (checked against ``digest``) into the live model,
    keeping the optimizer's state, RNG and step count; returns the model's digest after."""
    weights = transport.reader.get_tensors(ref)
    got = weights_digest(weights)
    if got != digest:
        raise ValueError(
            f"the weights read do not match the digest they were staged with ({got[:16]} != {digest[:16]})"
        )
    backend.load_state(
        weights, backend.optimizer_state_dict(), backend.rng_state(), backend.num_optimizer_steps
    )
    return weights_digest(backend.named_weights())


async def weights_staged(
    backend: TrainerBackend,
    transport: Transport,
    event: ModelWeightsRequested,
    owner: str,
    weight_version: str,
) -> ModelWeightsStaged:
    """Stage the model's weights (off the event loop) for ``event``: the fact that answers it."""
    key = f"policy-sync-{event.request_id}"
    ref, digest, count = await anyio.to_thread.run_sync(stage_weights, backend, transport, key, owner)
    return ModelWeightsStaged(
        request_id=event.request_id,
        role=event.role,
        weights=ref,
        digest=digest,
        num_tensors=count,
        weight_version=weight_version,
    )


async def weights_loaded(
    backend: TrainerBackend, transport: Transport, event: ModelWeightsLoadRequested
) -> ModelWeightsLoaded:
    """Load ``event``'s weights (off the event loop): the fact that answers it, with the
    error when they do not fit (the model as it was)."""
    try:
        digest = await anyio.to_thread.run_sync(load_weights, backend, transport, event.weights, event.digest)
    except ValueError as error:
        return ModelWeightsLoaded(request_id=event.request_id, role=event.role, error=str(error))
    return ModelWeightsLoaded(request_id=event.request_id, role=event.role, digest=digest)
