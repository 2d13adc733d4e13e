"""Logs recorded before the checksum maps left the events still decode with today's schemas.

tests/fixtures/tiny_run_v1 is the tiny run (3 rollouts, 2 engines, evals and saves) as first
recorded, when ``WeightsStaged`` and ``WeightsLoaded`` carried the whole map of tensor name
-> fingerprint (a 235B MoE's ~18k tensors make that more than 1 MB per engine per
publication, through the bus and into the event log), and digests were sha256 with
separators. The fixture was re-recorded (tests/fixtures/tiny_run, see its README.md) when
the events changed to carry SGLang's exact ``per_gpu_checksum``, the tensor count and the
path of a content-addressed checksum manifest instead; this one is kept to show that a log
written before still reads: the dropped map is skipped and the new fields take their
defaults.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from miles_events.bus.event_log import read_events, scan_log
from schemas.events import TrainStepFinished, WeightsLoaded, WeightsStaged

V1 = Path(__file__).parent / "fixtures" / "tiny_run_v1" / "events.log"


def test_every_record_of_the_first_recorded_log_decodes_with_todays_schemas():
    """tiny_run was re-recorded when the weight events dropped their per-tensor checksum maps
    for a digest, counts and a manifest path (and digests became SGLang's exact
    ``per_gpu_checksum``); the log written before must still read, record by record."""
    end, torn = scan_log(V1)
    assert torn is None and end == V1.stat().st_size
    events = list(read_events(V1))  # raises at the first record that does not decode
    assert [e.seq for e in events] == list(range(1, 61))
    counts = Counter(type(e).__name__ for e in events)
    assert (counts["WeightsStaged"], counts["WeightsLoaded"], counts["PublicationVerified"]) == (4, 8, 4)


def test_old_publication_events_keep_their_digests_and_get_defaults_for_new_fields():
    events = list(read_events(V1))
    staged = [e for e in events if isinstance(e, WeightsStaged)]
    loaded = [e for e in events if isinstance(e, WeightsLoaded)]
    assert all(e.num_tensors == 27 and len(e.digest) == 64 and e.checksums_manifest == "" for e in staged)
    assert all(e.checksums_manifest == "" and e.num_tensors == 0 and e.num_bytes == 0 for e in loaded)
    by_version = {e.weight_version: e.digest for e in staged}
    assert all(e.digest == by_version[e.weight_version] for e in loaded)


def test_old_train_steps_keep_their_metrics():
    """The log predates ``TrainStepFinished.metrics``: its loss, kl, ... were fields of the
    event itself, and read back under ``metrics``, not as zeros."""
    steps = [e for e in read_events(V1) if isinstance(e, TrainStepFinished)]
    assert len(steps) == 3
    assert all(s.metrics.train_tokens > 0 and s.metrics.num_optimizer_steps > 0 for s in steps)
    assert all(s.metrics.loss != 0.0 and s.metrics.grad_norm > 0 for s in steps)


def test_the_first_recorded_run_still_redrives(capsys):
    """Its recorded config predates ``[generator]`` and the ``rl`` package (``rollout.num_engines``,
    ``miles_events.rewards.*``): replay migrates it, and the Coordinator, which needs no
    checksum manifests, makes the recorded decisions again."""
    from miles_events.app.replay import main

    assert main([str(V1), "--redrive", "coordinator"]) == 0, capsys.readouterr()
