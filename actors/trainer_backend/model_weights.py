"""A model's weights for an external policy synchronizer: staged for it to read, and its
weights loaded into the live model (the Trainer's and the Critic's ``ModelWeights*``
handlers share these)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_events.device.fingerprint import weights_digest
from miles_events.transport.base import Transport
from schemas.data import DataRef

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
