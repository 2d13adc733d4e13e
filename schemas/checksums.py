"""Checksum reports in the shape of SGLang's ``/weights_checker`` ``checksum`` action."""

from __future__ import annotations

import msgspec


class RankChecksums(msgspec.Struct, frozen=True, kw_only=True):
    checksums: dict[str, str]
    per_gpu_checksum: str
    parallelism_info: list[dict[str, int]] = []


class EngineChecksumReport(msgspec.Struct, frozen=True, kw_only=True):
    success: bool
    message: str
    ranks: list[RankChecksums]
    per_engine_checksum: str
