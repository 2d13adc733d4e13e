"""Tensor fingerprints for publication verification.

The trainer fingerprints exactly the bytes it publishes and every engine fingerprints
exactly the bytes it serves; equal fingerprints mean (with overwhelming probability) equal
bytes. The per-tensor fingerprint is a 64-bit position-dependent multiply-xorshift hash of
the tensor's raw words, computed with torch integer ops so that it runs where the tensor
lives (CPU or GPU) at memory bandwidth, then bound to dtype and shape. The digest over a
whole set is SGLang's ``per_gpu_checksum`` (sha256 over the sorted name + hash pairs), and
the digest of an engine's ranks its ``per_engine_checksum``: one definition each, here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from schemas.checksums import EngineChecksumReport, RankChecksums

if TYPE_CHECKING:
    import numpy as np
    import torch

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
    elif words.device.type == "cuda" and _triton_mix_sum() is not None:
        total = _triton_mix_sum()(words, K1, K2, K3)  # type: ignore[misc]
    else:
        total = _mix_sum_torch(words)
    return fingerprint_from_sum(tensor.dtype, tuple(tensor.shape), total)


def fingerprint_from_sum(dtype: torch.dtype, shape: tuple[int, ...], total: int) -> str:
    """The fingerprint of a tensor of ``dtype`` and ``shape`` whose mixed words sum to
    ``total``: the sum bound to dtype and shape."""
    header = f"{dtype}|{tuple(shape)}|{total}".encode()
    return hashlib.blake2b(header, digest_size=8).hexdigest()


def _triton(name: str):  # type: ignore[no-untyped-def]
    """``checksum_triton.<name>`` when Triton is installed, else None (cached)."""
    if name not in _TRITON:
        try:
            from miles_events.rl import checksum_triton

            _TRITON[name] = getattr(checksum_triton, name)
        except ImportError:
            _TRITON[name] = None
    return _TRITON[name]


def _triton_mix_sum():  # type: ignore[no-untyped-def]
    """The fused CUDA kernel over one tensor, when Triton is installed, else None."""
    return _triton("mix_sum")


def triton_segment_sums():  # type: ignore[no-untyped-def]
    """The fused CUDA kernel over every tensor of a bucket, when Triton is installed, else
    None (``checksum_triton.segment_sums``)."""
    return _triton("segment_sums")


_TRITON: dict[str, object] = {}


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


def is_skipped(name: str, skip_tensor_list: Iterable[str]) -> bool:
    return any(part in name for part in skip_tensor_list)


def fingerprints(
    tensors: Mapping[str, torch.Tensor], skip_tensor_list: Iterable[str] = ()
) -> dict[str, str]:
    skip = list(skip_tensor_list)
    return {name: tensor_fingerprint(t) for name, t in tensors.items() if not is_skipped(name, skip)}


def per_gpu_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's ``per_gpu_checksum``: sha256 over ``name + fingerprint`` of every tensor, in
    sorted name order, with no separators (``utils/weight_checker.py``)."""
    return hashlib.sha256(b"".join(name.encode() + checksums[name].encode() for name in sorted(checksums))).hexdigest()


def per_engine_checksum(per_gpu_checksums: Iterable[str]) -> str:
    """SGLang's ``per_engine_checksum``: sha256 over the per-GPU checksums of one engine joined
    in TP-rank order, with no separators."""
    return hashlib.sha256("".join(per_gpu_checksums).encode()).hexdigest()


class ChecksumReplyError(ValueError):
    """An engine's ``checksum`` reply that cannot serve as evidence of what it serves; the
    message (one line, without the engine's name) says what is wrong, naming the rank."""


def rank_of(rank: RankChecksums) -> int:
    """A rank's GPU rank: the one distinct ``rank`` across its ``parallelism_info``."""
    infos = rank.parallelism_info if isinstance(rank.parallelism_info, list) else [rank.parallelism_info]
    ranks = {info.rank for info in infos}
    if len(ranks) != 1:
        raise ValueError(
            f"parallelism_info names {len(ranks)} GPU ranks ({sorted(ranks)}) across its roles, expected one GPU rank"
        )
    return ranks.pop()


def ordered_ranks(report: EngineChecksumReport) -> list[tuple[int, RankChecksums]]:
    """The ranks of a ``checksum`` reply with their GPU ranks, in rank order (replies list
    them in the order they were gathered).

    Raises ``ChecksumReplyError`` for an unsuccessful reply, one without ranks, a rank whose
    roles name different GPU ranks, a GPU rank reported twice (its evidence would overwrite
    or hide the other's), or a rank without tensors (it would drop out of the comparison).
    """
    if not report.success:
        raise ChecksumReplyError(f"the checksum action failed: {report.message or 'no message'}")
    if not report.ranks:
        raise ChecksumReplyError("the checksum reply has no ranks")
    by_rank: dict[int, RankChecksums] = {}
    for entry, rank in enumerate(report.ranks):
        try:
            gpu = rank_of(rank)
        except ValueError as error:
            raise ChecksumReplyError(f"rank entry {entry} of the checksum reply: {error}") from None
        if gpu in by_rank:
            raise ChecksumReplyError(f"the checksum reply reports rank {gpu} twice")
        if not rank.checksums:
            raise ChecksumReplyError(f"rank {gpu} of the checksum reply has no tensors")
        by_rank[gpu] = rank
    return sorted(by_rank.items(), key=lambda item: item[0])


def report_checksums(report: EngineChecksumReport) -> dict[str, str]:
    """One engine's checksums by name, from its ``checksum`` reply: a single rank's as they
    are; with several ranks ``rank{r}/{name}`` in rank order (miles'
    ``flatten_inference_engine_checksums``).

    Raises ``ChecksumReplyError`` as ``ordered_ranks`` does.
    """
    ranks = ordered_ranks(report)
    if len(ranks) == 1:
        return dict(ranks[0][1].checksums)
    return _prefixed(ranks)


def ranked_checksums(report: EngineChecksumReport) -> dict[str, str]:
    """One engine's checksums as miles flattens them, whatever its rank count:
    ``rank{r}/{name}`` for every rank, in rank order (the names the seed's canonical
    checksums use).

    Raises ``ChecksumReplyError`` as ``ordered_ranks`` does.
    """
    return _prefixed(ordered_ranks(report))


def _prefixed(ranks: list[tuple[int, RankChecksums]]) -> dict[str, str]:
    return {f"rank{gpu}/{name}": value for gpu, rank in ranks for name, value in rank.checksums.items()}


_RANK_PREFIX = re.compile(r"rank(\d+)/")


def checksum_order(name: str) -> tuple[int, str]:
    """Sort key of checksum names: ``rank{r}/{name}`` by rank number, then name (``rank10``
    after ``rank9``); names without a rank prefix by name, before any ranked one."""
    match = _RANK_PREFIX.match(name)
    return (int(match.group(1)), name[match.end() :]) if match else (-1, name)
