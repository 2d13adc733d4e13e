"""Worker groups and their placement: one placement group per role, a bundle per rank; the
light actors (role service) are placed only when ``ray.own_process`` names them."""

from __future__ import annotations

import pytest

from miles_events.app.roster import ACTORS
from miles_events.bus.actor import Actor, WorkerGroup
from miles_events.runtime.ray import own_process, placement_bundles
from schemas.config import Config, RayConfig


def actor(name: str, group: WorkerGroup) -> type[Actor]:
    return type(name, (Actor,), {"name": name, "resources": classmethod(lambda cls, config: group)})


GEN = actor("gen", WorkerGroup(role="rollout", num_ranks=2, cpus_per_rank=1, gpus_per_rank=0.5))
TRAIN = actor("train", WorkerGroup(role="actor", num_ranks=2, cpus_per_rank=1, gpus_per_rank=0.5))
SAVE = actor("save", WorkerGroup(role="service", cpus_per_rank=0.5))
LOG = actor("log", WorkerGroup(role="service", cpus_per_rank=0.1))
LOOP = actor("loop", WorkerGroup(role="driver"))


def test_each_role_gets_its_own_group_with_a_bundle_per_rank():
    groups = placement_bundles(
        [GEN, TRAIN, SAVE, LOG, LOOP], Config(ray=RayConfig(own_process=["save", "log"]))
    )
    assert set(groups) == {"rollout", "actor", "service"}
    assert groups["rollout"][0] == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
    assert groups["actor"][0] == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
    assert groups["service"][0] == [{"CPU": 0.5}, {"CPU": 0.1}]
    # Each actor sits on the first bundle of its own ranks.
    assert [(cls.name, first) for cls, _, first in groups["service"][1]] == [("save", 0), ("log", 1)]


def test_colocation_shares_the_rollout_and_actor_bundles_rank_by_rank():
    groups = placement_bundles([GEN, TRAIN, SAVE], Config(ray=RayConfig(colocate=True, own_process=["save"])))
    assert set(groups) == {"rollout", "service"}
    assert groups["rollout"][0] == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert [(cls.name, first) for cls, _, first in groups["rollout"][1]] == [("gen", 0), ("train", 0)]


def test_driver_actors_are_not_placed():
    assert placement_bundles([LOOP], Config()) == {}


def test_light_actors_are_hosted_by_the_driver_unless_named():
    assert placement_bundles([SAVE, LOG, LOOP], Config()) == {}
    assert [own_process(cls, Config()) for cls in (GEN, TRAIN, SAVE, LOG, LOOP)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    # The option gives a light actor a process; a driver actor never has one.
    named = Config(ray=RayConfig(own_process=["log", "loop"]))
    assert [own_process(cls, named) for cls in (SAVE, LOG, LOOP)] == [False, True, False]


def test_the_run_places_generator_and_trainer_and_the_light_actors_named():
    groups = placement_bundles(list(ACTORS), Config())
    assert {role: len(bundles) for role, (bundles, _) in groups.items()} == {"rollout": 1, "actor": 1}
    groups = placement_bundles(list(ACTORS), Config(ray=RayConfig(own_process=["saver"])))
    assert {role: len(bundles) for role, (bundles, _) in groups.items()} == {
        "rollout": 1,
        "actor": 1,
        "service": 1,
    }
    assert [cls.name for cls, _, _ in groups["service"][1]] == ["saver"]


def test_the_light_actors_are_the_roster_actors_without_a_model():
    light = {cls.name for cls in ACTORS if cls.resources(Config()).role == "service"}
    assert light == {"publisher", "verifier", "saver"}


def test_a_worker_group_needs_a_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        WorkerGroup(num_ranks=0)
