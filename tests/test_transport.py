"""Transports: the disk transport's handle is a path under the run directory; weights
staged as flat buckets pass in process and by CUDA IPC without a copy, and as files
elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_events.device.buckets import Buckets
from miles_events.transport.base import open_transport
from miles_events.transport.disk import DiskTransport


def test_tensors_round_trip_through_a_directory_of_safetensors(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    assert isinstance(disk, DiskTransport)
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    ref = disk.stager.put_tensors("weights-v1", tensors, owner="trainer")
    tensors["a"].zero_()  # a copy was staged
    directory = disk.reader.path(ref)
    assert directory == tmp_path / "transport" / "run-1" / "weights-v1"
    assert [p.name for p in directory.iterdir()] == ["model.safetensors"]
    assert ref.transport == "disk" and ref.num_bytes == (directory / "model.safetensors").stat().st_size
    loaded = disk.reader.get_tensors(ref)
    assert torch.equal(loaded["a"], torch.arange(6.0).reshape(2, 3)) and loaded["b"].dtype == torch.bfloat16


def test_bytes_round_trip_and_free_removes_them(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    ref = disk.stager.put_bytes("rollout-0", b"batch", owner="generator")
    assert disk.reader.get_bytes(ref) == b"batch" and disk.reader.path(ref).is_file()
    disk.stager.free(ref)
    disk.stager.free(ref)  # twice is allowed
    with pytest.raises(KeyError, match="rollout-0"):
        disk.reader.get_bytes(ref)


@pytest.mark.parametrize("name", ["shm", "disk"])
def test_freed_data_is_gone_at_once_and_its_bytes_are_removed_off_the_callers_thread(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
):
    from miles_events.transport import reaper

    plane = open_transport(name, f"run-free-{name}", tmp_path)
    root = plane.root
    started, release = threading.Event(), threading.Event()
    unlink = Path.unlink

    def slow_unlink(self: Path, missing_ok: bool = False) -> None:  # a large file's pages
        started.set()
        release.wait(10)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", slow_unlink)
    try:
        tensors = plane.stager.put_tensors("weights-v1", {"w": torch.ones(4)}, owner="trainer")
        state = plane.stager.put_state("train-state-1", optimizer_state(), owner="trainer")
        plane.stager.free(state)  # returns while its removal is held up
        plane.stager.free(tensors)
        assert started.wait(10)
        with pytest.raises((KeyError, FileNotFoundError)):
            plane.reader.get_state(state)
        again = plane.stager.put_state("train-state-1", {"step": 2}, owner="trainer")  # the key is free again
        assert plane.reader.get_state(again) == {"step": 2}
        assert any(p.name.startswith(reaper.FREED_PREFIX) for p in root.iterdir())
    finally:
        release.set()
    assert reaper.wait_removed(10)
    assert not [p.name for p in root.iterdir() if p.name.startswith(reaper.FREED_PREFIX)]
    plane.stager.free(again)
    plane.close()
    assert reaper.wait_removed(10) and not root.exists()


def optimizer_state() -> dict:
    exp_avg = torch.arange(4.0)
    return {"state": {0: {"step": torch.tensor(3.0), "exp_avg": exp_avg}}, "param_groups": [{"lr": 0.1}]}


@pytest.mark.parametrize("name", ["shm", "disk", "cuda_ipc"])
def test_a_state_is_torch_saved_straight_into_the_transports_file(tmp_path: Path, name: str):
    plane = open_transport(name, f"run-state-{name}", tmp_path)
    try:
        ref = plane.stager.put_state("train-state-optimizer", optimizer_state(), owner="trainer")
        path = plane.reader.state_file(ref)
        assert path is not None and path.is_file() and ref.num_bytes == path.stat().st_size
        on_disk = torch.load(path, weights_only=True)  # the file is what torch.save writes
        for loaded in (on_disk, plane.reader.get_state(ref)):
            assert torch.equal(loaded["state"][0]["exp_avg"], torch.arange(4.0))
            assert loaded["param_groups"] == [{"lr": 0.1}]
        plane.stager.free(ref)
        assert not path.exists()
        with pytest.raises((KeyError, FileNotFoundError)):
            plane.reader.get_state(ref)
    finally:
        plane.close()


def test_the_in_process_transport_hands_a_state_over_unserialised(tmp_path: Path):
    plane = open_transport("inprocess", "run-state", tmp_path)
    state = optimizer_state()
    ref = plane.stager.put_state("train-state-optimizer", state, owner="trainer")
    assert plane.reader.get_state(ref) is state and plane.reader.state_file(ref) is None
    assert ref.num_bytes == 4 + 16  # the tensors' bytes
    plane.stager.free(ref)
    with pytest.raises(KeyError):
        plane.reader.get_state(ref)


def test_a_key_put_again_replaces_the_old_data(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    disk.stager.put_tensors("w", {"a": torch.zeros(2)}, owner="trainer")
    ref = disk.stager.put_tensors("w", {"b": torch.ones(2)}, owner="trainer")
    assert set(disk.reader.get_tensors(ref)) == {"b"}


def test_close_removes_the_runs_files(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    ref = disk.stager.put_tensors("w", {"a": torch.zeros(2)}, owner="trainer")
    disk.close()
    assert not (tmp_path / "transport").exists()
    with pytest.raises(KeyError):
        disk.reader.get_tensors(ref)


def test_bad_keys_and_a_missing_run_dir_are_errors(tmp_path: Path):
    disk = open_transport("disk", "run-1", tmp_path)
    for key in ("../escape", ".hidden", ""):
        with pytest.raises(ValueError, match="bad data key"):
            disk.stager.put_bytes(key, b"", owner="x")
    with pytest.raises(ValueError, match="needs the run directory"):
        open_transport("disk", "run-1")
    with pytest.raises(ValueError, match="unknown transport 'nccl'"):
        open_transport("nccl", "run-1", tmp_path)


# --- weights staged as flat buckets ------------------------------------------------------------


def bucketed() -> Buckets:
    return Buckets.of({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)})


def test_the_in_process_transport_hands_buckets_over_without_a_copy(tmp_path: Path):
    plane = open_transport("inprocess", "run-b", tmp_path)
    buckets = bucketed()
    ref = plane.stager.put_buckets("weights-v1", buckets, owner="trainer")
    assert plane.reader.get_buckets(ref) is buckets
    views = plane.reader.get_tensors(ref)
    assert views["w"].untyped_storage().data_ptr() == buckets.buffers[0].untyped_storage().data_ptr()
    assert torch.equal(views["w"], torch.arange(12.0).reshape(3, 4))
    plane.stager.free(ref)
    with pytest.raises(KeyError, match="weights-v1"):
        plane.reader.get_buckets(ref)


@pytest.mark.parametrize("name", ["shm", "disk", "cuda_ipc"])
def test_transports_without_device_buckets_store_the_bucketed_tensors_as_a_file(tmp_path: Path, name: str):
    """shm and disk write the tensors (views) into one safetensors file; cuda_ipc does the same
    for buckets that are not on a GPU."""
    plane = open_transport(name, f"run-{name}", tmp_path)
    ref = plane.stager.put_buckets("weights-v1", bucketed(), owner="trainer")
    assert plane.reader.get_buckets(ref) is None and plane.reader.tensors_file(ref) is not None
    loaded = plane.reader.get_tensors(ref)
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4)) and loaded["b"].dtype == torch.bfloat16
    plane.close()


CHILD = """
import sys, torch
from miles_events.device.buckets import fingerprint_buckets
from miles_events.transport.cuda_ipc import CudaIpcTransport
from schemas.data import DataRef
plane = CudaIpcTransport(sys.argv[1])
buckets = plane.reader.get_buckets(DataRef("cuda_ipc", "weights-v1", "trainer"))
print(sorted(fingerprint_buckets(buckets).items()))
buckets.buffers[0].add_(1)  # the producer's memory, not a copy
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_shares_gpu_buckets_with_another_process_without_a_copy(tmp_path: Path):
    from miles_events.device.buckets import fingerprint_buckets

    plane = open_transport("cuda_ipc", "run-ipc", tmp_path)
    buckets = bucketed().to("cuda")
    ref = plane.stager.put_buckets("weights-v1", buckets, owner="trainer")
    assert ref.transport == "cuda_ipc" and plane.reader.get_buckets(ref) is buckets  # the producer's own
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "run-ipc"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(sorted(fingerprint_buckets(bucketed()).items()))
    assert torch.equal(buckets.tensors()["w"].cpu(), torch.arange(12.0).reshape(3, 4) + 1)
    plane.stager.free(ref)
    assert plane.reader.get_buckets(ref) is None
    plane.close()


READER = """
import sys, torch
from miles_events.device.buckets import fingerprint_buckets
from miles_events.transport.cuda_ipc import CudaIpcTransport
from schemas.data import DataRef
opened = []  # every handle this process maps (torch's own mapping call, counted)
new_shared_cuda = torch.UntypedStorage._new_shared_cuda
torch.UntypedStorage._new_shared_cuda = lambda *a, **k: opened.append(a) or new_shared_cuda(*a, **k)
plane = CudaIpcTransport(sys.argv[1])
for key in sys.stdin:
    buckets = plane.reader.get_buckets(DataRef("cuda_ipc", key.strip(), "trainer"))
    print(len(opened), sorted(fingerprint_buckets(buckets).items()), flush=True)
    del buckets  # as an engine does once loaded: the transport keeps the mapping
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_readers", [1, 2])
def test_a_reader_keeps_the_buffers_it_mapped_and_reads_what_was_staged_into_them_later(
    tmp_path: Path, num_readers: int
):
    """Engines on one GPU (each a process) read each publication: twice staged into the same
    buffers, then into new ones once the old are freed (the allocator may hand out their
    memory again, under the handle a reader has mapped)."""
    from miles_events.device.buckets import fingerprint_buckets

    plane = open_transport("cuda_ipc", "run-ipc-reuse", tmp_path)
    buckets = bucketed().to("cuda")
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-c", READER, "run-ipc-reuse"]
    readers = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
        for _ in range(num_readers)
    ]
    seen: list[list[int]] = [[] for _ in readers]
    records = []
    for version in (1, 2, 3):
        if version == 2:
            buckets.buffers[0].mul_(3)  # staged again into the same buffers, once the readers were done
        if version == 3:
            del buckets  # freed: new buffers, perhaps in the same memory
            buckets = bucketed().to("cuda")
            buckets.buffers[0].add_(5)
        ref = plane.stager.put_buckets(f"weights-v{version}", buckets, owner="trainer")
        records.append(plane.files.path(ref.key + ".cuda-ipc").read_bytes())
        for reader in readers:
            assert reader.stdin is not None
            reader.stdin.write(ref.key + "\n")
            reader.stdin.flush()
        for reader, opened in zip(readers, seen, strict=True):
            assert reader.stdout is not None
            count, fingerprints = reader.stdout.readline().split(" ", 1)
            assert fingerprints.strip() == str(sorted(fingerprint_buckets(buckets).items())), version
            opened.append(int(count))
        plane.stager.free(ref)
    for reader in readers:
        assert reader.stdin is not None
        reader.stdin.close()
        assert reader.wait(60) == 0
    assert all(opened[:2] == [2, 2] for opened in seen)  # each bucket's handle mapped once, by the first read
    assert records[0] == records[1]  # the same buffers, shared once
    plane.close()


WAITING_READER = """
import sys, torch
from miles_events.device.buckets import fingerprint_buckets
from miles_events.transport.cuda_ipc import CudaIpcTransport
from schemas.data import DataRef
plane = CudaIpcTransport(sys.argv[1])
torch.zeros(1, device="cuda")  # CUDA up before the producer stages
print("ready", flush=True)
for key in sys.stdin:
    buckets = plane.reader.get_buckets(DataRef("cuda_ipc", key.strip(), "trainer"))
    print(sorted(fingerprint_buckets(buckets).items()), flush=True)
"""


def started_reader(script: str, run_id: str) -> subprocess.Popen[str]:
    """``script`` run as a reader process of run ``run_id`` (lines in, lines out), once it
    says it is ready."""
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    reader = subprocess.Popen(
        [sys.executable, "-c", script, run_id],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env,
    )  # fmt: skip
    assert reader.stdin is not None and reader.stdout is not None
    assert reader.stdout.readline().strip() == "ready"
    return reader


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_ipc_reader_waits_on_the_gpu_for_a_staging_the_producer_did_not_wait_for(tmp_path: Path):
    """``put_buckets`` returns with the staging still queued (no host sync); a reader in
    another process that reads at once sees the staged values: its stream waits for the
    producer's event. So again for a publication staged into the same buffers (the same
    record, the event recorded again)."""

    from miles_events.device.buckets import fingerprint_buckets

    plane = open_transport("cuda_ipc", "run-ipc-ready", tmp_path)
    buckets = bucketed().to("cuda")
    reader = started_reader(WAITING_READER, "run-ipc-ready")
    expected = bucketed()
    records = []
    for version, factor in ((1, 3), (2, 5)):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the staging runs
        buckets.buffers[0].mul_(factor)
        expected.buffers[0].mul_(factor)
        ref = plane.stager.put_buckets(f"weights-v{version}", buckets, owner="trainer")
        assert not torch.cuda.current_stream().query()  # the staging is still queued
        records.append(plane.files.path(ref.key + ".cuda-ipc").read_bytes())
        reader.stdin.write(ref.key + "\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == str(sorted(fingerprint_buckets(expected).items())), version
        plane.stager.free(ref)
    assert records[0] == records[1]
    reader.stdin.close()
    assert reader.wait(60) == 0
    plane.close()


def test_a_cuda_ipc_reader_maps_a_buffer_once_and_reads_a_record_seen_before_without_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The reader's bookkeeping, on the CPU: torch's mapping of a handle is stood in for by a
    CPU tensor (the GPU test above maps for real)."""
    import msgspec

    from miles_events.device.buckets import plan_layouts
    from miles_events.transport import cuda_ipc
    from schemas.data import CudaIpcBuffer, CudaIpcRecord, DataRef

    mapped, released = [], []
    monkeypatch.setattr(
        cuda_ipc,
        "open_shared",
        lambda shared: mapped.append(shared.handle) or torch.zeros(shared.layout.numel),
    )
    monkeypatch.setattr(
        cuda_ipc, "_release_counter", lambda shared: released.append(shared.ref_counter_offset)
    )
    (layout,) = plan_layouts({"w": torch.zeros(3, 4)})
    plane = cuda_ipc.CudaIpcTransport("run-ipc-reader", tmp_path)

    def record(key: str, counter: int) -> DataRef:
        shared = CudaIpcBuffer(layout, 0, b"handle", 1 << 20, 0, 0, b"counter", counter, None, False)
        data = msgspec.msgpack.encode(CudaIpcRecord((shared,)))
        plane.files.publish(key + cuda_ipc.RECORD_SUFFIX, lambda p: p.write_bytes(data))
        return DataRef("cuda_ipc", key, "trainer")

    first = plane.reader.get_buckets(record("weights-v1", counter=0))
    again = plane.reader.get_buckets(record("weights-v2", counter=0))  # the same buffers, shared once
    assert again is first and mapped == [b"handle"] and released == []
    later = plane.reader.get_buckets(record("weights-v3", counter=8))  # shared anew: released at once
    assert later is not None and later.buffers[0] is first.buffers[0]
    assert mapped == [b"handle"] and released == [8]
    plane.close()


def test_a_cuda_ipc_producer_names_buffers_shared_before_by_a_link_to_their_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The producer's side, on the CPU: a publication of buffers shared before is a link to
    the record written for them, the same bytes; a key put again is replaced; records of
    buffers no longer among the last shared are removed, and nothing is left after
    ``close``."""
    from miles_events.transport import cuda_ipc

    plane, staged = _cuda_ipc_producer(tmp_path, monkeypatch, "run-ipc-producer")

    def record(key: str) -> Path:
        return plane.files.path(key + cuda_ipc.RECORD_SUFFIX)

    first = staged(16)
    plane.stager.put_buckets("weights-v1", first, owner="trainer")
    plane.stager.put_buckets("weights-v2", first, owner="trainer")
    assert record("weights-v1").read_bytes() == record("weights-v2").read_bytes()
    assert record("weights-v1").stat().st_ino == record("weights-v2").stat().st_ino  # one file, linked
    assert record("weights-v2").stat().st_mode & 0o077 == 0
    plane.stager.put_buckets("weights-v2", staged(32), owner="trainer")  # put again: the new buffers
    assert record("weights-v2").read_bytes() != record("weights-v1").read_bytes()
    hidden = lambda: sorted(p.name for p in plane.root.iterdir() if p.name.startswith("."))  # noqa: E731
    assert len(hidden()) == 2
    later = [staged(n) for n in (48, 64)]
    for version, buckets in enumerate(later, start=3):
        plane.stager.put_buckets(f"weights-v{version}", buckets, owner="trainer")
    assert len(hidden()) == cuda_ipc.OPEN_RECORDS  # the first two buffers' records dropped
    assert record("weights-v1").exists()  # a publication's own record stays until it is freed
    plane.close()
    assert not plane.root.exists()


def _cuda_ipc_producer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_id: str):
    """A cuda_ipc transport whose share of a CUDA buffer and ready event are stood in for
    (the GPU tests share for real), and a maker of staged buckets of ``numel`` floats."""
    from types import SimpleNamespace

    from miles_events.device.buckets import plan_layouts
    from miles_events.transport import cuda_ipc
    from schemas.data import CudaIpcBuffer

    monkeypatch.setattr(cuda_ipc.CudaIpcStager, "_record_ready", lambda self, device: b"event")
    monkeypatch.setattr(
        cuda_ipc,
        "share",
        lambda buffer, layout: CudaIpcBuffer(
            layout, 0, bytes([buffer.numel()]), 1 << 20, 0, 0, b"c", 0, None, False
        ),
    )
    (layout,) = plan_layouts({"w": torch.zeros(3, 4)})

    def staged(numel: int) -> SimpleNamespace:
        return SimpleNamespace(
            device=torch.device("cuda", 0),
            layouts=(layout,),
            buffers=(torch.zeros(numel),),
            num_bytes=4 * numel,
        )

    return cuda_ipc.CudaIpcTransport(run_id, tmp_path), staged


def test_a_cuda_ipc_key_put_again_with_the_same_buffers_keeps_one_record_and_no_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The same key put three times with the same buffers (a retried publication): its
    record is the one written for those buffers, and no half-published file is left."""
    from miles_events.transport import cuda_ipc

    plane, staged = _cuda_ipc_producer(tmp_path, monkeypatch, "run-ipc-same-key")
    buckets = staged(16)
    for _ in range(3):
        plane.stager.put_buckets("weights-v1", buckets, owner="trainer")
    assert not [p.name for p in plane.root.iterdir() if p.name.endswith(".partial")]
    assert len([p for p in plane.root.iterdir() if p.name.startswith(".record-")]) == 1
    assert plane.files.path("weights-v1" + cuda_ipc.RECORD_SUFFIX).read_bytes()
    plane.close()


def test_a_cuda_ipc_producer_never_rewrites_a_record_file_it_did_not_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Records are created, never opened for writing again: a file of the same hidden name
    (another producer's, linked under its keys) keeps its bytes, and the new record takes
    another name."""
    from miles_events.transport import cuda_ipc

    plane, staged = _cuda_ipc_producer(tmp_path, monkeypatch, "run-ipc-exclusive")
    names = iter(["taken", "free"])
    monkeypatch.setattr(cuda_ipc, "_record_name", lambda: f".record-{next(names)}{cuda_ipc.RECORD_SUFFIX}")
    plane.root.mkdir(parents=True, exist_ok=True)
    other = plane.root / f".record-taken{cuda_ipc.RECORD_SUFFIX}"
    other.write_bytes(b"another producer's record")
    plane.stager.put_buckets("weights-v1", staged(16), owner="trainer")
    assert other.read_bytes() == b"another producer's record"
    assert plane.files.path("weights-v1" + cuda_ipc.RECORD_SUFFIX).samefile(
        plane.root / f".record-free{cuda_ipc.RECORD_SUFFIX}"
    )
    plane.close()


def test_a_cuda_ipc_record_removed_under_the_producer_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The record of buffers shared before, gone from the directory (removed by hand, or by
    a cleaner of the run's directory): the next publication of those buffers writes it
    again instead of failing for ever."""
    from miles_events.transport import cuda_ipc

    plane, staged = _cuda_ipc_producer(tmp_path, monkeypatch, "run-ipc-rewrite")
    buckets = staged(16)
    plane.stager.put_buckets("weights-v1", buckets, owner="trainer")
    first = plane.files.path("weights-v1" + cuda_ipc.RECORD_SUFFIX).read_bytes()
    for hidden in plane.root.glob(".record-*"):
        hidden.unlink()
    plane.stager.put_buckets("weights-v2", buckets, owner="trainer")
    assert plane.files.path("weights-v2" + cuda_ipc.RECORD_SUFFIX).read_bytes() == first
    plane.close()


def test_a_cuda_ipc_producer_on_a_filesystem_without_hard_links_writes_each_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Where the run's directory refuses hard links, each publication's record is written
    as a file of its own, with the same bytes."""
    from miles_events.transport import cuda_ipc

    plane, staged = _cuda_ipc_producer(tmp_path, monkeypatch, "run-ipc-no-links")

    link = os.link

    def refuse(src: Any, dst: Any, **kwargs: Any) -> None:
        if Path(dst).parent == plane.root:
            raise PermissionError(1, "Operation not permitted")
        link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", refuse)
    buckets = staged(16)
    plane.stager.put_buckets("weights-v1", buckets, owner="trainer")
    plane.stager.put_buckets("weights-v2", buckets, owner="trainer")
    plane.stager.put_buckets("weights-v2", buckets, owner="trainer")
    v1, v2 = (plane.files.path(f"weights-v{n}" + cuda_ipc.RECORD_SUFFIX) for n in (1, 2))
    assert v1.read_bytes() == v2.read_bytes() and v2.stat().st_mode & 0o077 == 0
    assert not [p.name for p in plane.root.iterdir() if p.name.endswith(".partial")]
    plane.close()


def test_a_cuda_ipc_reader_waits_for_the_producers_ready_event_at_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The reader's side of the ready event, on the CPU: the event a record names is opened
    once and waited for at each read of it, a record seen before included; a record without
    one (written after its buffers were) is waited for by nothing."""
    import msgspec

    from miles_events.device.buckets import plan_layouts
    from miles_events.transport import cuda_ipc
    from schemas.data import CudaIpcBuffer, CudaIpcRecord, DataRef

    opened, waited = [], []
    monkeypatch.setattr(cuda_ipc, "open_shared", lambda shared: torch.zeros(shared.layout.numel))
    monkeypatch.setattr(
        cuda_ipc.CudaIpcReader, "_open_event", lambda self, handle, device: opened.append(handle) or handle
    )
    monkeypatch.setattr(
        cuda_ipc.CudaIpcReader, "_wait_ready", staticmethod(lambda event, device: waited.append(event))
    )
    (layout,) = plan_layouts({"w": torch.zeros(3, 4)})
    plane = cuda_ipc.CudaIpcTransport("run-ipc-ready-cpu", tmp_path)

    def record(key: str, ready_event: bytes | None) -> DataRef:
        shared = CudaIpcBuffer(layout, 0, b"handle", 1 << 20, 0, 0, b"counter", 0, None, False)
        data = msgspec.msgpack.encode(CudaIpcRecord((shared,), ready_event=ready_event))
        plane.files.publish(key + cuda_ipc.RECORD_SUFFIX, lambda p: p.write_bytes(data))
        return DataRef("cuda_ipc", key, "trainer")

    plane.reader.get_buckets(record("weights-v1", b"event"))
    plane.reader.get_buckets(record("weights-v2", b"event"))  # the same record: not decoded again
    assert opened == [b"event"] and waited == [b"event", b"event"]
    plane.reader.get_buckets(record("weights-v3", None))
    assert waited == [b"event", b"event"]
    plane.close()


def test_a_cuda_ipc_reader_done_reading_leaves_the_producer_a_receipt_of_its_read_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The receipts, on the CPU: a reader done with a key it read from another process
    records its read event on its stream (no host sync) and links a receipt naming it
    beside the key's record; the producer opens the event of each receipt once
    (``reads_of``), and freeing the key removes them. A key not read from another process
    is waited for on the host, as every transport does."""
    import types

    import msgspec

    from miles_events.device.buckets import plan_layouts
    from miles_events.transport import cuda_ipc
    from schemas.data import CudaIpcBuffer, CudaIpcRecord, DataRef

    recorded, synced, opened = [], [], []
    stream = types.SimpleNamespace(synchronize=lambda: synced.append(True))
    event = types.SimpleNamespace(record=recorded.append)
    monkeypatch.setattr(cuda_ipc, "open_shared", lambda shared: torch.zeros(shared.layout.numel))
    monkeypatch.setattr(cuda_ipc.InterprocessEvents, "get", lambda self, device: (event, b"read-handle"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(
        torch.cuda.Event, "from_ipc_handle", lambda device, handle: opened.append(handle) or handle
    )
    (layout,) = plan_layouts({"w": torch.zeros(3, 4)})
    reader = cuda_ipc.CudaIpcTransport("run-ipc-receipts", tmp_path)
    shared = CudaIpcBuffer(layout, 0, b"handle", 1 << 20, 0, 0, b"counter", 0, None, False)
    data = msgspec.msgpack.encode(CudaIpcRecord((shared,)))
    reader.files.publish("weights-v1" + cuda_ipc.RECORD_SUFFIX, lambda p: p.write_bytes(data))
    ref = DataRef("cuda_ipc", "weights-v1", "trainer")
    gpu = torch.device("cuda", 0)

    assert reader.reader.get_buckets(ref) is not None
    reader.reader.done_reading(ref, gpu)
    assert recorded == [stream] and not synced
    receipts = [p for p in reader.root.iterdir() if ".read-" in p.name]
    assert [p.name for p in receipts] == [f"weights-v1.cuda-ipc.read-{os.getpid()}-0"]
    assert receipts[0].read_bytes() == b"read-handle" and receipts[0].stat().st_mode & 0o077 == 0

    reader.reader.done_reading(
        DataRef("cuda_ipc", "weights-v9", "trainer"), gpu
    )  # never read from another process
    assert recorded == [stream] and synced == [True]

    producer = cuda_ipc.CudaIpcTransport("run-ipc-receipts", tmp_path)
    producer.stager._held["weights-v1"] = types.SimpleNamespace(device=gpu)  # as put_buckets keeps it
    assert producer.stager.reads_of(ref) == producer.stager.reads_of(ref) == (b"read-handle",)
    assert opened == [b"read-handle"]  # opened once

    # A receipt whose event cannot be opened: nobody can say whether its copies ran.
    (producer.root / "weights-v1.cuda-ipc.read-99-0").write_bytes(b"stale-handle")

    def from_ipc_handle(device: torch.device, handle: bytes) -> bytes:
        if handle == b"stale-handle":
            raise RuntimeError("CUDA error: invalid resource handle")
        return handle

    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", from_ipc_handle)
    unknown, known = sorted(producer.stager.reads_of(ref), key=lambda read: isinstance(read, bytes))
    assert isinstance(unknown, cuda_ipc.UnknownRead) and known == b"read-handle"
    with pytest.raises(RuntimeError, match="could not be opened"):
        unknown.query()

    # A receipt linked after its key was freed goes with the next key freed.
    (producer.root / "weights-v0.cuda-ipc.read-98-0").write_bytes(b"late")
    producer.stager.free(ref)
    assert not [p for p in producer.root.iterdir() if ".read-" in p.name]
    assert producer.stager.reads_of(ref) == ()
    producer.close()


LATE_READER = """
import sys, torch
from miles_events.device.buckets import fingerprint_buckets
from miles_events.transport.cuda_ipc import CudaIpcTransport
from schemas.data import DataRef
plane = CudaIpcTransport(sys.argv[1])
torch.zeros(1, device="cuda")
print("ready", flush=True)
for key in sys.stdin:
    ref = DataRef("cuda_ipc", key.strip(), "trainer")
    staged = plane.reader.get_buckets(ref)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the copy runs
    own = [buffer.clone() for buffer in staged.buffers]
    plane.reader.done_reading(ref, torch.device("cuda", 0))
    print("queued", flush=True)  # answered with the copy still queued
    print(sorted(fingerprint_buckets(type(staged)(staged.layouts, tuple(own))).items()), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_staging_buffer_is_taken_again_only_once_the_readers_copies_have_run(tmp_path: Path):
    """A reader in another process says it is done with its copy still queued; the
    producer's pool, given the buffers back with the reader's read events, takes new ones
    while that copy has not run, and the same ones once it has. The reader copied what was
    staged."""

    from miles_events.device.buckets import fingerprint_buckets
    from miles_events.device.staging import StagingPool

    plane = open_transport("cuda_ipc", "run-ipc-reads", tmp_path)
    pool = StagingPool()
    layouts = bucketed().layouts
    buckets = pool.take(layouts, "cuda")
    buckets.copy_from(bucketed().to("cuda"))
    reader = started_reader(LATE_READER, "run-ipc-reads")
    expected = str(sorted(fingerprint_buckets(bucketed()).items()))
    pool.lend("weights-v1", buckets)
    ref = plane.stager.put_buckets("weights-v1", buckets, owner="trainer")
    reader.stdin.write(ref.key + "\n")
    reader.stdin.flush()
    assert reader.stdout.readline().strip() == "queued"
    reads = plane.stager.reads_of(ref)
    assert len(reads) == 1 and not reads[0].query()  # the reader's copy is still to run
    pool.give_back(ref.key, reads)
    plane.stager.free(ref)
    other = pool.take(layouts, "cuda")
    assert other is not buckets and pool.num_allocated == 2
    assert reader.stdout.readline().strip() == expected  # the reader waited for its copy
    assert reads[0].query() and pool.take(layouts, "cuda") is buckets
    reader.stdin.close()
    assert reader.wait(60) == 0
    plane.close()
