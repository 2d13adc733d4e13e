"""The disk transport: a handle is a path under the run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_events.transport.base import open_transport
from miles_events.transport.disk import DiskTransport


def test_tensors_round_trip_through_a_directory_of_safetensors(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    assert isinstance(disk, DiskTransport)
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    ref = disk.put_tensors("weights-v1", tensors, owner="trainer")
    tensors["a"].zero_()  # a copy was staged
    directory = disk.path(ref)
    assert directory == tmp_path / "transport" / "run-1" / "weights-v1"
    assert [p.name for p in directory.iterdir()] == ["model.safetensors"]
    assert ref.transport == "disk" and ref.num_bytes == (directory / "model.safetensors").stat().st_size
    loaded = disk.get_tensors(ref)
    assert torch.equal(loaded["a"], torch.arange(6.0).reshape(2, 3)) and loaded["b"].dtype == torch.bfloat16


def test_bytes_round_trip_and_free_removes_them(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    ref = disk.put_bytes("rollout-0", b"batch", owner="generator")
    assert disk.get_bytes(ref) == b"batch" and disk.path(ref).is_file()
    disk.free(ref)
    disk.free(ref)  # twice is allowed
    with pytest.raises(KeyError, match="rollout-0"):
        disk.get_bytes(ref)


def test_a_key_put_again_replaces_the_old_data(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    disk.put_tensors("w", {"a": torch.zeros(2)}, owner="trainer")
    ref = disk.put_tensors("w", {"b": torch.ones(2)}, owner="trainer")
    assert set(disk.get_tensors(ref)) == {"b"}


def test_close_removes_the_runs_files(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    ref = disk.put_tensors("w", {"a": torch.zeros(2)}, owner="trainer")
    disk.close()
    assert not (tmp_path / "transport").exists()
    with pytest.raises(KeyError):
        disk.get_tensors(ref)


def test_bad_keys_and_a_missing_run_dir_are_errors(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    for key in ("../escape", ".hidden", ""):
        with pytest.raises(ValueError, match="bad data key"):
            disk.put_bytes(key, b"", owner="x")
    with pytest.raises(ValueError, match="needs the run directory"):
        open_transport("disk", "run-1")
    with pytest.raises(ValueError, match="unknown transport 'nccl'"):
        open_transport("nccl", "run-1", tmp_path)
