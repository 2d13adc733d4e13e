"""Tensor fingerprints: what the trainer and every engine compute over the bytes they
publish and serve.

The per-tensor fingerprint is a 64-bit position-dependent multiply-xorshift hash of the
tensor's raw words, computed where the tensor lives (numpy on the CPU, torch integer ops or
the fused Triton kernel of ``checksum_triton`` on a GPU), then bound to dtype and shape:
equal fingerprints mean (with overwhelming probability) equal bytes. The digests over sets
of them are ``miles_events.rl.checksum``'s.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from miles_events.rl.checksum import is_skipped

if TYPE_CHECKING:
    import numpy as np
    import torch

    from schemas.data import BucketLayout, TensorSlot

_CHUNK_WORDS = 1 << 16
# Odd 64-bit constants (from splitmix64), as signed int64 so torch arithmetic wraps.
K1 = 0x9E3779B97F4A7C15 - (1 << 64)
K2 = 0xBF58476D1CE4E5B9 - (1 << 64)
K3 = 0x94D049BB133111EB - (1 << 64)


def _wrap64(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.int64)


def _mix_sum_numpy(words: np.ndarray) -> int:
    """The same sum as ``_mix_sum_torch``, for CPU tensors: numpy's per-call overhead is a
    fraction of torch's, which matters for the many small tensors of a model."""
    import numpy as np

    acc = 0
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _CHUNK_WORDS):
            chunk = words[start : start + _CHUNK_WORDS]
            m = chunk * np.int64(K1)
            m += np.arange(start, start + chunk.size, dtype=np.int64) * np.int64(K2)
            m ^= m >> 31
            m *= np.int64(K3)
            m ^= m >> 29
            acc = _wrap64(acc + int(m.sum(dtype=np.int64)))
    return acc


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """16 hex digits identifying the tensor's dtype, shape and every byte of its data."""
    words = _words(tensor)
    if words.device.type == "cpu":
        total = _mix_sum_numpy(words.numpy())
    elif words.device.type == "cuda" and (fused := _triton_mix_sum()) is not None:
        total = fused(words, K1, K2, K3)
    else:
        total = _mix_sum_torch(words)
    return fingerprint_from_sum(tensor.dtype, tuple(tensor.shape), total)


def fingerprint_from_sum(dtype: torch.dtype, shape: tuple[int, ...], total: int) -> str:
    """The fingerprint of a tensor of ``dtype`` and ``shape`` whose mixed words sum to
    ``total``: the sum bound to dtype and shape."""
    header = f"{dtype}|{tuple(shape)}|{total}".encode()
    return hashlib.blake2b(header, digest_size=8).hexdigest()


@functools.cache
def _triton_mix_sum() -> Callable[[torch.Tensor, int, int, int], int] | None:
    """The fused CUDA kernel over one tensor, when Triton is installed, else None."""
    try:
        from miles_events.device.checksum_triton import mix_sum
    except ImportError:
        return None
    return mix_sum


@functools.cache
def triton_segment_sums() -> (
    Callable[[torch.Tensor, BucketLayout, tuple[TensorSlot, ...], int, int, int], list[int]] | None
):
    """The fused CUDA kernel over every tensor of a bucket, when Triton is installed, else
    None (``checksum_triton.segment_sums``)."""
    try:
        from miles_events.device.checksum_triton import segment_sums
    except ImportError:
        return None
    return segment_sums


def _mix_chunk(chunk: torch.Tensor, start: int) -> torch.Tensor:
    """The multiply-xorshift of one chunk of words at global offset ``start``, summed."""
    import torch

    index = torch.arange(chunk.numel(), dtype=torch.int64, device=chunk.device) + start
    mixed = chunk * K1 + index * K2
    mixed = mixed ^ (mixed >> 31)
    mixed = mixed * K3
    mixed = mixed ^ (mixed >> 29)
    return mixed.sum()


# On an accelerator, chunks are large: kernel launches, not bytes, are the cost of small ones.
_DEVICE_CHUNK_WORDS = 1 << 25


def _mix_sum_torch(words: torch.Tensor) -> int:
    """Position-dependent multiply-xorshift of every word, summed modulo 2**64, on the
    tensor's own device."""
    import torch

    step = _DEVICE_CHUNK_WORDS if words.device.type != "cpu" else _CHUNK_WORDS
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), step):
        acc += _mix_chunk(words[start : start + step], _wrap64(start))
    return int(acc.item())


def fingerprints(tensors: Mapping[str, torch.Tensor], skip_tensor_list: Iterable[str] = ()) -> dict[str, str]:
    skip = list(skip_tensor_list)
    return {name: tensor_fingerprint(t) for name, t in tensors.items() if not is_skipped(name, skip)}


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """64 hex digits identifying a set of named tensors: every name with its tensor's
    fingerprint (dtype, shape and data), in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(f"{name}\0{tensor_fingerprint(tensors[name])}\n".encode())
    return digest.hexdigest()
