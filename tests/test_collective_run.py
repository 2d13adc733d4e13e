"""A run on the ray runtime whose weights go to two embedded engines over the collective
transport (gloo on this CPU), every publication verified, as a user runs it."""

from __future__ import annotations

import pytest

from schemas.events import (
    CheckpointSaved,
    PublicationVerified,
    RunFinished,
    TrainStateStaged,
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
    states = [e for e in log if isinstance(e, TrainStateStaged)]
    assert states and all(e.weights.transport == "collective" and not e.weights.address for e in states)
    assert [e.rollout_id for e in log if isinstance(e, CheckpointSaved)] == [1, 2]


def test_a_broadcast_that_hangs_fails_the_run_within_its_timeout_naming_the_engine(tmp_path, monkeypatch):
    """The publishing rank stalls sending version 3 to engine-1: that engine's load fails once
    ``publisher.broadcast_timeout`` has passed, and the run stops on the event saying so."""
    import asyncio
    import time

    from actors.coordinator import Coordinator
    from actors.generator import Generator
    from actors.publisher import Publisher
    from actors.saver import Saver
    from actors.trainer import Trainer
    from actors.verifier import Verifier
    from miles_events.app.config import load_config
    from miles_events.app.session import Session
    from miles_events.transport import collective
    from schemas.events import ActorFailed
    from tests.test_e2e import SMALL, TINY

    send = collective.ChannelServer._send

    def stall_engine_1_at_v3(self, group, channel, ask, client):  # type: ignore[no-untyped-def]
        if channel.hello.name == "engine-1" and ask.key == "weights-v3":
            time.sleep(6)  # past the timeout: the engine's wait for the header gives up first
            return
        send(self, group, channel, ask, client)

    monkeypatch.setattr(collective.ChannelServer, "_send", stall_engine_1_at_v3)
    config = load_config(TINY, [
        *SMALL, f'run.dir="{tmp_path}"', "metrics.port=0", 'run.runtime="local"', "run.num_rollout=4",
        "generator.num_engines=2", 'publisher.transport="collective"', "publisher.broadcast_timeout=2",
    ])  # fmt: skip
    started = time.monotonic()
    result = asyncio.run(Session(config, [Generator, Trainer, Publisher, Verifier, Saver, Coordinator]).run())
    assert time.monotonic() - started < 60
    log = events(tmp_path)
    assert result.finished.status == "failed"
    (failed,) = [e for e in log if isinstance(e, ActorFailed)]
    assert "CollectiveError" in failed.error and "channel engine-1: weights-v3: header" in failed.error
    assert published_versions(log) == ["1", "2"]
