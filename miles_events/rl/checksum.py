"""Checksums for publication verification, over per-tensor fingerprints
(``miles_events.device.fingerprint``).

The digest over a whole set is SGLang's ``per_gpu_checksum`` (sha256 over the sorted name + hash pairs), and
the digest of an engine's ranks its ``per_engine_checksum``: one definition each, here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from schemas.checksums import EngineChecksumReport, RankChecksums

if TYPE_CHECKING:
    pass


def is_skipped(name: str, skip_tensor_list: Iterable[str]) -> bool:
    return any(part in name for part in skip_tensor_list)


def per_gpu_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's ``per_gpu_checksum``: sha256 over ``name + fingerprint`` of every tensor, in
    sorted name order, with no separators (``utils/weight_checker.py``)."""
    return hashlib.sha256(
        b"".join(name.encode() + checksums[name].encode() for name in sorted(checksums))
    ).hexdigest()


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
