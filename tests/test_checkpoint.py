"""Checkpoints on disk (miles_events.checkpoint) and the Saver actor."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.saver import Saver
from miles_events.bus.testing import RecordingContext
from miles_events.checkpoint import format as ckpt
from miles_events.checkpoint.format import (
    CheckpointError,
    read_checkpoint,
    verify_checkpoint,
    write_checkpoint,
)
from miles_events.checkpoint.prune import prune_checkpoints
from miles_events.checkpoint.resume import latest_checkpoint
from miles_events.rl.hf_model import load_model, load_tokenizer
from miles_events.rl.weights import split_tied
from miles_events.transport.inprocess import InProcessTransport
from miles_events.transport.shm import ShmTransport
from schemas.checkpoint import DataCursor, TrainerState
from schemas.config import Config, ModelConfig, SaverConfig
from schemas.data import DataRef
from schemas.events import CheckpointFailed, CheckpointSaved, DataReleased, Event, TrainStateStaged
from tests.support import torch_save_bytes

# --- building blocks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_dir(built_in_model: Callable[[int], Path]) -> Path:
    return built_in_model(7)


def _state(rollout_id: int, weight_version: str = "3") -> TrainerState:
    return TrainerState(
        rollout_id=rollout_id,
        weight_version=weight_version,
        num_optimizer_steps=2 * (rollout_id + 1),
        data=DataCursor(next_rollout_id=rollout_id + 1, epoch=0, offset=8 * (rollout_id + 1)),
        seed=1234,
        run_id="run-test",
    )


def _trained(base_dir: Path) -> tuple[torch.nn.Module, dict, dict]:
    """A model moved away from the base by one optimizer step, its optimizer and RNG state."""
    torch.manual_seed(0)
    model = load_model(base_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    input_ids = torch.tensor([[3, 4, 5, 6, 7]])
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    return model, optimizer.state_dict(), rng


def _small_weights(value: float) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.full((4, 2), value), "lm_head.weight": torch.ones(4, 2)}


def _write(run_dir: Path, base_dir: Path, rollout_id: int, value: float = 1.0) -> Path:
    return write_checkpoint(
        run_dir,
        base_dir,
        rollout_id,
        _small_weights(value),
        {"state": {}},
        {"torch": torch.get_rng_state()},
        _state(rollout_id),
        fsync=False,
    )


def _flip_byte(path: Path, offset_from_end: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


# --- writing and reading -------------------------------------------------------------


def test_round_trip_gives_identical_weights_optimizer_rng_and_state(base_dir: Path, tmp_path: Path) -> None:
    model, optimizer, rng = _trained(base_dir)
    weights = model.state_dict()
    path = write_checkpoint(tmp_path, base_dir, 5, weights, optimizer, rng, _state(5))

    loaded = read_checkpoint(path)

    assert path == tmp_path / "checkpoints" / "rollout_000005"
    assert loaded.weights.keys() == weights.keys()
    assert all(torch.equal(loaded.weights[k], weights[k]) for k in weights)
    assert torch_save_bytes(loaded.optimizer) == torch_save_bytes(optimizer)
    assert torch.equal(loaded.rng["torch"], rng["torch"])
    assert loaded.rng["python"] == rng["python"]
    assert loaded.trainer_state == _state(5)
    assert loaded.manifest.rollout_id == 5 and loaded.manifest.weight_version == "3"


def test_manifest_lists_every_other_file_with_size(base_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, base_dir, 0)

    manifest = verify_checkpoint(path)

    on_disk = {p.name: p.stat().st_size for p in path.iterdir() if p.name != "manifest.json"}
    assert {e.path: e.num_bytes for e in manifest.files} == on_disk
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.json"} <= on_disk.keys()


def test_latest_file_names_the_last_written_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    _write(tmp_path, base_dir, 2)
    _write(tmp_path, base_dir, 1)

    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "rollout_000001"
    # Megatron's marker, which miles reads as the checkpoint iteration.
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "1\n"


def test_transformers_loads_checkpoint_with_same_logits(base_dir: Path, tmp_path: Path) -> None:
    model, optimizer, rng = _trained(base_dir)
    path = write_checkpoint(tmp_path, base_dir, 1, model.state_dict(), optimizer, rng, _state(1), fsync=False)

    reloaded = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    input_ids = tokenizer("12+34=", return_tensors="pt").input_ids
    assert input_ids.tolist() == load_tokenizer(base_dir)("12+34=", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        expected = model.eval()(input_ids=input_ids).logits
        actual = reloaded.eval()(input_ids=input_ids).logits
        base = load_model(base_dir).eval()(input_ids=input_ids).logits
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, base)


def test_a_staged_file_becomes_the_checkpoints_weights_as_it_is(base_dir: Path, tmp_path: Path) -> None:
    """The Saver of a transport that keeps a tensor set in one safetensors file copies that
    file (no torch needed): the checkpoint is the same as one written from the tensors."""
    model, optimizer, rng = _trained(base_dir)
    transport = ShmTransport("ckpt-test", tmp_path / "shm")
    try:
        unique, _tied = split_tied(model.state_dict())
        ref = transport.stager.put_tensors("weights", unique, owner="trainer")
        staged = transport.reader.tensors_file(ref)
        path = write_checkpoint(
            tmp_path / "copied", base_dir, 1, staged, optimizer, rng, _state(1), fsync=False
        )
        decoded = write_checkpoint(
            tmp_path / "decoded", base_dir, 1, unique, optimizer, rng, _state(1), fsync=False
        )
    finally:
        transport.close()
    assert (path / "model.safetensors").read_bytes() == (decoded / "model.safetensors").read_bytes()
    assert verify_checkpoint(path) == verify_checkpoint(decoded)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    input_ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(
            reloaded.eval()(input_ids=input_ids).logits, model.eval()(input_ids=input_ids).logits
        )


def test_the_in_process_transport_keeps_no_file_so_the_saver_decodes() -> None:
    transport = InProcessTransport("ckpt-test")
    try:
        assert (
            transport.reader.tensors_file(
                transport.stager.put_tensors("w", {"x": torch.ones(2)}, owner="trainer")
            )
            is None
        )
    finally:
        transport.close()


def test_weights_that_share_storage_are_saved(base_dir: Path, tmp_path: Path) -> None:
    embedding = torch.randn(4, 2)
    weights = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}

    path = write_checkpoint(tmp_path, base_dir, 0, weights, {}, {}, _state(0))

    loaded = read_checkpoint(path).weights
    assert torch.equal(loaded["lm_head.weight"], embedding)
    assert torch.equal(loaded["model.embed_tokens.weight"], embedding)


def test_flipped_byte_in_weights_makes_read_raise_naming_the_file(base_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, base_dir, 0)
    _flip_byte(path / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        read_checkpoint(path)


def test_missing_manifest_is_reported_incomplete(base_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, base_dir, 0)
    (path / "manifest.json").unlink()

    with pytest.raises(CheckpointError, match="incomplete: no manifest"):
        verify_checkpoint(path)


def test_missing_listed_file_is_named(base_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, base_dir, 0)
    (path / "rng.pt").unlink()

    with pytest.raises(CheckpointError, match=r"missing file rng\.pt"):
        verify_checkpoint(path)


# --- finding the checkpoint to resume from ---------------------------------------------


class _RunsCode:
    """Unpickling this calls ``os.system``: what a crafted checkpoint file would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("file_name", ["rng.pt", "optimizer.pt"])
def test_a_crafted_pickle_with_a_matching_manifest_is_refused_and_never_run(
    base_dir: Path, tmp_path: Path, file_name: str
) -> None:
    """Whoever can write a checkpoint can rewrite its manifest too: the hashes match, and
    the load must still run nothing."""
    marker = tmp_path / "code-ran"
    crafted = tmp_path / "staged.pt"  # a staged file is copied as it is
    crafted.write_bytes(torch_save_bytes({"torch": torch.get_rng_state(), "python": _RunsCode(marker)}))
    rng = crafted if file_name == "rng.pt" else {"torch": torch.get_rng_state()}
    optimizer = crafted if file_name == "optimizer.pt" else {"state": {}}
    path = write_checkpoint(
        tmp_path / "run", base_dir, 0, _small_weights(1.0), optimizer, rng, _state(0), fsync=False
    )
    verify_checkpoint(path)  # the manifest agrees with the crafted file
    with pytest.raises(CheckpointError, match=f"{file_name} holds objects other than tensors and plain data"):
        read_checkpoint(path)
    assert not marker.exists()


def test_what_the_trainer_saves_loads_with_weights_only(base_dir: Path, tmp_path: Path) -> None:
    from actors.trainer_backend.base import capture_rng_state

    _model, optimizer, _rng = _trained(base_dir)
    rng = capture_rng_state()
    path = write_checkpoint(
        tmp_path / "run", base_dir, 0, _small_weights(1.0), optimizer, rng, _state(0), fsync=False
    )
    loaded = read_checkpoint(path)
    assert loaded.optimizer["state"] and torch.equal(loaded.rng["torch"], rng["torch"])


def test_latest_is_none_without_checkpoints(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None


def test_latest_ignores_partial_dir(base_dir: Path, tmp_path: Path) -> None:
    complete = _write(tmp_path, base_dir, 1)
    partial = tmp_path / "checkpoints" / ".rollout_000002.partial-999999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")

    assert latest_checkpoint(tmp_path) == complete


def test_latest_falls_back_past_checkpoint_without_manifest(base_dir: Path, tmp_path: Path) -> None:
    complete = _write(tmp_path, base_dir, 1)
    torn = _write(tmp_path, base_dir, 2)
    (torn / "manifest.json").unlink()

    assert latest_checkpoint(tmp_path) == complete


def test_latest_falls_back_past_corrupted_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    complete = _write(tmp_path, base_dir, 1)
    corrupted = _write(tmp_path, base_dir, 2)
    _flip_byte(corrupted / "model.safetensors")

    assert latest_checkpoint(tmp_path) == complete


def test_latest_uses_highest_rollout_when_pointer_is_missing(base_dir: Path, tmp_path: Path) -> None:
    _write(tmp_path, base_dir, 1)
    newest = _write(tmp_path, base_dir, 3)
    _write(tmp_path, base_dir, 2)
    (tmp_path / "checkpoints" / "latest").unlink()

    assert latest_checkpoint(tmp_path) == newest


# --- replacing a checkpoint of the same rollout ------------------------------------------


def test_rewriting_a_rollout_replaces_it_with_a_complete_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    _write(tmp_path, base_dir, 4, value=1.0)

    path = _write(tmp_path, base_dir, 4, value=2.0)

    verify_checkpoint(path)
    assert torch.equal(read_checkpoint(path).weights["model.embed_tokens.weight"], torch.full((4, 2), 2.0))
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "latest",
        "latest_checkpointed_iteration.txt",
        "rollout_000004",
    ]


def test_rewriting_without_atomic_exchange_still_replaces(
    base_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, base_dir, 4, value=1.0)
    monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)

    path = _write(tmp_path, base_dir, 4, value=2.0)

    assert torch.equal(read_checkpoint(path).weights["model.embed_tokens.weight"], torch.full((4, 2), 2.0))
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "latest",
        "latest_checkpointed_iteration.txt",
        "rollout_000004",
    ]


def test_failed_rewrite_leaves_previous_checkpoint_intact(base_dir: Path, tmp_path: Path) -> None:
    previous = _write(tmp_path, base_dir, 4, value=1.0)
    no_config = tmp_path / "no_config"
    no_config.mkdir()

    with pytest.raises(CheckpointError):
        write_checkpoint(tmp_path, no_config, 4, _small_weights(2.0), {}, {}, _state(4), fsync=False)

    embedding = read_checkpoint(previous).weights["model.embed_tokens.weight"]
    assert torch.equal(embedding, torch.full((4, 2), 1.0))
    assert sorted(p.name for p in previous.parent.iterdir()) == [
        "latest",
        "latest_checkpointed_iteration.txt",
        "rollout_000004",
    ]


# --- pruning -------------------------------------------------------------------------


def test_prune_keeps_the_newest_n(base_dir: Path, tmp_path: Path) -> None:
    for rollout_id in range(5):
        _write(tmp_path, base_dir, rollout_id)

    removed = prune_checkpoints(tmp_path, keep_last=2)

    assert sorted(p.name for p in removed) == ["rollout_000000", "rollout_000001", "rollout_000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("rollout_*")) == [
        "rollout_000003",
        "rollout_000004",
    ]


def test_prune_zero_keeps_all(base_dir: Path, tmp_path: Path) -> None:
    for rollout_id in range(3):
        _write(tmp_path, base_dir, rollout_id)

    assert prune_checkpoints(tmp_path, keep_last=0) == []
    assert len(list((tmp_path / "checkpoints").glob("rollout_*"))) == 3


def test_prune_never_removes_the_latest_target(base_dir: Path, tmp_path: Path) -> None:
    for rollout_id in (2, 3, 1):
        _write(tmp_path, base_dir, rollout_id)

    prune_checkpoints(tmp_path, keep_last=1)

    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("rollout_*")) == [
        "rollout_000001",
        "rollout_000003",
    ]


def test_prune_removes_work_dirs_of_dead_writers_only(base_dir: Path, tmp_path: Path) -> None:
    _write(tmp_path, base_dir, 0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "checkpoints" / f".rollout_000001.partial-{dead.pid}"
    live = tmp_path / "checkpoints" / f".rollout_000002.partial-{os.getpid()}"
    stale.mkdir()
    live.mkdir()

    removed = prune_checkpoints(tmp_path, keep_last=0)

    assert removed == [stale]
    assert live.exists() and not stale.exists()


# --- the Saver actor ---------------------------------------------------------------------


def _saver(base_dir: Path, run_dir: Path, keep_last: int = 0) -> tuple[Saver, RecordingContext]:
    saver_config = SaverConfig(keep_last=keep_last, fsync=False)
    config = Config(model=ModelConfig(path=str(base_dir)), saver=saver_config)
    context = RecordingContext(
        config, name="saver", run_id="run-test", run_dir=run_dir, transport=InProcessTransport("run-test")
    )
    return Saver(config, context), context


def _staged(context: RecordingContext, rollout_id: int) -> TrainStateStaged:
    transport = context.transport
    return TrainStateStaged(
        rollout_id=rollout_id,
        weights=transport.stager.put_tensors(f"w{rollout_id}", _small_weights(float(rollout_id)), "trainer"),
        optimizer=transport.stager.put_state(f"o{rollout_id}", {"state": {}}, "trainer"),
        rng=transport.stager.put_state(f"r{rollout_id}", {"torch": torch.get_rng_state()}, "trainer"),
        trainer_state=_state(rollout_id, weight_version=str(rollout_id + 1)),
    )


def _released(events: list[Event]) -> list[DataRef]:
    return [e.ref for e in events if isinstance(e, DataReleased)]


@pytest.fixture(autouse=True)
def _drop_in_process_data() -> Iterator[None]:
    yield
    InProcessTransport("run-test").close()


async def test_saver_releases_three_refs_then_reports_saved(base_dir: Path, tmp_path: Path) -> None:
    saver, context = _saver(base_dir, tmp_path)
    event = _staged(context, 3)

    await saver.handle(event)

    assert [type(e) for e in context.published] == [DataReleased] * 3 + [CheckpointSaved]
    assert _released(context.published) == [event.weights, event.optimizer, event.rng]
    saved = context.published[-1]
    assert isinstance(saved, CheckpointSaved)
    assert (saved.rollout_id, saved.weight_version) == (3, "4")
    assert Path(saved.path) == tmp_path / "checkpoints" / "rollout_000003"
    assert saved.num_bytes == sum(p.stat().st_size for p in Path(saved.path).iterdir())
    assert read_checkpoint(Path(saved.path)).trainer_state == event.trainer_state


async def test_the_saver_copies_the_staged_files_of_a_file_transport_as_they_are(
    base_dir: Path, tmp_path: Path
) -> None:
    saver, context = _saver(base_dir, tmp_path / "run")
    context.transport = ShmTransport("run-test-files", tmp_path / "shm")
    event = _staged(context, 2)
    staged = {"optimizer.pt": event.optimizer, "rng.pt": event.rng}
    staged_bytes = {
        name: context.transport.reader.state_file(ref).read_bytes() for name, ref in staged.items()
    }

    await saver.handle(event)

    saved = context.published[-1]
    assert isinstance(saved, CheckpointSaved)
    for name, data in staged_bytes.items():
        assert (Path(saved.path) / name).read_bytes() == data
    assert read_checkpoint(Path(saved.path)).optimizer == {"state": {}}


async def test_saver_prunes_to_keep_last(base_dir: Path, tmp_path: Path) -> None:
    saver, context = _saver(base_dir, tmp_path, keep_last=2)

    for rollout_id in range(4):
        await saver.handle(_staged(context, rollout_id))

    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("rollout_*")) == [
        "rollout_000002",
        "rollout_000003",
    ]


async def test_saver_reports_failure_when_run_dir_is_not_writable(base_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    saver, context = _saver(base_dir, blocker / "run")
    event = _staged(context, 1)

    await saver.handle(event)

    assert [type(e) for e in context.published] == [DataReleased] * 3 + [CheckpointFailed]
    failed = context.published[-1]
    assert isinstance(failed, CheckpointFailed) and failed.rollout_id == 1
    assert failed.reason and "\n" not in failed.reason


async def test_saver_reports_failure_when_weights_ref_is_gone(base_dir: Path, tmp_path: Path) -> None:
    saver, context = _saver(base_dir, tmp_path)
    event = _staged(context, 1)
    context.transport.stager.free(event.weights)

    await saver.handle(event)

    assert [type(e) for e in context.published] == [DataReleased] * 3 + [CheckpointFailed]
    assert "gone" in context.published[-1].reason


async def test_saver_failure_keeps_older_checkpoint(base_dir: Path, tmp_path: Path) -> None:
    saver, context = _saver(base_dir, tmp_path)
    await saver.handle(_staged(context, 1))
    older = latest_checkpoint(tmp_path)
    broken = _staged(context, 1)
    context.transport.stager.free(broken.rng)

    await saver.handle(broken)

    assert isinstance(context.published[-1], CheckpointFailed)
    assert latest_checkpoint(tmp_path) == older
    assert read_checkpoint(older).trainer_state.rollout_id == 1


def test_saver_asks_for_half_a_cpu() -> None:
    assert Saver.name == "saver"
    assert Saver.resources(Config()).cpus_per_rank == 0.5


# --- PPO's critic in the checkpoint ----------------------------------------------------


def test_a_critic_is_written_into_critic_and_every_file_of_it_is_verified(
    base_dir: Path, tmp_path: Path
) -> None:
    critic = ckpt.CriticParts(
        weights={"model.embed_tokens.weight": torch.full((4, 2), 0.5), "score.weight": torch.ones(1, 2)},
        optimizer={"state": {}, "param_groups": []},
        rng={"torch": torch.get_rng_state()},
        num_optimizer_steps=6,
    )
    path = write_checkpoint(
        tmp_path, base_dir, 2, _small_weights(1.0), {"state": {}}, {"torch": torch.get_rng_state()}, _state(2),
        fsync=False, critic=critic,
    )  # fmt: skip
    listed = {entry.path for entry in verify_checkpoint(path).files}
    assert {
        "critic/model.safetensors",
        "critic/optimizer.pt",
        "critic/rng.pt",
        "critic/config.json",
    } <= listed
    assert ckpt.has_critic(path)
    loaded = ckpt.read_critic(path)
    assert loaded.num_optimizer_steps == 6 and torch.equal(loaded.weights["score.weight"], torch.ones(1, 2))
    config = (path / "critic" / "config.json").read_text()
    assert "ForTokenClassification" in config and "ForCausalLM" not in config
    _flip_byte(path / "critic" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"critic/model\.safetensors"):
        verify_checkpoint(path)


def test_a_checkpoint_without_a_critic_says_so(base_dir: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, base_dir, 0)
    assert not ckpt.has_critic(path)
    with pytest.raises(CheckpointError, match="holds no critic"):
        ckpt.read_critic(path)


def test_a_manifest_entry_leading_out_of_the_critic_directory_is_refused(
    base_dir: Path, tmp_path: Path
) -> None:
    import json

    path = _write(tmp_path, base_dir, 0)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"].append({"path": "critic/../../evil", "sha256": "0" * 64, "num_bytes": 1})
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="bad manifest entry"):
        verify_checkpoint(path)
