"""One engine of the Generator as a worker-group rank (``miles_events.bus.workers``): the
engine itself, in whichever process hosts its rank, and the calls the Generator makes on it.

Every call returns plain data (completions, or the event the Generator publishes, less the
header the bus stamps), so the rank may live in the Generator's process or in one of its own:
sampling is seeded by a number, loading writes the checksum manifest here (beside the tensors
it fingerprints) and returns its digest, and a cancellation is a ``notify`` that sets this
rank's own flag.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from actors.engine import build_engine, engine_class, reads_back_every_tensor
from actors.engine.base import (
    Completion,
    Engine,
    GenerateRequest,
    SamplingParams,
    name_list,
)
from actors.engine.scrape_target import remove_target, write_target
from miles_events.bus.actor import RankPlace
from miles_events.bus.cancel import Cancellation
from miles_events.device.offload import Measured
from miles_events.device.threads import phase_threads
from miles_events.rl.checksum import ChecksumReplyError, is_skipped, ranked_checksums, report_checksums
from miles_events.rl.checksum_manifest import write_manifest
from miles_events.rl.versions import engine_names
from miles_events.transport.base import Transport
from schemas.config import Config, VerifierConfig, skip_tensor_list
from schemas.data import DataRef
from schemas.events import MemoryPart, ProbeBatch, WeightsCheckFinished, WeightsCheckRequested, WeightsLoaded


class UnverifiableTensors(ValueError):
    """An engine serves tensors it cannot read back in the trainer's layout, and
    ``verifier.skip_tensor_list`` leaves them in the digests: no publication could verify."""


def check_readback(
    name: str, backend: str, unreadable: Sequence[str], verifier: VerifierConfig, skip: Sequence[str]
) -> None:
    """Raise ``UnverifiableTensors`` (one line: a few of the tensors, and the
    ``verifier.skip_tensor_list`` that leaves them out) when engine ``name`` cannot read back
    tensors that verification would put in its digests. Skipped, they are proven by the
    behavioural probe; where the probe is off, a warning says they are not verified at all."""
    if not verifier.enabled or not unreadable:
        return
    skip = list(skip)
    uncovered = sorted(n for n in unreadable if not is_skipped(n, skip))
    if uncovered:
        suffixes = sorted({".".join(n.split(".")[-2:]) for n in uncovered})
        if all(suffix.endswith("proj.weight") for suffix in suffixes):
            suffixes = ["proj.weight"]
        setting = (
            "[" + ", ".join(json.dumps(s) for s in [*skip, *(s for s in suffixes if s not in skip)]) + "]"
        )
        raise UnverifiableTensors(
            f"{name} ({backend}) cannot read back {len(uncovered)} of the tensors it serves in the trainer's "
            f"layout ({name_list(uncovered, limit=3)}), so no publication's digests could match; set "
            f'verifier.skip_tensor_list = {setting} (the behavioural probe, verifier.probe = "auto", then '
            "proves the skipped tensors)"
        )
    probed = verifier.probe == "on" or (verifier.probe == "auto" and not reads_back_every_tensor(backend))
    if not probed:
        logger.warning(
            '%s: %d tensors are neither in the digests (verifier.skip_tensor_list) nor probed (verifier.probe = "%s"): '
            "%s; their publication is not verified",
            name,
            len(unreadable),
            verifier.probe,
            name_list(sorted(unreadable), limit=3),
        )


class EngineWorker:
    """Engine ``place.rank`` of the run, serving from ``model.path``; refused at start
    (``check_readback``) when its digests could never match the trainer's."""

    def __init__(self, config: Config, engine: Engine, place: RankPlace) -> None:
        check_readback(
            engine.name,
            config.generator.engine,
            engine.unreadable_tensors(),
            config.verifier,
            skip_tensor_list(config),
        )
        self.config = config
        self.engine = engine
        self.place = place
        self.cancellation = Cancellation()
        self.scrape_target: Path | None = None
        """The engine's Prometheus target file, while it runs (``metrics.engine_targets_dir``)."""
        targets = config.metrics.engine_targets_dir
        if targets and engine.metrics_url is not None:
            try:
                self.scrape_target = write_target(
                    targets,
                    run_id=place.run_id,
                    engine=engine.name,
                    backend=config.generator.engine,
                    metrics_url=engine.metrics_url,
                )
            except (OSError, ValueError) as error:
                # The dashboard misses this server's row; the run goes on without it.
                logger.warning("%s: no Prometheus target written: %s", engine.name, error)
            server = getattr(engine, "server", None)
            if self.scrape_target is not None and server is not None:
                server.record_file(self.scrape_target)  # removed with the server after a kill -9

    @property
    def name(self) -> str:
        return self.engine.name

    def weight_version(self) -> str:
        return self.engine.weight_version

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        sampling: SamplingParams,
        seed: int,
        sample_seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        """One completion per request, sampled from a generator seeded with ``seed`` (the
        embedded engine: each from its own of ``sample_seeds``); raises ``Cancelled`` once
        ``cancel`` was called."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        with phase_threads(self.config.rollout.num_threads, sharers=self.place.ranks_sharing_cores):
            return self.engine.generate(requests, sampling, generator, self.cancellation, sample_seeds)

    def cancel(self, reason: str) -> None:
        self.cancellation.cancel(reason)

    def load(
        self,
        weights: DataRef,
        weight_version: str,
        skip_tensor_list: Sequence[str],
        probe: ProbeBatch | None = None,
    ) -> WeightsLoaded:
        """Serve ``weights`` as ``weight_version``, then fingerprint what is served now and,
        with a ``probe``, answer it with the served weights; the Generator adds the
        ``load_seconds`` it measured. A checksum reply that cannot be used is not a failure of
        the load: it is reported in ``checksum_error``, for the Verifier to fail the
        publication with."""
        with self.engine.in_flight_load():
            return self._load(weights, weight_version, skip_tensor_list, probe)

    def _load(
        self,
        weights: DataRef,
        weight_version: str,
        skip_tensor_list: Sequence[str],
        probe: ProbeBatch | None,
    ) -> WeightsLoaded:
        previous = self.engine.weight_version
        num_bytes = self.engine.load_weights(weights, weight_version)
        digest = manifest = error = ""
        num_tensors = 0
        try:
            checksums = report_checksums(self.engine.checksums(list(skip_tensor_list)))
        except ChecksumReplyError as unusable:
            error = f"{self.name}: {unusable}"
        else:
            digest, manifest = write_manifest(self.place.run_dir, checksums)
            num_tensors = len(checksums)
        return WeightsLoaded(
            engine=self.name,
            weight_version=self.engine.weight_version,
            previous_version=previous,
            digest=digest,
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            checksums_manifest=manifest,
            checksum_error=error,
            canary=self.engine.served_canary() if self.engine.holds_canary else None,
            probe_logprobs=(
                self.engine.probe_logprobs(probe.prompt_ids, probe.response_ids)
                if probe is not None
                else None
            ),
        )

    def check(self, request: WeightsCheckRequested) -> WeightsCheckFinished:
        """SGLang's weight-checker action ``request.action`` on this engine, answered as the
        event the Generator publishes (with the request's id)."""
        skip = list(request.skip_tensor_list)
        if request.action == "checksum":
            return self._checksum_check(request, skip)
        result = self.engine.weights_check(request.action, request.selector, skip, request.allow_quant_error)
        return WeightsCheckFinished(
            engine=self.name,
            action=request.action,
            success=result.success,
            message=result.message,
            num_tensors=result.num_tensors,
            weight_version=result.weight_version,
            request_id=request.request_id,
        )

    def _checksum_check(self, request: WeightsCheckRequested, skip: list[str]) -> WeightsCheckFinished:
        """SGLang's ``checksum`` action, flattened as miles does (``rank{r}/{name}``, in rank
        order) so that checks compare as the seed's. An unsuccessful reply keeps the
        engine's message; one that cannot be used is unsuccessful, saying why and naming
        the engine."""
        version = self.engine.weight_version

        def unsuccessful(message: str) -> WeightsCheckFinished:
            return WeightsCheckFinished(
                engine=self.name,
                action=request.action,
                success=False,
                message=message,
                weight_version=version,
                request_id=request.request_id,
            )

        try:
            report = self.engine.checksums(skip, request.selector)
            if not report.success:
                return unsuccessful(report.message)
            checksums = ranked_checksums(report)
        except ChecksumReplyError as unusable:
            return unsuccessful(f"{self.name}: {unusable}")
        digest, manifest = write_manifest(self.place.run_dir, checksums)
        return WeightsCheckFinished(
            engine=self.name,
            action=request.action,
            success=True,
            message=report.message,
            digest=digest,
            num_tensors=len(checksums),
            checksums_manifest=manifest,
            weight_version=self.engine.weight_version,
            request_id=request.request_id,
        )

    def release_memory(self, tags: Sequence[str]) -> MemoryPart:
        """The engine's ``release_memory(tags)``, measured where its memory is."""
        with Measured(self.name, self.engine.memory_device) as measure:
            num_bytes = self.engine.release_memory(list(tags))
        return measure.part(num_bytes)

    def resume_memory(self, tags: Sequence[str]) -> MemoryPart:
        """The engine's ``resume_memory(tags)``, measured where its memory is."""
        with Measured(self.name, self.engine.memory_device) as measure:
            num_bytes = self.engine.resume_memory(list(tags))
        return measure.part(num_bytes)

    def health(self, timeout: float) -> str:
        """An embedded engine's heartbeat: answered at all (by the engine's process, beside
        a generation in progress), it is healthy: "". ``timeout`` is the caller's bound."""
        return ""

    def health_url(self) -> str | None:
        """Where the engine's server answers its health check (``Engine.health_url``); None
        for an engine whose heartbeat is ``health``."""
        return self.engine.health_url

    def process_ids(self) -> list[int]:
        """The engine's processes (``Engine.process_ids``), the first its main one."""
        return self.engine.process_ids()

    def close(self) -> None:
        if self.scrape_target is not None:
            remove_target(self.scrape_target)
        self.engine.close()


logger = logging.getLogger(__name__)

_ONE_AT_A_TIME = threading.Lock()
"""Held while an engine that does not ``starts_concurrently`` is built in this process."""


def engine_worker(config: Config, transport: Transport, place: RankPlace) -> EngineWorker:
    """The worker-group factory of the Generator: engine ``place.rank`` of ``generator.engine``."""
    name = engine_names(config)[place.rank]
    concurrent = engine_class(config.generator.engine).starts_concurrently
    with contextlib.nullcontext() if concurrent else _ONE_AT_A_TIME:
        engine = build_engine(config, index=place.rank, name=name, transport=transport)
    try:
        return EngineWorker(config, engine, place)
    except BaseException:
        engine.close()  # a launched server must not outlive a rank that failed to start
        raise
