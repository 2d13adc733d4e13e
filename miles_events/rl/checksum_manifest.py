"""Per-tensor checksum maps as content-addressed files under the run directory.

A publication's events carry a digest and counts, whatever the model's size; the map of
tensor name -> fingerprint behind a digest is written once, to
``<run_dir>/checksums/<digest>.msgpack`` (a ``schemas.checksums.ChecksumManifest`` in
msgpack), and the events name that path relative to the run directory. The trainer and
every engine that serve the same weights have the same digest, so one publication writes
one file. A manifest is read only to name the tensors of a mismatch, so the trainer, which
wrote it, removes it once the publication it names is verified: only mismatches keep theirs.

Writes are atomic and never replace a manifest: the bytes go to a private temporary file
that is hard-linked to the final name only if that name does not exist yet.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import msgspec

from miles_events.rl.checksum import checksum_order, per_gpu_checksum
from schemas.checksums import ChecksumManifest

MANIFEST_DIR = "checksums"


class ManifestError(ValueError):
    """A manifest cannot be used; the message (one line) says which and why."""


def manifest_path(digest: str) -> str:
    """Where the manifest of ``digest`` lies, relative to the run directory."""
    return f"{MANIFEST_DIR}/{digest}.msgpack"


def write_manifest(run_dir: str | os.PathLike[str], checksums: Mapping[str, str]) -> tuple[str, str]:
    """Keep ``checksums`` under the run directory; returns (their digest, the manifest's path
    relative to ``run_dir``). A manifest that exists already is left as it is. Names are kept
    in ``checksum_order``: by name, an engine's ``rank{r}/`` names by rank number first."""
    digest = per_gpu_checksum(checksums)
    relative = manifest_path(digest)
    final = Path(run_dir) / relative
    if final.exists():
        return digest, relative
    final.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.msgpack.encode(
        ChecksumManifest(
            digest=digest, checksums=dict(sorted(checksums.items(), key=lambda item: checksum_order(item[0])))
        )
    )
    partial = final.with_name(f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(partial, "xb") as f:
            f.write(data)
        try:
            os.link(partial, final)
        except FileExistsError:
            pass  # written meanwhile by another side of the same publication
        except OSError:
            if not final.exists():
                os.replace(partial, final)  # a filesystem without hard links
    finally:
        partial.unlink(missing_ok=True)
    return digest, relative


def remove_manifest(run_dir: str | os.PathLike[str], relative: str) -> None:
    """Drop a manifest nobody will read: the publication it names was verified."""
    if relative and not PurePosixPath(relative).is_absolute() and ".." not in PurePosixPath(relative).parts:
        (Path(run_dir) / relative).unlink(missing_ok=True)


def read_manifest(run_dir: str | os.PathLike[str], relative: str, digest: str) -> dict[str, str]:
    """The checksums of the manifest at ``relative``, checked against ``digest``.

    Raises ``ManifestError`` when the event names no manifest, the path leaves the run
    directory, the file cannot be read or decoded, or it holds the checksums of another
    digest.
    """
    if not relative:
        raise ManifestError("no checksums manifest was recorded")
    parts = PurePosixPath(relative).parts
    if PurePosixPath(relative).is_absolute() or ".." in parts:
        raise ManifestError(f"checksums manifest {relative!r} is not a path inside the run directory")
    try:
        data = (Path(run_dir) / relative).read_bytes()
    except OSError as error:
        raise ManifestError(f"cannot read checksums manifest {relative}: {error.strerror or error}") from None
    try:
        manifest = msgspec.msgpack.decode(data, type=ChecksumManifest)
    except msgspec.DecodeError as error:
        raise ManifestError(f"checksums manifest {relative} does not decode: {error}") from None
    actual = per_gpu_checksum(manifest.checksums)
    if actual != digest:
        raise ManifestError(
            f"checksums manifest {relative} holds the checksums of digest {actual}, not {digest}"
        )
    return manifest.checksums
