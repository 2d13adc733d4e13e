"""The collective transport over gloo, for real: a channel per reader, buckets cut into
pieces of at most ``bucket_bytes`` that land where the reader places them, a reader in
another process, timeouts that fail the load and a channel formed anew after them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from miles_events.device.buckets import Buckets
from miles_events.transport import collective
from miles_events.transport.base import open_transport
from miles_events.transport.collective import (
    CollectiveError,
    CollectiveSettings,
    CollectiveTransport,
    plan_chunks,
)
from schemas.config import Config, PublisherConfig

REPO = Path(__file__).resolve().parents[1]


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 16, generator=generator),
        "layer.norm": torch.randn(16, generator=generator).to(torch.bfloat16),
        "layer.proj.weight": torch.randn(16, 24, generator=generator),
        "canary": torch.arange(64, dtype=torch.uint8),
    }


def transport(tmp_path: Path, name: str, **settings: object) -> CollectiveTransport:
    plane = CollectiveTransport(name, tmp_path, CollectiveSettings(**{"timeout": 10.0, **settings}))  # type: ignore[arg-type]
    return plane


def test_the_config_opens_it_with_the_publishers_bucket_size_and_timeout(tmp_path: Path):
    config = Config(
        publisher=PublisherConfig(transport="collective", bucket_bytes=4096, broadcast_timeout=7.5)
    )
    plane = open_transport("collective", "run-open", tmp_path, config)
    try:
        assert isinstance(plane, CollectiveTransport)
        assert (
            plane.stager.settings
            == plane.reader.settings
            == plane.reader.channels.settings
            == CollectiveSettings(4096, 7.5, None)
        )
    finally:
        plane.close()


def test_buckets_arrive_whole_in_pieces_of_at_most_bucket_bytes_over_one_channel(tmp_path: Path):
    plane = transport(tmp_path, "run-pieces", bucket_bytes=1000)
    try:
        staged = Buckets.of(weights())
        ref = plane.stager.publish_buckets("weights-v1", staged, owner="trainer")
        assert ref.transport == "collective" and ref.address.rsplit(":", 1)[1].isdigit()
        assert ref.num_bytes == staged.tensor_bytes
        stream = plane.reader.stream_buckets(ref, reader="engine-0")
        assert stream is not None and stream.layouts == staged.layouts
        landed: list[tuple[int, int, int]] = []
        targets = [torch.zeros_like(buffer).view(torch.uint8) for buffer in staged.buffers]

        def into(bucket: int, start: int, end: int) -> torch.Tensor:
            landed.append((bucket, start, end))
            return targets[bucket][start:end]

        stream.receive(into)
        assert all(end - start <= 1000 for _, start, end in landed)
        assert len(landed) > len(staged.buffers)  # the float32 bucket came in several pieces
        assert landed == [(c.bucket, c.start, c.end) for c in plan_chunks(staged.layouts, 1000)]
        for target, buffer in zip(targets, staged.buffers, strict=True):
            assert torch.equal(target, buffer.view(torch.uint8))
        # A later publication goes over the same channel.
        ref2 = plane.stager.publish_buckets("weights-v2", Buckets.of(weights()), owner="trainer")
        got = plane.reader.stream_buckets(ref2, reader="engine-0")
        assert got is not None
        assert torch.equal(got.assemble().tensors()["embed.weight"], weights()["embed.weight"])
        assert list(plane.stager._server.channels) == ["engine-0"]  # type: ignore[union-attr]
    finally:
        plane.close()


def test_tensors_read_by_name_and_the_rest_of_the_data_goes_through_shared_memory(tmp_path: Path):
    plane = transport(tmp_path, "run-rest")
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        got = plane.reader.get_tensors(ref)
        assert {name: t.dtype for name, t in got.items()} == {n: t.dtype for n, t in weights().items()}
        assert all(torch.equal(got[name], tensor) for name, tensor in weights().items())
        assert plane.reader.tensors_file(ref) is None  # nothing on disk to copy
        batch = plane.stager.put_bytes("rollout-0", b"batch", owner="generator")
        assert batch.address == "" and plane.reader.get_bytes(batch) == b"batch"
        saved = plane.stager.put_tensors("state-1", {"w": torch.ones(3)}, owner="trainer")
        assert plane.reader.tensors_file(saved) == plane.root / "state-1"
        # Buckets put rather than published (a save's weights) are files too, for the Saver.
        put = plane.stager.put_buckets("save-1-weights", Buckets.of(weights()), owner="trainer")
        assert put.address == "" and plane.reader.tensors_file(put) == plane.root / "save-1-weights"
        assert torch.equal(plane.reader.get_tensors(put)["embed.weight"], weights()["embed.weight"])
    finally:
        plane.close()


def test_freed_weights_fail_the_read_with_one_line_and_the_channel_goes_on(tmp_path: Path):
    plane = transport(tmp_path, "run-freed")
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        plane.stager.free(ref)
        with pytest.raises(CollectiveError, match="weights-v1 is not staged here") as raised:
            plane.reader.get_buckets(ref)
        assert "\n" not in str(raised.value)
        again = plane.stager.publish_buckets("weights-v2", Buckets.of(weights()), owner="trainer")
        assert plane.reader.get_buckets(again) is not None
    finally:
        plane.close()


def test_a_broadcast_that_times_out_fails_the_load_and_the_next_load_forms_a_new_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    plane = transport(tmp_path, "run-timeout", timeout=1.0)
    send = collective.ChannelServer._send
    stalled = []

    def stall_once(self, group, channel, ask, client):  # type: ignore[no-untyped-def]
        if not stalled:
            stalled.append(ask.key)
            time.sleep(2.5)  # the sender hangs past the timeout
            return
        send(self, group, channel, ask, client)

    monkeypatch.setattr(collective.ChannelServer, "_send", stall_once)
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        started = time.monotonic()
        with pytest.raises(CollectiveError, match="channel engine-0: weights-v1: header") as raised:
            plane.reader.stream_buckets(ref, reader="engine-0")
        assert time.monotonic() - started < 5 and "\n" not in str(raised.value)
        time.sleep(2)
        got = plane.reader.get_tensors(ref)  # a new channel: the default reader name's
        assert torch.equal(got["layer.norm"], weights()["layer.norm"])
        stream = plane.reader.stream_buckets(ref, reader="engine-0")  # engine-0's, formed anew
        assert stream is not None
        assert torch.equal(stream.assemble().tensors()["canary"], weights()["canary"])
    finally:
        plane.close()


def test_a_publisher_that_stalls_mid_stream_fails_the_load_at_that_chunk_and_the_next_load_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    plane = transport(tmp_path, "run-mid", bucket_bytes=1000, timeout=1.0)
    broadcast = collective._broadcast
    sent: list[str] = []

    def stall_at_chunk_3_once(group, tensor, timeout, what):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("collective-") and what.endswith("chunk 3/7"):
            sent.append(what)
            if len(sent) == 1:
                time.sleep(2.5)  # past the reader's timeout, two chunks in
                raise collective.CollectiveError(f"{what}: stalled")
        broadcast(group, tensor, timeout, what)

    monkeypatch.setattr(collective, "_broadcast", stall_at_chunk_3_once)
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        stream = plane.reader.stream_buckets(ref, reader="engine-0")
        assert stream is not None and len(plan_chunks(stream.layouts, 1000)) == 7
        with pytest.raises(CollectiveError, match="channel engine-0: weights-v1: chunk 3/7") as raised:
            stream.assemble()
        assert "\n" not in str(raised.value)
        again = plane.reader.stream_buckets(ref, reader="engine-0")  # a new channel
        assert again is not None
        assert torch.equal(again.assemble().tensors()["layer.proj.weight"], weights()["layer.proj.weight"])
    finally:
        plane.close()


def test_a_stream_given_up_before_it_is_received_leaves_the_next_load_free(tmp_path: Path):
    plane = transport(tmp_path, "run-abandon", bucket_bytes=1000, timeout=30.0)
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        stream = plane.reader.stream_buckets(ref, reader="engine-0")
        assert stream is not None
        stream.close()  # as an engine whose placement failed does
        started = time.monotonic()
        again = plane.reader.stream_buckets(ref, reader="engine-0")
        assert again is not None
        assert torch.equal(again.assemble().tensors()["canary"], weights()["canary"])
        assert time.monotonic() - started < 10  # no wait for the timeout
    finally:
        plane.close()


def test_a_reader_that_died_before_saying_who_it_is_holds_up_only_the_next_join(tmp_path: Path):
    plane = transport(tmp_path, "run-orphan", timeout=1.0)
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        orphan = collective.connect(ref.address, 5.0)
        orphan.add("channels", 1)  # took a number, then died before its hello
        with pytest.raises(CollectiveError, match="channel engine-0 to .* not formed"):
            plane.reader.stream_buckets(ref, reader="engine-0")
        stream = plane.reader.stream_buckets(ref, reader="engine-0")  # the number was given up
        assert stream is not None
        assert torch.equal(stream.assemble().tensors()["embed.weight"], weights()["embed.weight"])
    finally:
        plane.close()


def test_an_engine_that_joins_again_under_its_name_replaces_its_channel(tmp_path: Path):
    plane = transport(tmp_path, "run-restart")
    dead = transport(tmp_path, "run-restart")  # an engine's process that dies mid-load
    other = transport(tmp_path, "run-restart")  # the process of the engine restarted in its place
    try:
        ref = plane.stager.publish_buckets("weights-v1", Buckets.of(weights()), owner="trainer")
        assert dead.reader.stream_buckets(ref, reader="engine-1") is not None  # never received
        server = plane.stager._server
        assert server is not None
        first = server.channels["engine-1"]
        stream = other.reader.stream_buckets(ref, reader="engine-1")  # the restarted engine's first load
        assert stream is not None and torch.equal(
            stream.assemble().tensors()["embed.weight"], weights()["embed.weight"]
        )
        assert server.channels["engine-1"] is not first and first.stopped
    finally:
        other.reader.close()
        plane.close()


READER = """
import sys, torch
from miles_events.transport.collective import CollectiveSettings, CollectiveTransport
from schemas.data import DataRef
plane = CollectiveTransport("run-proc-reader", None, CollectiveSettings(timeout=20.0))
ref = DataRef("collective", sys.argv[1], "trainer", 0, address=sys.argv[2])
tensors = plane.reader.get_tensors(ref)
print(sorted((name, round(float(t.float().sum()), 3)) for name, t in tensors.items()))
plane.close()
"""


def test_a_reader_in_another_process_receives_the_weights(tmp_path: Path):
    plane = transport(tmp_path, "run-proc")
    try:
        staged = weights()
        ref = plane.stager.publish_buckets("weights-v3", Buckets.of(staged), owner="trainer")
        result = subprocess.run(
            [sys.executable, "-c", READER, ref.key, ref.address],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        expected = sorted((name, round(float(t.float().sum()), 3)) for name, t in staged.items())
        assert result.stdout.strip() == str(expected)
    finally:
        plane.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reader_device", ["cuda", "cpu"])
def test_on_a_gpu_staged_buckets_reach_a_reader_on_that_gpu_or_the_host_over_gloo(
    tmp_path: Path, reader_device: str
):
    """A reader on the publisher's own GPU (a colocated engine: NCCL cannot join two ranks on
    one GPU) or on the host gets gloo, each chunk through the host."""
    plane = transport(tmp_path, f"run-gpu-{reader_device}", bucket_bytes=1000)
    try:
        staged = Buckets.of(weights(), device="cuda")
        ref = plane.stager.publish_buckets("weights-v1", staged, owner="trainer")
        stream = plane.reader.stream_buckets(ref, reader="engine-0", device=torch.device(reader_device))
        assert stream is not None
        got = stream.assemble(reader_device).tensors()
        assert all(t.device.type == reader_device for t in got.values())
        assert all(torch.equal(got[name].cpu(), tensor) for name, tensor in weights().items())
        assert plane.stager._server.channels["engine-0"].backend == "gloo"  # type: ignore[union-attr]
    finally:
        plane.close()
