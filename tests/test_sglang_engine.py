"""``SglangEngine`` end to end against the contract server, in both server variants: every
body it sends is validated by SGLang's own classes there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from actors.engine import engine_class
from actors.engine import sglang_api as api
from actors.engine.base import SamplingParams
from actors.engine.server_process import ServerStartError
from actors.engine.sglang_engine import SglangEngine, SglangError
from miles_events.bus.cancel import Cancellation, Cancelled
from miles_events.transport.disk import DiskTransport
from schemas.config import Config, GeneratorConfig, ModelConfig, RunConfig, SglangConfig
from tests import sglang_validator
from tests.sglang_server import NEWER, VARIANTS, serve

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sglang_validator.available(), reason="sglang is not installed")


def config_for(url: str, *, newer: bool, **sglang) -> Config:
    return Config(
        generator=GeneratorConfig(engine="sglang"),
        sglang=SglangConfig(urls=[url], weight_update_session=newer, flush_cache_timeout=5, **sglang),
    )


@pytest.fixture(params=VARIANTS, ids=lambda v: v.name)
def setup(request, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"base weights")
    transport = DiskTransport("run", tmp_path)
    with serve(request.param, str(model)) as server:
        config = config_for(server.url, newer=request.param is NEWER)
        engine = engine_class("sglang").from_config(config, index=0, name="engine-0", transport=transport)
        yield engine, server, transport


def publish(transport: DiskTransport, tensors: dict[str, torch.Tensor], key: str):
    return transport.stager.put_tensors(key, tensors, owner="trainer")


def test_sglang_is_a_registered_engine_that_reads_the_served_version(setup):
    engine, server, _ = setup
    assert isinstance(engine, SglangEngine) and engine.weight_version == "default" and engine.ready()
    assert server.state.refused == []


def test_generate_returns_one_completion_per_prompt_with_logprobs_and_version(setup):
    engine, server, _ = setup
    sampling = SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=4, stop=("\n",))
    generator = torch.Generator().manual_seed(3)
    completions = engine.generate([[1, 2], [10], [3, 4, 5]], sampling, generator)
    assert [c.prompt_ids for c in completions] == [[1, 2], [10], [3, 4, 5]]
    for c in completions:
        assert len(c.response_ids) == len(c.response_logprobs) == 4 and c.finish_reason == "length"
        assert c.weight_version == "default"
    assert server.state.refused == []
    seeds = [
        sp["sampling_seed"]
        for _, path, body in server.state.requests
        if path == "/generate"
        for sp in body["sampling_params"]
    ]
    again = engine.generate([[1, 2], [10], [3, 4, 5]], sampling, torch.Generator().manual_seed(3))
    seeds_again = [
        sp["sampling_seed"]
        for _, path, body in server.state.requests
        if path == "/generate"
        for sp in body["sampling_params"]
    ][3:]
    assert seeds[:3] == seeds_again and [c.response_ids for c in again] == [
        c.response_ids for c in completions
    ]
    sent = [
        sp for _, path, body in server.state.requests if path == "/generate" for sp in body["sampling_params"]
    ]
    assert {sp["ignore_eos"] for sp in sent} == {False}
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, ignore_eos=True), generator)
    last = [body for _, path, body in server.state.requests if path == "/generate"][-1]
    assert [sp["ignore_eos"] for sp in last["sampling_params"]] == [True]


def test_generate_batches_by_max_batch_size_and_stops_at_a_cancellation(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    with serve(VARIANTS[0], str(model)) as server:
        config = config_for(server.url, newer=False)
        config.rollout.max_batch_size = 2
        engine = SglangEngine(server.url, name="e", config=config, transport=DiskTransport("r", tmp_path))
        engine.generate([[1]] * 5, SamplingParams(max_new_tokens=1))
        assert sum(1 for _, path, _ in server.state.requests if path == "/generate") == 3
        cancel = Cancellation()
        cancel.cancel("stop")
        with pytest.raises(Cancelled):
            engine.generate([[1]], SamplingParams(max_new_tokens=1), cancel=cancel)


def test_load_weights_pauses_flushes_loads_versions_and_continues(setup, tmp_path):
    engine, server, transport = setup
    server.state.busy_flushes = 2
    ref = publish(transport, {"w": torch.ones(2)}, "v1")
    assert engine.load_weights(ref, "1") == ref.num_bytes
    assert engine.weight_version == "1"
    paths = [path.split("?")[0] for _, path, _ in server.state.requests]
    start = paths.index("/pause_generation")
    expected = ["/pause_generation", "/flush_cache", "/flush_cache", "/flush_cache"]
    if server.state.variant is NEWER:
        expected += ["/begin_weight_update", "/update_weights_from_disk", "/end_weight_update"]
    else:
        expected += ["/update_weights_from_disk"]
    expected += ["/update_weight_version", "/continue_generation"]
    assert paths[start:] == expected
    bodies = {path: body for _, path, body in server.state.requests}
    assert bodies["/update_weights_from_disk"]["model_path"] == str(transport.reader.path(ref))
    assert bodies["/update_weight_version"] == {"new_version": "1", "abort_all_requests": False}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    assert server.state.refused == [] and server.state.paused is None
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0].weight_version == "1"


def test_a_failed_load_still_continues_generation_and_keeps_the_version(setup, tmp_path):
    engine, server, transport = setup
    ref = publish(transport, {"w": torch.ones(2)}, "v1")
    transport.stager.free(ref)
    with pytest.raises(SglangError, match="not a directory"):
        engine.load_weights(ref, "1")
    assert engine.weight_version == "default" and server.state.paused is None


def test_only_disk_handles_load(setup):
    engine, _, _ = setup
    from schemas.data import DataRef

    with pytest.raises(ValueError, match="from disk"):
        engine.load_weights(DataRef("shm", "k", "trainer"), "1")


def test_checksums_and_the_seeds_check_through_the_weights_checker(setup, tmp_path):
    engine, server, transport = setup
    base = engine.checksums(["visual"])
    assert base.success and base.ranks and "model.rotary_emb.inv_freq" not in base.ranks[0].checksums
    assert engine.weights_check("snapshot").success
    assert engine.weights_check("reset_tensors").success
    assert engine.checksums().per_engine_checksum != base.per_engine_checksum
    failed = engine.weights_check("compare")
    assert not failed.success and "check tensor equality failed" in failed.message
    # Loading the files the server started from again restores the snapshot.
    import shutil

    ref = publish(transport, {"w": torch.ones(1)}, "again")
    shutil.rmtree(transport.reader.path(ref))
    shutil.copytree(server.state.model_path, transport.reader.path(ref))
    engine.load_weights(ref, "1")
    passed = engine.weights_check("compare")
    assert passed.success and passed.weight_version == "1"
    assert engine.checksums(["visual"]).per_engine_checksum == base.per_engine_checksum
    assert not engine.weights_check("bogus").success  # type: ignore[arg-type]
    assert server.state.refused == []


def test_a_missing_url_is_one_line_naming_the_key(tmp_path):
    config = Config(
        generator=GeneratorConfig(engine="sglang", num_engines=2), sglang=SglangConfig(urls=["http://x"])
    )
    with pytest.raises(ValueError, match=r"sglang\.urls: engine-1 needs the URL"):
        SglangEngine.from_config(config, index=1, name="engine-1", transport=DiskTransport("r", tmp_path))


def test_an_unreachable_server_is_an_error_naming_the_url(tmp_path):
    config = config_for("http://127.0.0.1:9", newer=False, request_timeout=2)
    with pytest.raises(SglangError, match="127.0.0.1:9"):
        SglangEngine.from_config(config, index=0, name="engine-0", transport=DiskTransport("r", tmp_path))


def test_launch_args_come_from_the_config():
    config = Config(
        sglang=SglangConfig(tp_size=2, mem_fraction_static=0.6, extra_args=["--log-level", "warning"]),
    )
    config.model.path = "/m"
    args = SglangEngine.launch_args(config, port=15000, nccl_port=15001)
    assert (args.model_path, args.port, args.tp_size, args.mem_fraction_static, args.nccl_port) == (
        "/m",
        15000,
        2,
        0.6,
        15001,
    )
    assert args.random_seed == config.run.seed and args.extra_args == ("--log-level", "warning")


def fake_sglang_python(tmp_path: Path, body: str) -> Path:
    """A "python" for ``sglang.python``: given ``-m sglang.launch_server ARGS``, runs ``body``
    with ARGS (SGLang itself needs CUDA)."""
    script = tmp_path / "sglang-python"
    script.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m sglang.launch_server" ] || exit 64\nshift 2\n{body}\n')
    script.chmod(0o755)
    return script


def launch_config(tmp_path: Path, python: Path, **sglang) -> Config:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model.safetensors").write_bytes(b"base weights")
    return Config(
        run=RunConfig(dir=str(tmp_path / "run")),
        model=ModelConfig(path=str(model)),
        generator=GeneratorConfig(engine="sglang", num_engines=2),
        sglang=SglangConfig(python=str(python), flush_cache_timeout=5, **sglang),
    )


@pytest.mark.slow
def test_without_urls_each_engine_launches_its_server_and_ends_it_on_close(tmp_path):
    contract = f'cd "{REPO}" && exec "{sys.executable}" -m tests.sglang_launch "$@"'
    config = launch_config(tmp_path, fake_sglang_python(tmp_path, contract), startup_timeout=120)
    engines = [
        engine_class("sglang").from_config(
            config, index=i, name=f"engine-{i}", transport=DiskTransport("r", tmp_path)
        )
        for i in range(2)
    ]
    try:
        assert [e.weight_version for e in engines] == ["default", "default"] and all(
            e.ready() for e in engines
        )
        assert len({e.http.url for e in engines}) == 2, "a port each"
        [completion] = engines[1].generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert len(completion.response_ids) == 2
        log = (tmp_path / "run" / "sglang" / "engine-0.log").read_text()
        assert f"contract server for {tmp_path / 'model'}" in log, "SGLang's parser read the launch line"
    finally:
        groups = [e.server.process.pid for e in engines if e.server is not None]
        for engine in engines:
            engine.close()
    assert len(groups) == 2
    for pgid in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def test_a_server_that_exits_during_start_is_one_line_naming_its_log(tmp_path):
    python = fake_sglang_python(tmp_path, 'echo "RuntimeError: no CUDA GPUs are available" >&2; exit 1')
    config = launch_config(tmp_path, python, startup_timeout=60)
    with pytest.raises(ServerStartError) as error:
        engine_class("sglang").from_config(
            config, index=0, name="engine-0", transport=DiskTransport("r", tmp_path)
        )
    message = str(error.value)
    assert "\n" not in message and "no CUDA GPUs are available" in message
    assert str(tmp_path / "run" / "sglang" / "engine-0.log") in message


def test_engines_launched_from_one_process_take_their_own_gpus():
    from actors.engine.sglang_engine import first_gpu

    assert [first_gpu(i, 2, visible=4) for i in range(2)] == [None, 2], "two servers of TP 2 on four GPUs"
    assert first_gpu(1, 1, visible=1) is None, "a process that sees only its own GPU (a Ray rank)"


def test_offload_releases_and_resumes_memory_occupation_by_tag_once_the_server_is_idle(setup):
    engine, server, _ = setup
    engine.release_memory(["cuda_graph", "kv_cache", "weights"])
    paths = [path.split("?")[0] for _, path, _ in server.state.requests]
    assert paths[-2:] == ["/flush_cache", "/release_memory_occupation"]  # idle first, as SGLang needs
    bodies = {path: body for _, path, body in server.state.requests}
    assert bodies["/release_memory_occupation"] == {"tags": ["cuda_graph", "kv_cache", "weights"]}
    assert server.state.released == {"cuda_graph", "kv_cache", "weights"}
    engine.resume_memory(["weights"])  # the seed's onload_weights
    assert server.state.released == {"cuda_graph", "kv_cache"}
    engine.resume_memory(["kv_cache", "cuda_graph"])  # onload_kv
    assert server.state.released == set() and server.state.refused == []
    with pytest.raises(ValueError):
        engine.release_memory(["gpu"])


def test_a_launched_server_has_the_memory_saver_exactly_when_the_rollout_offloads():
    on = Config(model=ModelConfig(path="/m"), run=RunConfig(offload_rollout=True))
    assert SglangEngine.launch_args(on, port=1).enable_memory_saver
    assert not SglangEngine.launch_args(Config(model=ModelConfig(path="/m")), port=1).enable_memory_saver


def test_a_load_during_a_request_gives_its_completion_the_servers_version_spans(setup):
    """``rollout.partial`` on SGLang: a request paused (retract, in_place) for a load goes on
    with the new weights; the server's ``weight_versions`` spans name each token's version."""
    engine, _, _ = setup
    reply = {
        "text": "5 6 7",
        "output_ids": [5, 6, 7],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 3},
            "weight_version": "4",
            "weight_versions": [
                {"version": "3", "start": 0, "end": 1},
                {"version": "4", "start": 1, "end": 3},
            ],
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
        },
    }
    [parsed] = api.parse_generate_reply(json.dumps(reply).encode())
    completion = engine._completion([1, 2], parsed)
    assert completion.weight_version == "3" and completion.version_spans == [(0, "3"), (1, "4")]
    unchanged = dict(reply, meta_info={**reply["meta_info"], "weight_versions": None, "weight_version": "4"})
    [single] = api.parse_generate_reply(json.dumps(unchanged).encode())
    assert engine._completion([1, 2], single).version_spans == []


def test_each_sample_is_sent_with_its_own_seed_where_given(setup):
    engine, server, _ = setup
    engine.generate([[1, 2], [3]], SamplingParams(temperature=1.0, max_new_tokens=2), seeds=[11, 22])
    sent = [
        sp["sampling_seed"]
        for _, path, body in server.state.requests
        if path == "/generate"
        for sp in body["sampling_params"]
    ]
    assert sent == [11, 22] and server.state.refused == []


PUBLISHER = """
import sys, msgspec, torch
from miles_events.device.buckets import Buckets
from miles_events.transport.collective import CollectiveSettings, CollectiveTransport
from tests.test_sglang_engine import staged_weights
plane = CollectiveTransport("sglang-publisher", None, CollectiveSettings(timeout=30.0))
for line in sys.stdin:
    ref = plane.stager.publish_buckets(f"weights-v{line.strip()}", Buckets.of(staged_weights(int(line))), "trainer")
    print(msgspec.json.encode(ref).decode(), flush=True)
plane.close()
"""


def staged_weights(version: int) -> dict[str, torch.Tensor]:
    """A publication: the model's tensors (two dtypes) and the canary, which SGLang is not sent."""
    from miles_events.rl.canary import CANARY_TENSOR, publication_canary

    generator = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=generator),
        "lm_head.weight": torch.randn(64, 16, generator=generator).to(torch.bfloat16),
        CANARY_TENSOR: publication_canary("sglang", str(version)),
    }


def test_a_collective_publication_is_broadcast_tensor_by_tensor_to_the_servers_group(tmp_path):
    """The trainer's publishing rank (another process) and a server's rank form the group as
    SGLang's ``init_weights_update_group`` does; each publication is posted in buckets of at
    most ``publisher.bucket_bytes`` while every tensor comes in a broadcast of its own, as
    SGLang receives them."""
    from miles_events.rl.canary import CANARY_TENSOR
    from miles_events.transport.collective import CollectiveTransport
    from schemas.config import PublisherConfig
    from schemas.data import DataRef

    model = tmp_path / "model"
    model.mkdir()
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    plane = CollectiveTransport("sglang-engine", tmp_path)
    try:
        with serve(NEWER, str(model)) as server:
            server.state.receive_broadcasts = True
            config = config_for(server.url, newer=True)
            config.publisher = PublisherConfig(
                transport="collective", bucket_bytes=3000, broadcast_timeout=30.0
            )
            engine = SglangEngine(server.url, name="engine-0", config=config, transport=plane)
            assert publisher.stdin is not None and publisher.stdout is not None
            for version in (1, 2):
                publisher.stdin.write(f"{version}\n")
                publisher.stdin.flush()
                ref = msgspec.json.decode(publisher.stdout.readline(), type=DataRef)
                engine.load_weights(ref, str(version))
                expected = staged_weights(version)
                del expected[CANARY_TENSOR]
                assert set(server.state.received) == set(expected)
                assert all(torch.equal(server.state.received[n], t) for n, t in expected.items())
                assert engine.weight_version == str(version)
            paths = [path for _, path, _ in server.state.requests]
            assert paths.count(api.INIT_WEIGHTS_UPDATE_GROUP) == 1  # formed once, at the first load
            updates = [
                body for _, path, body in server.state.requests if path == api.UPDATE_WEIGHTS_FROM_DISTRIBUTED
            ]
            assert len(updates) == 4  # two buckets of at most 3000 bytes a publication
            assert [u.get("weight_version") for u in updates] == [None, "1", None, "2"]
            assert server.state.refused == []
    finally:
        if publisher.stdin is not None:
            publisher.stdin.close()
        publisher.wait(timeout=30)
        plane.close()
