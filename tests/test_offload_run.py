"""Offload and onload on live runs of the embedded default, from the CLI: the seed's sequence
of memory moves around every generation, training, save and publication, with and without a
critic and with a trainer of two ranks; training that comes out bit for bit as without
offload. (A resumed run starts offloaded as a fresh one does: ``MemoryPlan.at_start``.)"""

from __future__ import annotations

import pytest

from schemas.events import (
    CheckpointSaved,
    CriticStepFinished,
    EvalRequested,
    MemoryOffloaded,
    MemoryOnloaded,
    OffloadRequested,
    OnloadRequested,
    PublicationVerified,
    PublishRequested,
    RolloutGenerated,
    RolloutRequested,
    SaveRequested,
    TrainStepFinished,
    WeightsStaged,
)
from tests.test_e2e import events, run_cli

pytestmark = pytest.mark.slow

LOCAL = ('run.runtime="local"', "run.num_rollout=3")
OFFLOAD = ("run.offload_train=true", "run.offload_rollout=true")


def moves(log: list) -> list[str]:
    """The run's memory moves and the loop's steps between them, in bus order."""
    names = {
        OffloadRequested: "off",
        OnloadRequested: "on",
        RolloutRequested: "rollout",
        TrainStepFinished: "trained",
        CriticStepFinished: "critic",
        PublishRequested: "publish",
        PublicationVerified: "verified",
        EvalRequested: "eval",
        SaveRequested: "save",
    }
    out = []
    for event in log:
        name = names.get(type(event))
        if name is None and isinstance(event, MemoryOffloaded | MemoryOnloaded) and not event.request_id:
            name = "self-off" if isinstance(event, MemoryOffloaded) else "self-on"
        if name is None:
            continue
        if isinstance(event, OffloadRequested | OnloadRequested | MemoryOffloaded | MemoryOnloaded):
            tags = ",".join(getattr(event, "tags", []))
            name += f" {event.target}" + (f" {tags}" if tags else "")
        out.append(name)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    common = (*LOCAL, "run.save_interval=2")
    for name, extra in (("plain", ()), ("offload", OFFLOAD)):
        result = run_cli(root / name, *common, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_the_memory_moves_follow_the_seeds_sequence(runs):
    log = events(runs / "offload")
    step = [
        "rollout",
        "off rollout cuda_graph,kv_cache,weights",  # after generation, the level's tags
        "self-on actor",  # the trainer wakes up for its step
        "trained",
        "off actor",  # offload_train(), after the save when one is due
        "on rollout weights",  # onload_weights
        "publish",
        "verified",
        "on rollout kv_cache,cuda_graph",  # onload_kv
    ]
    saved_step = [*step[:4], "save", *step[4:]]
    sequence = moves(log)
    # Evaluations come once the engines have their KV cache back.
    assert all(
        sequence[i - 1] == "on rollout kv_cache,cuda_graph" for i, m in enumerate(sequence) if m == "eval"
    )
    assert [m for m in sequence if m != "eval"] == [
        "off rollout cuda_graph,kv_cache,weights",  # created offloaded
        "off actor",
        "on rollout weights",
        "publish",
        "verified",
        "on rollout kv_cache,cuda_graph",
        *step,
        *saved_step,  # rollout 1: save_interval
        *saved_step,  # rollout 2: the last
    ]
    # Every command is answered by its own fact, and each part says what moved.
    asked = [e.request_id for e in log if isinstance(e, OffloadRequested | OnloadRequested)]
    answered = [e.request_id for e in log if isinstance(e, MemoryOffloaded | MemoryOnloaded) and e.request_id]
    assert asked == answered and len(set(asked)) == len(asked)
    engine_offloads = [e for e in log if isinstance(e, MemoryOffloaded) and e.target == "rollout"]
    assert all(e.parts[0].name == "engine-0" and e.parts[0].bytes > 0 for e in engine_offloads)


def test_offloaded_training_publishes_the_same_weights_as_training_in_place(runs):
    digests = {
        name: [e.digest for e in events(runs / name) if isinstance(e, WeightsStaged)]
        for name in ("plain", "offload")
    }
    assert len(digests["plain"]) == 4 and digests["offload"] == digests["plain"]
    saved = {
        name: [e.rollout_id for e in events(runs / name) if isinstance(e, CheckpointSaved)]
        for name in digests
    }
    assert saved["offload"] == saved["plain"] == [1, 2]


def test_with_a_critic_each_group_offloads_itself_after_its_step(tmp_path):
    result = run_cli(
        tmp_path,
        *LOCAL,
        *OFFLOAD,
        'run.offload_rollout_level=["kv_cache"]',
        "trainer.use_critic=true",
        "trainer.num_critic_only_steps=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(tmp_path)
    sequence = moves(log)
    assert sequence[:4] == [
        "off rollout cuda_graph,kv_cache,weights",
        "off actor",
        "off critic",
        "on rollout weights",
    ]
    # Rollout 0 is the critic's alone; from rollout 1 on, critic then actor, each offloaded
    # right after its step; the engines keep their weights (level kv_cache): no onload_weights.
    first = sequence.index("rollout")
    assert sequence[first : first + 8] == [
        "rollout",
        "off rollout cuda_graph,kv_cache",
        "self-on critic",
        "self-off critic",
        "critic",
        "trained",
        "publish",
        "verified",
    ]
    second = sequence.index("rollout", first + 1)
    assert sequence[second + 2 : second + 9] == [
        "self-on critic",
        "self-off critic",
        "critic",
        "self-on actor",
        "self-off actor",
        "trained",
        "publish",
    ]


def test_a_trainer_of_two_ranks_offloads_and_onloads_every_rank(tmp_path):
    result = run_cli(tmp_path, 'run.runtime="local"', "run.num_rollout=2", *OFFLOAD, "trainer.num_ranks=2")
    assert result.returncode == 0, result.stderr[-3000:]
    log = events(tmp_path)
    trainer = [e for e in log if isinstance(e, MemoryOffloaded | MemoryOnloaded) and e.target == "actor"]
    assert len(trainer) == 1 + 2 * 2  # created offloaded; per step, woken then offloaded
    assert all([p.name for p in e.parts] == ["rank-0", "rank-1"] for e in trainer)
    assert [e.rollout_id for e in log if isinstance(e, RolloutGenerated)] == [0, 1]
