"""Checksum manifests: content-addressed, written once and atomically, checked when read."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from miles_events.rl.checksum import per_gpu_checksum
from miles_events.rl.checksum_manifest import ManifestError, read_manifest, write_manifest
from schemas.checksums import ChecksumManifest

CHECKSUMS = {"model.norm.weight": "00000000000000ff", "lm_head.weight": "0123456789abcdef"}


def test_a_manifest_is_named_by_its_digest_under_checksums(tmp_path: Path):
    digest, relative = write_manifest(tmp_path, CHECKSUMS)
    assert digest == per_gpu_checksum(CHECKSUMS)
    assert relative == f"checksums/{digest}.msgpack"
    manifest = msgspec.msgpack.decode((tmp_path / relative).read_bytes(), type=ChecksumManifest)
    assert manifest == ChecksumManifest(digest=digest, checksums=CHECKSUMS)
    assert list(manifest.checksums) == sorted(CHECKSUMS)
    assert read_manifest(tmp_path, relative, digest) == CHECKSUMS


def test_a_manifest_of_ranked_names_lists_its_ranks_in_rank_order(tmp_path: Path):
    ranked = {f"rank{gpu}/{name}": f"{gpu:016x}" for gpu in (11, 2, 10, 0, 1) for name in ("w", "b")}
    digest, relative = write_manifest(tmp_path, ranked)
    manifest = msgspec.msgpack.decode((tmp_path / relative).read_bytes(), type=ChecksumManifest)
    assert list(manifest.checksums) == [
        f"rank{gpu}/{name}" for gpu in (0, 1, 2, 10, 11) for name in ("b", "w")
    ]
    assert read_manifest(tmp_path, relative, digest) == ranked


def test_an_existing_manifest_is_not_rewritten_and_no_partial_file_is_left(tmp_path: Path):
    digest, relative = write_manifest(tmp_path, CHECKSUMS)
    path = tmp_path / relative
    before = path.stat()
    os.chmod(path, 0o444)
    assert write_manifest(tmp_path, dict(reversed(list(CHECKSUMS.items())))) == (digest, relative)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_an_empty_set_has_a_manifest_too(tmp_path: Path):
    digest, relative = write_manifest(tmp_path, {})
    assert read_manifest(tmp_path, relative, digest) == {}


@pytest.mark.parametrize(
    ("relative", "message"),
    [
        ("", "no checksums manifest was recorded"),
        ("/etc/passwd", "not a path inside the run directory"),
        ("checksums/../../x.msgpack", "not a path inside the run directory"),
        (
            "checksums/missing.msgpack",
            "cannot read checksums manifest checksums/missing.msgpack: No such file",
        ),
    ],
)
def test_a_manifest_that_cannot_be_used_is_one_line_naming_why(tmp_path: Path, relative: str, message: str):
    with pytest.raises(ManifestError) as raised:
        read_manifest(tmp_path, relative, per_gpu_checksum(CHECKSUMS))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_manifest_of_another_digest_or_garbage_is_refused(tmp_path: Path):
    digest, relative = write_manifest(tmp_path, CHECKSUMS)
    with pytest.raises(ManifestError, match="holds the checksums of digest"):
        read_manifest(tmp_path, relative, "0" * 64)
    (tmp_path / relative).chmod(0o644)
    (tmp_path / relative).write_bytes(b"\xc1")
    with pytest.raises(ManifestError, match="does not decode"):
        read_manifest(tmp_path, relative, digest)
