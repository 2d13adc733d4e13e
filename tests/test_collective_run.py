"""A run on the ray runtime whose weights go to two embedded engines over the collective
transport (gloo on this CPU), every publication verified, as a user runs it."""

from __future__ import annotations

import pytest

from schemas.events import (
    CheckpointSaved,
    PublicationVerified,
    RunFinished,
    WeightsLoaded,
    WeightsStaged,
)
from tests.test_e2e import events, published_versions, run_cli

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
"""Small enough that each publication goes in many broadcasts."""


@pytest.fixture(scope="module")
def collective_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("collective")
    result = run_cli(
        run_dir,
        'run.runtime="ray"',
        "run.num_rollout=3",
        "run.save_interval=2",
        "generator.num_engines=2",
        'publisher.transport="collective"',
        f"publisher.bucket_bytes={BUCKET_BYTES}",
    )
    return run_dir, result


def test_two_engines_load_every_publication_over_the_collective_and_each_is_verified(collective_run):
    run_dir, result = collective_run
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(run_dir)
    assert isinstance(log[-1], RunFinished) and log[-1].status == "completed"
    assert published_versions(log) == ["1", "2", "3", "4"]
    assert [e.weight_version for e in log if isinstance(e, PublicationVerified)] == ["1", "2", "3", "4"]
    staged = [e for e in log if isinstance(e, WeightsStaged)]
    assert all(e.weights.transport == "collective" and e.weights.address for e in staged)
    assert all(e.weights.num_bytes > 4 * BUCKET_BYTES for e in staged)  # several broadcasts each
    loaded = sorted((e.weight_version, e.engine) for e in log if isinstance(e, WeightsLoaded))
    assert loaded == [(v, f"engine-{i}") for v in ("1", "2", "3", "4") for i in (0, 1)]
    # The Saver's state goes through shared memory beside the collective: the checkpoint is whole.
    assert [e.rollout_id for e in log if isinstance(e, CheckpointSaved)] == [1, 2]
