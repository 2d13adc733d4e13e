"""The seed's checks of a publication as the inference engines report it, one function each,
with the seed's error messages (``RuntimeError``), over replies in SGLang's shapes.

A reply of the whole rollout side is a list of server groups, each a list of engine bodies:
an engine's ``/weights_checker`` reply, or ``None`` from a node that is not an engine's first
(miles' ``check_weights`` fans out to every node). Checksums are canonical as the seed makes
them: per engine the sorted ``(f"rank{r}/{name}", checksum)`` pairs, engines sorted, so that
two moments of the same publication compare equal and hash to the same digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from miles_events.rl.checksum import ChecksumReplyError, ranked_checksums
from schemas.checksums import EngineChecksumReport

CanonicalChecksums = tuple[tuple[tuple[str, str], ...], ...]


def engine_bodies(raw: Any, action: str) -> list[Any]:
    """The engines' bodies of a fanned-out reply, ``None`` bodies (non-first nodes) dropped."""
    try:
        return [body for server_group in raw for body in server_group if body is not None]
    except TypeError as error:
        raise RuntimeError(f"inference weight check {action!r} returned a malformed response") from error


def flatten_inference_engine_checksums(raw: Any) -> list[dict[str, str]]:
    """Per engine, ``{f"rank{r}/{name}": checksum}`` over all its ranks in rank order (miles'
    flattening): at least one body must not be ``None``; every body must have succeeded, and
    its ranks pass ``ordered_ranks`` (some ranks, each with tensors and one GPU rank, the one
    distinct ``rank`` of its ``parallelism_info``, a dict or a list of dicts with roles, no
    GPU rank twice). Each error names the body: its server group and its place there."""
    try:
        located = [
            (group, place, body) for group, bodies in enumerate(raw) for place, body in enumerate(bodies)
        ]
    except TypeError as error:
        raise RuntimeError("inference weight check 'checksum' returned a malformed response") from error
    flattened = []
    for group, place, body in located:
        if body is None:
            continue
        where = f"server group {group} engine {place}"
        try:
            report = msgspec.convert(body, EngineChecksumReport)
        except msgspec.ValidationError as error:
            raise RuntimeError(f"inference weight checksum reply of {where} is malformed: {error}") from None
        if not report.success:
            raise RuntimeError(
                f"inference weight checksum did not succeed on {where}: {report.message or 'no message'}"
            )
        try:
            flattened.append(ranked_checksums(report))
        except ChecksumReplyError as error:
            raise RuntimeError(f"inference weight checksum of {where}: {error}") from None
    if not flattened:
        # Only None bodies: the checksum action reached no engine.
        raise RuntimeError("inference weight checksum response was empty")
    return flattened


def canonical_inference_checksums(raw: Any) -> CanonicalChecksums:
    return canonical_checksums(flatten_inference_engine_checksums(raw))


def canonical_checksums(engines: Sequence[Mapping[str, str]]) -> CanonicalChecksums:
    """The canonical form of every engine's flattened checksums (``rank{r}/{name}`` keys)."""
    canonical = tuple(sorted(tuple(sorted(body.items())) for body in engines))
    if not canonical or any(not body for body in canonical):
        raise RuntimeError("inference weight checksum response was empty")
    return canonical


def checksum_digest(checksums: CanonicalChecksums) -> str:
    """sha256 of the canonical checksums as compact ASCII JSON (the evidence file's digests)."""
    encoded = json.dumps(checksums, ensure_ascii=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()


def changed_checksum_count(before: CanonicalChecksums, after: CanonicalChecksums) -> int:
    """Tensors, over every engine, whose checksum differs between two moments."""
    if len(before) != len(after):
        raise RuntimeError("inference engine count changed during checkpoint publication")
    changed = 0
    for before_engine, after_engine in zip(before, after, strict=True):
        before_map, after_map = dict(before_engine), dict(after_engine)
        if before_map.keys() != after_map.keys():
            raise RuntimeError("inference tensor roster changed during checkpoint publication")
        changed += sum(before_map[name] != after_map[name] for name in before_map)
    return changed


def require_weight_check_success(raw: Any, *, action: str) -> None:
    bodies = engine_bodies(raw, action)
    if not bodies or any(not isinstance(body, dict) or body.get("success") is not True for body in bodies):
        raise RuntimeError(f"inference weight check {action!r} did not succeed on every engine")


def canonical_weight_versions(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list | tuple) or not raw:
        raise RuntimeError("inference weight-version response was empty")
    versions: list[str] = []
    for value in raw:
        if not isinstance(value, str) or not value:
            raise RuntimeError(f"inference weight version is invalid: {value!r}")
        versions.append(value)
    return tuple(versions)


def require_initial_version_publication(before: Sequence[str], after: Sequence[str]) -> None:
    if len(before) != len(after) or any(v != "default" for v in before) or any(v != "1" for v in after):
        raise RuntimeError(
            "initial checkpoint publication did not transition every inference "
            "weight version from 'default' to '1': "
            f"{tuple(before)!r} -> {tuple(after)!r}"
        )


def require_version_increment(before: Sequence[str], after: Sequence[str], *, action: str) -> None:
    before, after = tuple(before), tuple(after)
    if (
        len(before) != len(after)
        or any(not value.isdigit() for value in before + after)
        or any(int(current) != int(previous) + 1 for previous, current in zip(before, after, strict=True))
    ):
        raise RuntimeError(
            f"{action} did not increment every inference weight version exactly once: {before!r} -> {after!r}"
        )
