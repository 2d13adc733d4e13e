"""The one rule for tied weights: which names of a state dict are the same tensor.

Two names are one tensor (say ``lm_head.weight`` tied to ``model.embed_tokens.weight``)
when their tensors are the same view of the same memory: same device, storage, storage
offset, dtype, shape and strides. The trainer publishes only the first name of each tensor,
an engine serves and checksums only that name (and accepts a load under either), and a
checkpoint gives every name its own bytes; all three ask this module, so they cannot
disagree about which names a publication carries.

Empty tensors and tensors without memory (the meta device) are never tied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


TensorIdentity = tuple[str, int, int, "torch.dtype", tuple[int, ...], tuple[int, ...]]


def tensor_identity(tensor: torch.Tensor) -> TensorIdentity | None:
    """What makes two tensors one tensor under two names; None when it cannot be tied."""
    if tensor.numel() == 0:
        return None
    pointer = tensor.untyped_storage().data_ptr()
    if pointer == 0:
        return None
    return (
        str(tensor.device),
        pointer,
        int(tensor.storage_offset()),
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def split_tied(named: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the first name of every tensor -> tensor, each tied duplicate name -> that first name),
    in the order of ``named``."""
    unique: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_of: dict[TensorIdentity, str] = {}
    for name, tensor in named.items():
        identity = tensor_identity(tensor)
        if identity is not None:
            first = first_of.setdefault(identity, name)
            if first != name:
                tied[name] = first
                continue
        unique[name] = tensor
    return unique, tied
