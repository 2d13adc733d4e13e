"""The Verifier: on every publication, compares what the trainer published with what each
engine serves, and says so.

It keeps the trainer's ``WeightsStaged`` and each engine's ``WeightsLoaded``; when
``WeightsPublished(v)`` arrives it compares the trainer's digest with each engine's and
emits ``PublicationVerified``, or ``PublicationMismatch`` naming every tensor that differs,
is missing or is extra on each engine whose digest differs. This is the seed's
``check_weight_update_equal`` as a subscriber, on by default: the fingerprints are computed
where the tensors live, at memory bandwidth, and here only digests are compared.

The per-tensor checksums are read from the checksum manifests (``<run_dir>/checksums/``)
only to name the tensors of a mismatch. A manifest that cannot be read then makes that
engine's mismatch one entry, ``tensor="*"``, whose ``reason`` says why. Differences in
tensors of ``verifier.skip_tensor_list`` are not mismatches. An engine whose checksum reply
could not be used (``WeightsLoaded.checksum_error``) is one such entry too, its reason that
error.

Digests agree whether or not a load wrote anything when the published weights equal what
the engine served already. So each engine must also show the publication's canary
(``miles_events.rl.canary``): one that shows another publication's canary, or none, is a
mismatch on ``CANARY_TENSOR`` (its load did not apply the payload), on every publication,
the first included. An engine that cannot hold a canary is verified by digests alone, and
``PublicationVerified.write_proof`` says which.

When the run probes publications (``verifier.probe``; ``miles_events.rl.probe``), every
engine's log-probabilities of the probe batch must also match the trainer's within
``verifier.probe_tolerance`` (by default 0.01 in float32, 0.1 in 16 bits): this covers the tensors an engine cannot fingerprint (and
leaves out of its digest). A miss is a mismatch on ``PROBE_TENSOR`` with the difference in
its reason; ``PublicationVerified.probe_max_diff`` is the largest difference that passed.
"""

from __future__ import annotations

import time

import anyio

from miles_events.bus.actor import Actor, ActorContext, WorkerGroup, handles
from miles_events.rl.canary import CANARY_TENSOR
from miles_events.rl.checksum import checksum_order, is_skipped
from miles_events.rl.checksum_manifest import ManifestError, read_manifest
from miles_events.rl.probe import PROBE_TENSOR, max_difference, probe_tolerance
from miles_events.rl.versions import version_number
from schemas.config import Config, skip_tensor_list
from schemas.events import (
    ProbeBatch,
    PublicationMismatch,
    PublicationVerified,
    RestoreVerified,
    TensorMismatch,
    WeightsLoaded,
    WeightsPublished,
    WeightsStaged,
)


def compare_checksums(
    engine: str, expected: dict[str, str], actual: dict[str, str], skip_tensor_list: list[str]
) -> list[TensorMismatch]:
    """Every tensor whose fingerprint differs, that the engine lacks, or that it has extra
    (an engine's ``rank{r}/`` names in rank order)."""
    mismatches = []
    for name in sorted(set(expected) | set(actual), key=checksum_order):
        if is_skipped(name, skip_tensor_list):
            continue
        want, got = expected.get(name, ""), actual.get(name, "")
        if want != got:
            mismatches.append(TensorMismatch(engine=engine, tensor=name, expected=want, actual=got))
    return mismatches


class Verifier(Actor):
    name = "verifier"

    def __init__(self, config: Config, context: ActorContext) -> None:
        super().__init__(config, context)
        self.staged: dict[str, WeightsStaged] = {}
        self.loaded: dict[str, dict[str, WeightsLoaded]] = {}
        self.served: WeightsStaged | None = None
        """The trainer's side of the last publication verified: what a restarted engine
        that loads it again must serve."""

    @classmethod
    def resources(cls, config: Config) -> WorkerGroup:
        return WorkerGroup(role="service", cpus_per_rank=0.1)

    @handles(WeightsStaged, emits=())
    async def on_weights_staged(self, event: WeightsStaged) -> None:
        self.staged[event.weight_version] = event

    @handles(WeightsLoaded, emits=(RestoreVerified, PublicationMismatch))
    async def on_weights_loaded(self, event: WeightsLoaded) -> None:
        if event.restore:
            await self._verify_restore(event)
            return
        self.loaded.setdefault(event.weight_version, {})[event.engine] = event

    async def _verify_restore(self, event: WeightsLoaded) -> None:
        """A restarted engine loaded the last publication again: the same checks as the
        publication's, on that engine alone."""
        if not self.config.verifier.enabled:
            return
        staged = self.staged.get(event.weight_version)  # not published yet (a restore raced it)
        if staged is None and self.served and self.served.weight_version == event.weight_version:
            staged = self.served
        started = time.perf_counter()
        mismatches, proven, probe_max_diff = await self._verdict(
            staged, {event.engine: event}, [event.engine]
        )
        if mismatches:
            await self.publish(
                PublicationMismatch(
                    weight_version=event.weight_version,
                    mismatches=mismatches,
                    expected_digest=staged.digest if staged else "",
                    engine_digests={event.engine: event.digest},
                    verify_seconds=time.perf_counter() - started,
                )
            )
            return
        assert staged is not None
        await self.publish(
            RestoreVerified(
                engine=event.engine,
                weight_version=event.weight_version,
                digest=staged.digest,
                write_proof="canary" if proven else "none",
                probe_max_diff=probe_max_diff,
            )
        )

    def _name_mismatches(
        self, staged: WeightsStaged | None, differing: dict[str, WeightsLoaded | None]
    ) -> list[TensorMismatch]:
        """The tensors behind the digests that differ, from their manifests (read off the
        event loop; the trainer's once), in engine order; an engine whose checksum reply
        could not be used is one entry giving why."""
        run_dir, skip = self.context.run_dir, skip_tensor_list(self.config)

        def unnamed(engine: str, loaded: WeightsLoaded | None, reason: str) -> TensorMismatch:
            return TensorMismatch(
                engine=engine,
                tensor="*",
                expected=staged.digest if staged else "",
                actual=loaded.digest if loaded else "",
                reason=reason,
            )

        expected: dict[str, str] | ManifestError = {}
        if staged is not None and any(
            loaded is None or not loaded.checksum_error for loaded in differing.values()
        ):
            try:
                expected = read_manifest(run_dir, staged.checksums_manifest, staged.digest)
            except ManifestError as error:
                expected = error
        mismatches: list[TensorMismatch] = []
        for engine, loaded in differing.items():
            if loaded is not None and loaded.checksum_error:
                mismatches.append(unnamed(engine, loaded, loaded.checksum_error))
                continue
            if isinstance(expected, ManifestError):
                mismatches.append(unnamed(engine, loaded, str(expected)))
                continue
            try:
                actual = read_manifest(run_dir, loaded.checksums_manifest, loaded.digest) if loaded else {}
            except ManifestError as error:
                mismatches.append(unnamed(engine, loaded, str(error)))
                continue
            # Empty when the digests differ only in skipped tensors.
            mismatches.extend(compare_checksums(engine, expected, actual, skip))
        return mismatches

    def _probe_mismatch(self, engine: str, probe: ProbeBatch, reply: WeightsLoaded) -> TensorMismatch | None:
        """The probe's verdict on one engine: None within ``verifier.probe_tolerance``."""
        tolerance = probe_tolerance(self.config.verifier.probe_tolerance, self.config.model.dtype)
        if reply.probe_logprobs is None:
            reason = "the engine did not answer the publication's behavioural probe"
        else:
            difference = max_difference(probe.logprobs, reply.probe_logprobs)
            if difference <= tolerance:
                return None
            reason = (
                f"the served weights give other log-probabilities on the probe batch: they differ "
                f"by up to {difference:.3g} (tolerance {tolerance:g})"
            )
        return TensorMismatch(engine=engine, tensor=PROBE_TENSOR, expected="", actual="", reason=reason)

    @handles(WeightsPublished, emits=(PublicationVerified, PublicationMismatch))
    async def on_weights_published(self, event: WeightsPublished) -> None:
        version = event.weight_version
        staged = self.staged.pop(version, None)
        loaded = self.loaded.pop(version, {})
        # Whatever is older than this publication belongs to sagas that failed: drop it.
        current = version_number(version)
        for table in (self.staged, self.loaded):
            for stale in [v for v in table if version_number(v) < current]:
                del table[stale]
        started = time.perf_counter()
        if not self.config.verifier.enabled:
            return
        mismatches, proven, probe_max_diff = await self._verdict(staged, loaded, event.engines)
        self.served = staged
        engine_digests = {e: loaded[e].digest for e in event.engines if e in loaded}
        expected_digest = staged.digest if staged is not None else ""
        elapsed = time.perf_counter() - started
        if mismatches:
            await self.publish(
                PublicationMismatch(
                    weight_version=version,
                    mismatches=mismatches,
                    expected_digest=expected_digest,
                    engine_digests=engine_digests,
                    rollout_id=event.rollout_id,
                    verify_seconds=elapsed,
                )
            )
        else:
            assert staged is not None
            await self.publish(
                PublicationVerified(
                    weight_version=version,
                    digest=staged.digest,
                    num_tensors=staged.num_tensors,
                    engines=list(event.engines),
                    rollout_id=event.rollout_id,
                    verify_seconds=elapsed,
                    write_proof="canary" if proven else "none",
                    probe_max_diff=probe_max_diff,
                )
            )

    async def _verdict(
        self, staged: WeightsStaged | None, loaded: dict[str, WeightsLoaded], engines: list[str]
    ) -> tuple[list[TensorMismatch], bool, float | None]:
        """Every mismatch between what the trainer staged and what ``engines`` loaded
        (digests, canary, probe), whether the canary proved each load wrote, and the largest
        probe difference that passed."""
        differing: dict[str, WeightsLoaded | None] = {
            engine: loaded.get(engine)
            for engine in engines
            if staged is None
            or engine not in loaded
            or loaded[engine].digest != staged.digest
            or loaded[engine].checksum_error
        }
        mismatches: list[TensorMismatch] = (
            await anyio.to_thread.run_sync(self._name_mismatches, staged, differing) if differing else []
        )
        if staged is None or staged.num_tensors == 0:
            mismatches.insert(0, TensorMismatch(engine="trainer", tensor="*", expected="", actual=""))
        proven = staged is not None and bool(staged.canary)
        for engine in engines:
            reply = loaded.get(engine)
            if staged is None or not staged.canary or reply is None or reply.canary is None:
                proven = False  # an engine that cannot hold a canary: the digests alone
            elif reply.canary != staged.canary:
                mismatches.append(
                    TensorMismatch(
                        engine=engine,
                        tensor=CANARY_TENSOR,
                        expected=staged.canary,
                        actual=reply.canary,
                        reason="the engine does not hold this publication's canary: its load did not apply the payload",
                    )
                )
        probe_max_diff = None
        if staged is not None and staged.probe is not None:
            probe_max_diff = 0.0
            for engine in engines:
                reply = loaded.get(engine)
                if reply is None:
                    continue  # no load to probe: already a mismatch of its digest
                mismatch = self._probe_mismatch(engine, staged.probe, reply)
                if mismatch is None:
                    probe_max_diff = max(
                        probe_max_diff, max_difference(staged.probe.logprobs, reply.probe_logprobs or [])
                    )
                else:
                    mismatches.append(mismatch)
        return mismatches, proven, probe_max_diff
