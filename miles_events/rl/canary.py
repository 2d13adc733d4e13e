"""The publication canary: proof that an engine's load applied this publication's payload.

Digests prove that an engine serves what the trainer published, but not that it *wrote*
it: when the published weights equal what the engine already serves (the first
publication after a bootstrap from the same base model, or a step that left the weights as
they were), a load that wrote nothing agrees too. So every publication's payload carries
one more tensor, ``CANARY_TENSOR``: 16 bytes derived from the run id and the weight
version, different for every publication. An engine keeps the canary of the payload it
loaded and reports its fingerprint (``tensor_fingerprint``, as of any tensor); one that reports another publication's canary, or
none, did not apply this payload. The canary is not a model tensor: it is left out of
every checksum and weight-checker action, and never reaches the model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CANARY_TENSOR = "miles_events.publication_canary"
CANARY_BYTES = 16


def publication_canary(run_id: str, weight_version: str) -> torch.Tensor:
    """The canary of publication ``weight_version`` of run ``run_id`` (uint8, 16 bytes)."""
    import torch

    digest = hashlib.blake2b(f"{run_id}:{weight_version}".encode(), digest_size=CANARY_BYTES).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def split_canary(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A payload's model tensors, and its canary (None when it carries none)."""
    model = {name: tensor for name, tensor in tensors.items() if name != CANARY_TENSOR}
    return model, tensors.get(CANARY_TENSOR)
