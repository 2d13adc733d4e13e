"""Policy averaging through a shared directory: several runs train side by side (one host,
or hosts that share a file system) and, after every step, each replaces its policy with the
mean of all of theirs, before the step is saved and published.

    run.external_policy_sync_path = "miles_events.policy_sync.shared_dir:SharedDirSync"
    [policy_sync]
    directory = "/shared/sync"   # the same for every run
    peers = 2                    # how many runs take part
    peer = "a"                   # this run's name (unset: the run id)

A round (``initial`` before the first publication when ``policy_sync.sync_initial``, then
one per rollout id) goes:

1. read this run's trained weights back from its trainer;
2. write them as ``<directory>/round-<round>/<peer>.safetensors``: to a temporary name,
   fsynced, renamed into place; then ``<peer>.sha256`` (the file's SHA-256) the same way.
   A peer's weights count as written once their ``.sha256`` is there;
3. wait until ``peers`` runs wrote theirs (``policy_sync.timeout_seconds``; past it the run
   fails, naming the runs that are missing where an earlier round saw them);
4. check every file against its SHA-256, then average them: float32 sums in peer-name
   order, cast back to each tensor's dtype, so that every run computes the same bytes;
5. load the mean into the trainer (its optimizer state kept): the step's publication then
   publishes it, and every run publishes the same digest;
6. remove this run's files of earlier rounds: every peer has written this round, so every
   peer is done reading those.

The last round's files stay (nobody knows when the others are done with them). The runs
must step in lockstep (the same ``start_rollout_id`` and rollout count) and share the model
(names and shapes); a round whose files do not fit is a failure naming the peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_events.policy_sync.api import ModelFacade, PolicySyncError, RolloutManager, RolloutSummary
from miles_events.util.durable import fsync_path
from schemas.config import Config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

WEIGHTS = ".safetensors"
DIGEST = ".sha256"
_PEER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
POLL_SECONDS = 0.05


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: Path, write: Any) -> None:
    """``write(temporary path)``, fsynced, then renamed to ``path`` (readers see all or nothing)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        fsync_path(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_path(path.parent)


def write_round(round_dir: Path, peer: str, tensors: dict[str, torch.Tensor]) -> str:
    """This peer's weights of a round, then their SHA-256 beside them; returns it."""
    from safetensors.torch import save_file

    round_dir.mkdir(parents=True, exist_ok=True)
    weights = round_dir / f"{peer}{WEIGHTS}"
    if (round_dir / f"{peer}{DIGEST}").exists():
        logger.warning(
            "%s holds weights of %s already (an earlier run of it): replacing them", round_dir, peer
        )
    contiguous = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
    _write_atomically(weights, lambda path: save_file(contiguous, str(path)))
    sha = file_sha256(weights)
    _write_atomically(round_dir / f"{peer}{DIGEST}", lambda path: path.write_text(f"{sha}  {weights.name}\n"))
    return sha


def peers_written(round_dir: Path) -> list[str]:
    """The peers whose weights of the round are complete (their SHA-256 is there), by name."""
    try:
        names = os.listdir(round_dir)
    except FileNotFoundError:
        return []
    return sorted(n[: -len(DIGEST)] for n in names if n.endswith(DIGEST) and not n.startswith("."))


def read_verified(round_dir: Path, peer: str) -> dict[str, torch.Tensor]:
    """A peer's weights of the round, checked against the SHA-256 it wrote for them."""
    from safetensors.torch import load_file

    weights = round_dir / f"{peer}{WEIGHTS}"
    expected = (round_dir / f"{peer}{DIGEST}").read_text().split()[0]
    actual = file_sha256(weights)
    if actual != expected:
        raise PolicySyncError(
            f"policy sync: {weights} does not match its SHA-256 (expected {expected[:16]}, got {actual[:16]}): "
            f"the weights of {peer} are damaged"
        )
    return load_file(str(weights))


def average_round(round_dir: Path, peers: list[str]) -> dict[str, torch.Tensor]:
    """The mean of the peers' weights: float32 sums in peer order, cast back to each
    tensor's dtype (tensors that are not floating point are taken from the first peer)."""
    import torch

    first = read_verified(round_dir, peers[0])
    sums = {name: t.to(torch.float32) if t.is_floating_point() else t for name, t in first.items()}
    for peer in peers[1:]:
        tensors = read_verified(round_dir, peer)
        if tensors.keys() != first.keys():
            extra, missing = sorted(tensors.keys() - first.keys()), sorted(first.keys() - tensors.keys())
            raise PolicySyncError(
                f"policy sync: the weights of {peer} in {round_dir} do not fit {peers[0]}'s "
                f"(tensors missing: {missing[:3]}, extra: {extra[:3]})"
            )
        for name, tensor in tensors.items():
            if tensor.shape != first[name].shape or tensor.dtype != first[name].dtype:
                raise PolicySyncError(
                    f"policy sync: {name} of {peer} in {round_dir} is {tensor.dtype} {tuple(tensor.shape)}, "
                    f"{peers[0]}'s {first[name].dtype} {tuple(first[name].shape)}"
                )
            if tensor.is_floating_point():
                sums[name].add_(tensor.to(torch.float32))
    return {
        name: (total / len(peers)).to(first[name].dtype) if first[name].is_floating_point() else total
        for name, total in sums.items()
    }


def prune_rounds(directory: Path, peer: str, keep: Path) -> None:
    """Remove this peer's files of every round but ``keep``, and rounds left empty."""
    for round_dir in directory.glob("round-*"):
        if round_dir == keep or not round_dir.is_dir():
            continue
        for suffix in (DIGEST, WEIGHTS):  # the digest first: the weights stop counting at once
            (round_dir / f"{peer}{suffix}").unlink(missing_ok=True)
        try:
            round_dir.rmdir()
        except OSError:
            pass  # other peers' files are still there: theirs to remove


class SharedDirSync:
    """The shared-directory policy averager (see the module's docstring)."""

    supports_critic = False
    """Only the policy is averaged; each run keeps its own critic."""
    requires_exact_publication_info = False

    def __init__(self, config: Config) -> None:
        settings = config.policy_sync
        if not settings.directory:
            raise ValueError("policy_sync.directory: required by the shared-directory policy sync")
        peer = settings.peer or f"{socket.gethostname()}-{os.getpid()}"
        if not _PEER_NAME.match(peer):
            raise ValueError(
                f"policy_sync.peer: {peer!r} is not a file name (letters, digits, '_', '-', '.')"
            )
        self.directory = Path(settings.directory)
        self.peers = settings.peers
        self.peer = peer
        self.timeout = settings.timeout_seconds
        self.sync_initial = settings.sync_initial
        self.seen: set[str] = set()
        """Every peer seen in a round so far."""
        self.rounds: list[tuple[str, str]] = []
        """(round, digest of the mean loaded) of every round done."""

    async def initialize(
        self, *, actor_model: ModelFacade, rollout_manager: RolloutManager, critic_model: Any = None
    ) -> None:
        await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
        if self.sync_initial:
            await self._round("initial", actor_model)

    async def after_local_train(
        self,
        *,
        rollout_id: int,
        actor_model: ModelFacade,
        rollout_data: RolloutSummary,
        critic_model: Any = None,
    ) -> bool:
        await self._round(f"{rollout_id:08d}", actor_model)
        return False

    async def finalize(self) -> None:
        logger.info(
            "policy sync: %d round(s) averaged with %d run(s) in %s",
            len(self.rounds),
            self.peers,
            self.directory,
        )

    async def _round(self, name: str, actor_model: ModelFacade) -> None:
        started = time.monotonic()
        round_dir = self.directory / f"round-{name}"
        trained = await actor_model.weights()
        await asyncio.to_thread(write_round, round_dir, self.peer, trained.tensors)
        peers = await self._wait_for_peers(round_dir, name)
        mean = await asyncio.to_thread(average_round, round_dir, peers)
        digest = await actor_model.load_weights(mean)
        await asyncio.to_thread(prune_rounds, self.directory, self.peer, round_dir)
        self.rounds.append((name, digest))
        logger.info(
            "policy sync round %s: averaged %s in %.2fs (digest %s)",
            name, ", ".join(peers), time.monotonic() - started, digest[:16],
        )  # fmt: skip

    async def _wait_for_peers(self, round_dir: Path, name: str) -> list[str]:
        deadline = time.monotonic() + self.timeout
        while True:
            written = await asyncio.to_thread(peers_written, round_dir)
            if len(written) > self.peers:
                raise PolicySyncError(
                    f"policy sync round {name}: {len(written)} runs wrote weights to {round_dir} "
                    f"({', '.join(written)}), more than policy_sync.peers = {self.peers}"
                )
            if len(written) == self.peers:
                self.seen.update(written)
                return written
            if time.monotonic() >= deadline:
                missing = sorted(self.seen - set(written))
                who = (
                    f"missing: {', '.join(missing)}"
                    if missing
                    else f"{self.peers - len(written)} more run(s) never wrote theirs"
                )
                raise PolicySyncError(
                    f"policy sync round {name}: after {self.timeout:g}s {len(written)} of {self.peers} runs "
                    f"wrote their weights to {round_dir} ({', '.join(written) or 'none'}); {who}"
                )
            await asyncio.sleep(POLL_SECONDS)
