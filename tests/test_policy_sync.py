"""External policy synchronizers (the seed's ``external_policy_sync_path`` plugins): the
refusals at start, the Coordinator's order of the hooks, a live run's hook calls against the
seed's order, and the shared-directory plugin's file protocol."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from actors.coordinator import Coordinator
from actors.policy_sync import PolicySyncDriver
from miles_events.app.config import load_config
from miles_events.app.roster import ACTORS
from miles_events.app.run import main
from miles_events.app.session import Session
from miles_events.bus.event_log import read_events
from miles_events.bus.testing import RecordingContext, feed
from miles_events.policy_sync.api import EXACT_INFO_MISSING, PolicySyncError
from miles_events.policy_sync.shared_dir import (
    SharedDirSync,
    average_round,
    file_sha256,
    peers_written,
    prune_rounds,
    write_round,
)
from schemas.config import Config, PolicySyncConfig, RunConfig
from schemas.events import (
    CheckpointSaved,
    PolicySyncFailed,
    PolicySyncFinished,
    PolicySyncRequested,
    PublicationVerified,
    PublishRequested,
    RunFinished,
    RunStarted,
    SaveRequested,
    StopRequested,
    TrainMetrics,
    TrainStepFinished,
)
from schemas.plan import RunPlan
from tests import policy_sync_plugins

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"
RECORDING = "tests.policy_sync_plugins:RecordingSync"
GOOD = '{"input": "1+1=", "label": "2"}\n'


@pytest.fixture(autouse=True)
def own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` sets defaults in the environment (logging, Hugging Face): keep them here."""
    monkeypatch.setattr(os, "environ", os.environ.copy())


# --- refusals at start ------------------------------------------------------------------


def write_run(tmp_path: Path, *lines: str) -> Path:
    (tmp_path / "prompts.jsonl").write_text(GOOD * 4)
    config = tmp_path / "run.toml"
    config.write_text(
        '[run]\ndir = "run"\nruntime = "local"\nnum_rollout = 1\n'
        + "".join(f"{line}\n" for line in lines)
        + '[data]\nprompt_data = "prompts.jsonl"\nrollout_batch_size = 2\nn_samples_per_prompt = 2\n'
        "[trainer]\nglobal_batch_size = 4\nmicro_batch_size = 4\n[metrics]\nport = 0\n"
    )
    return config


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            ['external_policy_sync_path = "tests.no_such_module:Sync"'],
            "run.external_policy_sync_path: cannot import 'tests.no_such_module'",
        ),
        (
            ['external_policy_sync_path = "tests.policy_sync_plugins:NOT_CALLABLE"'],
            "run.external_policy_sync_path: 'tests.policy_sync_plugins:NOT_CALLABLE' is not callable",
        ),
        (
            ['external_policy_sync_path = "tests.policy_sync_plugins:not_a_plugin"'],
            "run.external_policy_sync_path: 'tests.policy_sync_plugins:not_a_plugin' returned object, "
            "which has no initialize, after_local_train, finalize",
        ),
        (
            ['external_policy_sync_path = "miles_events.policy_sync.shared_dir:SharedDirSync"'],
            "run.external_policy_sync_path: 'miles_events.policy_sync.shared_dir:SharedDirSync' raised "
            "ValueError: policy_sync.directory: required by the shared-directory policy sync",
        ),
        (
            [f'external_policy_sync_path = "{RECORDING}"', "[trainer]", "use_critic = true"],
            "run.external_policy_sync_path: the configured external policy synchronizer does not declare "
            "critic support",
        ),
        (
            [
                f'external_policy_sync_path = "{RECORDING}"',
                "rollout_only_from_checkpoint = true",
                'rollout_only_publication_evidence = "evidence.json"',
            ],
            "run.external_policy_sync_path: checkpoint-backed rollout-only mode cannot use external sync or a critic",
        ),
        (
            ["external_policy_sync_run_until_stop = true"],
            "run.external_policy_sync_run_until_stop: only an external policy synchronizer can stop such a run",
        ),
    ],
    ids=[
        "no-module",
        "not-callable",
        "no-hooks",
        "factory-raises",
        "critic",
        "rollout-only",
        "until-stop-alone",
    ],
)
def test_a_plugin_the_run_cannot_use_is_exit_2_with_one_line_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], expected: str
) -> None:
    # A [trainer] table given twice is a TOML error: the critic case overrides on the command line.
    flags: list[str] = []
    if "[trainer]" in lines:
        lines = [line for line in lines if line not in ("[trainer]", "use_critic = true")]
        flags = ["--set", "trainer.use_critic=true"]
    config = write_run(tmp_path, *lines)
    assert main([str(config), *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and expected in err, err
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()


# --- the Coordinator's order of the hooks ------------------------------------------------


def make(num_rollout: int = 2, until_stopped: bool = False, **run) -> Coordinator:
    config = Config(
        run=RunConfig(
            num_rollout=num_rollout,
            external_policy_sync_path=RECORDING,
            external_policy_sync_run_until_stop=until_stopped,
            **run,
        )
    )
    plan = RunPlan(
        start_rollout_id=0,
        num_rollout=num_rollout,
        num_rollout_per_epoch=None,
        engines=("engine-0",),
        config_digest="x",
    )
    return Coordinator(config, RecordingContext(config, name="coordinator", plan=plan))


def started(c: Coordinator) -> RunStarted:
    return RunStarted(
        runtime="local",
        config_digest="x",
        start_rollout_id=0,
        num_rollout=c.plan.num_rollout,
        num_rollout_per_epoch=None,
    )


def verified(version: int, rollout_id: int | None) -> PublicationVerified:
    return PublicationVerified(
        weight_version=str(version), digest="d", num_tensors=1, engines=["engine-0"], rollout_id=rollout_id
    )


def trained(rollout_id: int) -> TrainStepFinished:
    return TrainStepFinished(rollout_id=rollout_id, weight_version="1", metrics=TrainMetrics())


def synced(hook: str, rollout_id: int | None = None, stop: bool = False) -> PolicySyncFinished:
    return PolicySyncFinished(hook=hook, rollout_id=rollout_id, stop=stop)  # type: ignore[arg-type]


def kinds(events) -> list[tuple]:
    out = []
    for e in events:
        if isinstance(e, PolicySyncRequested):
            out.append((e.hook, e.rollout_id))
        elif isinstance(e, RunFinished):
            out.append(("RunFinished", e.status))
        else:
            out.append((type(e).__name__, getattr(e, "rollout_id", None)))
    return out


async def spawned() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_the_coordinator_runs_the_hooks_in_the_seeds_order():
    c = make(num_rollout=2)
    out = await feed(
        c, started(c), synced("initialize"), verified(1, None), synced("after_inference_publication")
    )
    assert kinds(out) == [
        ("initialize", None),
        ("PublishRequested", None),
        ("after_inference_publication", None),
        ("RolloutRequested", 0),
    ]
    # after_local_train after training, before the save and the publication of the step.
    assert kinds(await feed(c, trained(0))) == [("after_local_train", 0)]
    assert kinds(await feed(c, synced("after_local_train", 0))) == [("PublishRequested", 0)]
    assert kinds(await feed(c, verified(2, 0))) == [("after_inference_publication", 0)]
    assert kinds(await feed(c, synced("after_inference_publication", 0))) == [("RolloutRequested", 1)]
    await feed(
        c,
        trained(1),
        synced("after_local_train", 1),
        verified(3, 1),
        synced("after_inference_publication", 1),
    )
    await spawned()
    assert kinds(c.context.published[-1:]) == [("finalize", None)]  # once, before RunFinished
    assert kinds(await feed(c, synced("finalize"))) == [("RunFinished", "completed")]


async def test_a_truthy_after_local_train_stops_after_the_steps_publication_which_is_saved():
    c = make(num_rollout=5)
    await feed(c, started(c), synced("initialize"), verified(1, None), synced("after_inference_publication"))
    await feed(c, trained(0))
    assert kinds(await feed(c, synced("after_local_train", 0, stop=True))) == [("PublishRequested", 0)]
    await feed(c, verified(2, 0))
    out = await feed(c, synced("after_inference_publication", 0))
    assert (
        kinds(out) == [("SaveRequested", 0)] and isinstance(out[0], SaveRequested) and out[0].reason == "stop"
    )
    await feed(c, CheckpointSaved(rollout_id=0, path="p", weight_version="1", num_bytes=1))
    await spawned()
    assert kinds(c.context.published[-1:]) == [("finalize", None)]
    (finished,) = await feed(c, synced("finalize"))
    assert isinstance(finished, RunFinished) and finished.status == "stopped"
    assert "external policy synchronizer stopped the run after rollout 0" in finished.reason


async def test_run_until_stop_requests_rollouts_past_num_rollout():
    c = make(num_rollout=1, until_stopped=True)
    await feed(c, started(c), synced("initialize"), verified(1, None), synced("after_inference_publication"))
    for k in range(3):
        await feed(c, trained(k), synced("after_local_train", k), verified(k + 2, k))
        assert kinds(await feed(c, synced("after_inference_publication", k))) == [("RolloutRequested", k + 1)]


async def test_a_failed_hook_fails_the_run_naming_it():
    c = make()
    await feed(c, started(c))
    (finished,) = await feed(c, PolicySyncFailed(hook="initialize", reason="PolicySyncError: no peer"))
    assert isinstance(finished, RunFinished) and finished.status == "failed"
    assert finished.reason == "external policy sync initialize failed: PolicySyncError: no peer"
    # A failure of finalize fails the run that was ending.
    c = make(num_rollout=0)
    await feed(c, started(c), synced("initialize"), verified(1, None), synced("after_inference_publication"))
    await spawned()
    (finished,) = await feed(c, PolicySyncFailed(hook="finalize", reason="OSError: gone"))
    assert isinstance(finished, RunFinished) and finished.status == "failed"


async def test_without_a_plugin_the_loop_asks_for_no_hook():
    c = Coordinator(
        Config(run=RunConfig(num_rollout=1)), RecordingContext(Config(), name="coordinator", plan=make().plan)
    )
    out = await feed(c, started(c), verified(1, None), trained(0), verified(2, 0))
    assert not [e for e in out if isinstance(e, PolicySyncRequested)]


def driver(path: str) -> PolicySyncDriver:
    config = Config(run=RunConfig(external_policy_sync_path=path))
    actor = PolicySyncDriver(config, RecordingContext(config, name="policy_sync"))
    return actor


async def test_a_hook_that_raises_is_answered_with_one_line_naming_why():
    actor = driver(RECORDING)
    await actor.start()
    await feed(actor, PolicySyncRequested(hook="after_inference_publication", rollout_id=None))
    await spawned()
    (failed,) = actor.context.published  # type: ignore[attr-defined]
    assert isinstance(failed, PolicySyncFailed)
    assert failed.reason == f"RuntimeError: {EXACT_INFO_MISSING}", "no publication is through yet"


async def test_a_stop_now_cuts_a_hanging_hook_which_fails():
    actor = driver("tests.policy_sync_plugins:HangingSync")
    await actor.start()
    await feed(actor, PolicySyncRequested(hook="initialize"))
    await spawned()
    assert actor.context.published == []  # type: ignore[attr-defined]
    actor.interrupt(StopRequested(reason="signal", now=False))
    await spawned()
    assert actor.context.published == []  # type: ignore[attr-defined]
    actor.interrupt(StopRequested(reason="second signal", now=True))
    await spawned()
    (failed,) = actor.context.published  # type: ignore[attr-defined]
    assert isinstance(failed, PolicySyncFailed) and failed.reason == "cut by a stop: second signal"


# --- a live run ----------------------------------------------------------------------------

SMALL = (
    'run.runtime="local"',
    "metrics.port=0",
    'console.mode="quiet"',
    "data.rollout_batch_size=4",
    "data.n_samples_per_prompt=4",
    "trainer.global_batch_size=16",
    "trainer.micro_batch_size=16",
    "run.skip_eval_before_train=true",
    "run.eval_interval=1000",
)


def live_run(tmp_path: Path, *overrides: str) -> tuple[RunFinished, list]:
    config = load_config(
        TINY, [*SMALL, f'run.dir="{tmp_path}"', f'run.external_policy_sync_path="{RECORDING}"', *overrides]
    )
    policy_sync_plugins.CALLS.clear()
    result = asyncio.run(Session(config, list(ACTORS)).run())
    return result.finished, list(read_events(tmp_path / "events.log"))


def hook_order(calls: list[tuple]) -> list[tuple]:
    return [call[:2] if call[0] != "initialize" else call[:1] for call in calls]


def test_a_live_run_calls_the_hooks_in_the_seeds_order_and_the_plugin_loads_weights(tmp_path: Path):
    finished, log = live_run(tmp_path, "run.num_rollout=2")
    assert finished.status == "completed", finished.reason
    calls = policy_sync_plugins.CALLS
    assert hook_order(calls) == [
        ("initialize",),
        ("after_inference_publication", None),
        ("after_local_train", 0),
        ("after_inference_publication", 0),
        ("after_local_train", 1),
        ("after_inference_publication", 1),
        ("finalize",),
    ]
    assert calls[0][1] == {"engine-0": "default"}, "initialize comes before the first publication"
    staged = {e.rollout_id: e for e in log if type(e).__name__ == "WeightsStaged"}
    for call in calls:
        if call[0] == "after_inference_publication":  # the exact info of the publication just verified
            info = call[2]
            assert info.rollout_id == call[1] and info.verified and info.engines == ["engine-0"]
            assert (
                info.digest == staged[call[1]].digest
                and info.weight_version == staged[call[1]].weight_version
            )
        if call[0] == "after_local_train":
            summary, read, loaded = call[2], call[3], call[4]
            assert summary.rollout_id == call[1] and summary.num_samples == 16
            assert read == loaded, "the weights loaded back are what was read"
    # In the log: after_local_train between the step's training and its publication; the
    # finalize before RunFinished.
    order = [
        (type(e).__name__, getattr(e, "hook", None), getattr(e, "rollout_id", None))
        for e in log
        if isinstance(e, (TrainStepFinished, PolicySyncFinished, PublishRequested, RunFinished))
    ]
    assert order.index(("TrainStepFinished", None, 0)) < order.index(
        ("PolicySyncFinished", "after_local_train", 0)
    )
    assert order.index(("PolicySyncFinished", "after_local_train", 0)) < order.index(
        ("PublishRequested", None, 0)
    )
    assert order[-2:] == [("PolicySyncFinished", "finalize", None), ("RunFinished", None, None)]


def test_a_live_run_until_stopped_goes_past_num_rollout_until_the_plugin_stops_it(tmp_path: Path):
    # The recording plugin stops after rollout ``policy_sync.peers - 1`` when its peer is "stop".
    finished, log = live_run(
        tmp_path,
        "run.num_rollout=1",
        "run.external_policy_sync_run_until_stop=true",
        'policy_sync.peer="stop"',
        "policy_sync.peers=3",
    )
    assert finished.status == "stopped" and finished.last_rollout_id == 2, finished.reason
    assert hook_order(policy_sync_plugins.CALLS)[-3:] == [
        ("after_local_train", 2),
        ("after_inference_publication", 2),
        ("finalize",),
    ]
    saves = [(e.rollout_id, e.reason) for e in log if isinstance(e, SaveRequested)]
    assert saves[-1] == (2, "stop"), "the step a stop ends after is saved"


def test_a_plugin_declaring_critic_support_reads_and_loads_the_critics_weights(tmp_path: Path):
    finished, _ = live_run(
        tmp_path,
        "run.num_rollout=2",
        "trainer.use_critic=true",
        'run.external_policy_sync_path="tests.policy_sync_plugins:CriticSync"',
    )
    assert finished.status == "completed", finished.reason
    calls = policy_sync_plugins.CALLS
    assert calls[0][0] == "initialize" and calls[0][2] == ["critic_model"]
    critic = [call for call in calls if call[0] == "critic"]
    assert [call[1] for call in critic] == [0, 1]
    assert all(read == loaded for _, _, read, loaded in critic)
    policy = {call[1]: call[3] for call in calls if call[0] == "after_local_train"}
    assert {call[1]: call[2] for call in critic} != policy, "the critic's weights are its own"


# --- the shared-directory plugin's files ------------------------------------------------------


def tensors(value: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3,), value, dtype=dtype), "b": torch.full((2, 2), -value, dtype=dtype)}


def test_a_round_is_written_atomically_with_its_sha256(tmp_path: Path):
    sha = write_round(tmp_path / "round-1", "peer-a", tensors(1.0))
    assert sorted(os.listdir(tmp_path / "round-1")) == ["peer-a.safetensors", "peer-a.sha256"], (
        "no temporary left"
    )
    assert sha == file_sha256(tmp_path / "round-1" / "peer-a.safetensors")
    assert (tmp_path / "round-1" / "peer-a.sha256").read_text().split()[0] == sha
    # A peer counts once its digest is there, not while its weights are half written.
    (tmp_path / "round-1" / "peer-b.safetensors").write_bytes(b"partial")
    (tmp_path / "round-1" / ".peer-c.sha256.tmp-1").write_text("x")
    assert peers_written(tmp_path / "round-1") == ["peer-a"]


def test_the_mean_is_float32_cast_back_and_the_same_whoever_computes_it(tmp_path: Path):
    round_dir = tmp_path / "round-1"
    write_round(round_dir, "a", tensors(1.0, torch.bfloat16))
    write_round(round_dir, "b", tensors(2.0, torch.bfloat16))
    write_round(round_dir, "c", tensors(4.0, torch.bfloat16))
    mean = average_round(round_dir, ["a", "b", "c"])
    assert mean["a"].dtype == torch.bfloat16
    assert torch.equal(mean["a"], torch.full((3,), 7 / 3).to(torch.bfloat16))
    assert torch.equal(mean["b"], torch.full((2, 2), -7 / 3).to(torch.bfloat16))


def test_weights_that_do_not_match_their_sha256_are_refused_naming_the_peer(tmp_path: Path):
    round_dir = tmp_path / "round-1"
    write_round(round_dir, "a", tensors(1.0))
    write_round(round_dir, "b", tensors(2.0))
    damaged = bytearray((round_dir / "b.safetensors").read_bytes())
    damaged[-1] ^= 0x01
    (round_dir / "b.safetensors").write_bytes(bytes(damaged))
    with pytest.raises(
        PolicySyncError, match="b.safetensors does not match its SHA-256.*the weights of b are damaged"
    ):
        average_round(round_dir, ["a", "b"])


def test_weights_of_another_shape_are_refused_naming_the_peer(tmp_path: Path):
    round_dir = tmp_path / "round-1"
    write_round(round_dir, "a", tensors(1.0))
    write_round(round_dir, "b", {"a": torch.zeros(4), "b": torch.zeros(2, 2)})
    with pytest.raises(
        PolicySyncError, match=r"a of b in .* is torch.float32 \(4,\), a's torch.float32 \(3,\)"
    ):
        average_round(round_dir, ["a", "b"])


def test_earlier_rounds_of_this_peer_are_pruned(tmp_path: Path):
    for name in ("initial", "00000000", "00000001"):
        write_round(tmp_path / f"round-{name}", "a", tensors(1.0))
    write_round(tmp_path / "round-00000000", "b", tensors(1.0))
    prune_rounds(tmp_path, "a", keep=tmp_path / "round-00000001")
    assert sorted(os.listdir(tmp_path)) == ["round-00000000", "round-00000001"]
    assert peers_written(tmp_path / "round-00000000") == ["b"], "another peer's files are its own to remove"


class FakeModel:
    """The facade's two calls, on a dict (the plugin's protocol alone)."""

    def __init__(self, value: float) -> None:
        self.tensors = tensors(value)
        self.loaded: list[dict[str, torch.Tensor]] = []

    async def weights(self):
        from miles_events.policy_sync.api import TrainedWeights

        return TrainedWeights(tensors=self.tensors, digest="", weight_version="1")

    async def load_weights(self, tensors):
        self.loaded.append(tensors)
        return "digest"


def sync(tmp_path: Path, peer: str, timeout: float = 5.0) -> SharedDirSync:
    settings = PolicySyncConfig(directory=str(tmp_path), peers=2, peer=peer, timeout_seconds=timeout)
    return SharedDirSync(Config(policy_sync=settings))


async def test_a_round_waits_for_every_peer_and_loads_the_mean(tmp_path: Path):
    a, b = sync(tmp_path, "a"), sync(tmp_path, "b")
    model_a, model_b = FakeModel(1.0), FakeModel(3.0)
    await asyncio.gather(
        a.after_local_train(rollout_id=0, actor_model=model_a, rollout_data=None),  # type: ignore[arg-type]
        b.after_local_train(rollout_id=0, actor_model=model_b, rollout_data=None),  # type: ignore[arg-type]
    )
    for model in (model_a, model_b):
        assert torch.equal(model.loaded[0]["a"], torch.full((3,), 2.0))


async def test_a_peer_that_never_writes_is_a_timeout_naming_it(tmp_path: Path):
    a, b = sync(tmp_path, "a", timeout=0.3), sync(tmp_path, "b", timeout=0.3)
    await asyncio.gather(
        a.after_local_train(rollout_id=0, actor_model=FakeModel(1.0), rollout_data=None),  # type: ignore[arg-type]
        b.after_local_train(rollout_id=0, actor_model=FakeModel(1.0), rollout_data=None),  # type: ignore[arg-type]
    )
    with pytest.raises(PolicySyncError, match=r"round 00000001: after 0.3s 1 of 2 runs .*\(a\); missing: b"):
        await a.after_local_train(rollout_id=1, actor_model=FakeModel(1.0), rollout_data=None)  # type: ignore[arg-type]
    fresh = sync(tmp_path / "other", "a", timeout=0.2)
    with pytest.raises(PolicySyncError, match="1 more run"):
        await fresh.after_local_train(rollout_id=0, actor_model=FakeModel(1.0), rollout_data=None)  # type: ignore[arg-type]


def memory_and_hooks(log: list) -> list[str]:
    out = []
    for e in log:
        name = type(e).__name__
        if name in ("OffloadRequested", "OnloadRequested"):
            out.append(f"{'off' if name == 'OffloadRequested' else 'on'} {e.target}")
        elif name == "PolicySyncRequested":
            out.append(f"{e.hook} {e.rollout_id}" if e.rollout_id is not None else e.hook)
        elif name == "PublishRequested":
            out.append(f"publish {e.rollout_id}")
    return out


@pytest.mark.parametrize("offload_rollout", [True, False])
def test_with_offload_the_plugin_meets_an_onloaded_trainer_in_the_seeds_order(
    tmp_path: Path, offload_rollout: bool
):
    finished, log = live_run(
        tmp_path,
        "run.num_rollout=1",
        "run.offload_train=true",
        f"run.offload_rollout={str(offload_rollout).lower()}",
    )
    assert finished.status == "completed", finished.reason
    sequence = memory_and_hooks(log)
    opening = sequence[: sequence.index("after_local_train 0")]
    if offload_rollout:
        # The trainer wakes for initialize, then sleeps before the engines take their weights.
        assert opening == [
            "off rollout", "off actor", "on actor", "initialize", "off actor", "on rollout", "publish None",
            "after_inference_publication", "on rollout", "off rollout",  # the last after rollout 0's generation
        ]  # fmt: skip
    else:
        # Without engine offload, the trainer sleeps once the plugin heard of the publication.
        assert opening == [
            "off actor",
            "on actor",
            "initialize",
            "publish None",
            "after_inference_publication",
            "off actor",
        ]
    # The plugin read and loaded the weights of the (woken) trainer; the step publishes them.
    assert hook_order(policy_sync_plugins.CALLS)[-3:] == [
        ("after_local_train", 0),
        ("after_inference_publication", 0),
        ("finalize",),
    ]
    assert all(type(e).__name__ != "PublicationMismatch" for e in log)
