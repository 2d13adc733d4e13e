"""The vllm engine against one real vLLM server on the project's built-in tiny model.

Slow (a server takes 30-60 s to start on CPU) and needs ``.venv-vllm`` (``bash
.ci/setup-vllm``); without it every test here skips, saying so, and with ``CI`` set it
fails instead (``.ci/run`` creates it). One server is shared by the module; the
failure-path tests start (and must end) their own.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import torch

from actors.engine.base import SamplingParams
from actors.engine.server_process import ServerStartError
from actors.engine.vllm_engine import VllmEngine, launch_server
from actors.engine.worker import EngineWorker, UnverifiableTensors
from miles_events.bus.actor import RankPlace
from miles_events.device.buckets import Buckets
from miles_events.device.fingerprint import fingerprints, tensor_fingerprint
from miles_events.rl.canary import CANARY_TENSOR, publication_canary
from miles_events.rl.hf_model import prepare_base_model
from miles_events.transport.collective import CollectiveSettings, CollectiveTransport
from miles_events.transport.inprocess import InProcessTransport
from schemas.config import BuiltinModelConfig, Config, ModelConfig, RunConfig, VllmConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_vllm")]


def _config(run_dir: Path, model_path: Path | None, **vllm: object) -> Config:
    config = Config(run=RunConfig(dir=str(run_dir), runtime="local"))
    config = msgspec.structs.replace(
        config, vllm=msgspec.structs.replace(VllmConfig(startup_timeout=240.0), **vllm)
    )
    if model_path is not None:
        config = msgspec.structs.replace(config, model=ModelConfig(path=str(model_path)))
    return config


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-run")


@pytest.fixture(scope="module")
def base_model(run_dir: Path) -> Path:
    # The project's built-in model and its character-level WordLevel tokenizer, as a run
    # builds them, but 128 wide: vLLM's CPU attention has no kernel for the default's head
    # dimension of 16 (64 / 4 heads) and refuses it at the first request; 32 it serves. Its
    # LM head is the embedding (as SmolLM2's): a reload must refresh the head's kernel too.
    return prepare_base_model(
        ModelConfig(builtin=BuiltinModelConfig(hidden_size=128, tie_word_embeddings=True)), run_dir, seed=1234
    )


@pytest.fixture(scope="module")
def transport() -> InProcessTransport:
    return InProcessTransport("vllm-test")


@pytest.fixture(scope="module")
def engine(run_dir: Path, base_model: Path, transport: InProcessTransport):
    engine = VllmEngine.from_config(
        _config(run_dir, base_model), index=0, name="engine-0", transport=transport
    )
    yield engine
    pgid = engine.server.process.pid if engine.server else None
    engine.close()
    if pgid is not None:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def _base_tensors(base_model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(base_model / "model.safetensors"))


def _perturbed(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for n, t in tensors.items()}


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
PROMPTS = ["1+2=", "3*4=", "9-5=", "7+7="]


def _publish(
    engine: VllmEngine, transport: InProcessTransport, tensors: dict[str, torch.Tensor], version: str
) -> int:
    payload = dict(tensors)
    payload[CANARY_TENSOR] = publication_canary("vllm-test", version)
    ref = transport.stager.put_tensors(f"weights-{engine.name}-{version}", payload, owner="trainer")
    try:
        return engine.load_weights(ref, version)
    finally:
        transport.stager.free(ref)


def test_generation_returns_token_ids_and_per_token_logprobs(engine: VllmEngine):
    completions = engine.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6), torch.Generator().manual_seed(3)
    )
    assert len(completions) == len(PROMPTS)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert completion.prompt_ids == engine.encode(prompt)
        assert 1 <= len(completion.response_ids) <= 6
        assert len(completion.response_logprobs) == len(completion.response_ids)
        assert all(lp <= 0.0 for lp in completion.response_logprobs)
        assert completion.finish_reason in ("stop", "length")
        assert completion.weight_version == "default"
        # The text is the detokenized ids, special tokens left out.
        assert completion.response == engine.tokenizer.decode(
            completion.response_ids, skip_special_tokens=True
        )


def test_ignore_eos_reaches_the_server_and_every_row_runs_the_full_length(engine: VllmEngine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    completions = engine.generate(PROMPTS * 4, sampling, torch.Generator().manual_seed(0))
    assert all(len(c.response_ids) == 24 and c.finish_reason == "length" for c in completions)
    eos = engine.tokenizer.eos_token_id
    assert any(eos in c.response_ids for c in completions), "the fixed seed is expected to sample EOS"


def test_the_same_generator_state_gives_the_same_samples(engine: VllmEngine):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = ["1+1="] * 8  # a group: one request of n = 8 samples, each with a seed of its own
    first = engine.generate(requests, sampling, torch.Generator().manual_seed(11))
    again = engine.generate(requests, sampling, torch.Generator().manual_seed(11))
    other = engine.generate(requests, sampling, torch.Generator().manual_seed(12))
    assert [c.response_ids for c in first] == [c.response_ids for c in again]
    assert [c.response_logprobs for c in first] == [c.response_logprobs for c in again]
    assert len({tuple(c.response_ids) for c in first}) > 1  # samples of a group differ
    assert [c.response_ids for c in other] != [c.response_ids for c in first]


def test_greedy_logprobs_match_the_model_computed_in_torch(engine: VllmEngine, base_model: Path):
    from miles_events.rl.hf_model import load_model

    model = load_model(base_model).eval()
    [completion] = engine.generate(["2+2="], GREEDY)
    ids = torch.tensor([completion.prompt_ids + completion.response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(completion.prompt_ids)
    expected = [logprobs[start - 1 + i, token].item() for i, token in enumerate(completion.response_ids)]
    assert completion.response_logprobs == pytest.approx(expected, abs=1e-3)
    assert completion.response_ids[0] == int(logprobs[start - 1].argmax())


def test_probe_logprobs_are_the_served_logprobs_of_given_tokens(engine: VllmEngine):
    completions = engine.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6), torch.Generator().manual_seed(4)
    )
    probed = engine.probe_logprobs([c.prompt_ids for c in completions], [c.response_ids for c in completions])
    for completion, logprobs in zip(completions, probed, strict=True):
        assert logprobs == pytest.approx(completion.response_logprobs, abs=1e-4)


def test_a_reload_changes_outputs_and_the_original_weights_bring_them_back(
    engine: VllmEngine, transport: InProcessTransport, base_model: Path
):
    base = _base_tensors(base_model)
    before = engine.generate(PROMPTS, GREEDY)
    loaded = _publish(engine, transport, _perturbed(base, seed=5), "1")
    assert loaded == sum(t.numel() * t.element_size() for t in base.values())
    assert engine.weight_version == "1"
    changed = engine.generate(PROMPTS, GREEDY)
    assert [c.response_logprobs for c in changed] != [c.response_logprobs for c in before]
    assert {c.weight_version for c in changed} == {"1"}
    _publish(engine, transport, base, "2")
    restored = engine.generate(PROMPTS, GREEDY)
    assert [c.response_ids for c in restored] == [c.response_ids for c in before]
    for again, first in zip(restored, before, strict=True):
        assert again.response_logprobs == pytest.approx(first.response_logprobs, abs=1e-6)
    assert {c.weight_version for c in restored} == {"2"}


def test_the_served_version_is_read_from_the_server(engine: VllmEngine):
    engine._post("/update_weight_version", json={"new_version": "41"})
    [completion] = engine.generate(["1+2="], GREEDY)
    assert completion.weight_version == "41"  # from the reply's weight_versions, not the engine's memory
    engine._post("/update_weight_version", json={"new_version": engine.weight_version})


def test_checksums_read_back_what_can_be_and_name_the_rest(
    engine: VllmEngine, transport: InProcessTransport, base_model: Path
):
    base = _base_tensors(base_model)
    _publish(engine, transport, base, "3")
    report = engine.checksums()
    served = report.ranks[0].checksums
    assert served, report.message
    # Every tensor read back equals the trainer's fingerprint of what it published.
    assert served == {n: c for n, c in fingerprints(base).items() if n in served}
    assert "cannot be read back" in report.message
    # Embeddings (vLLM pads the vocabulary), norms and the q/k/v biases (fused) read back.
    assert "model.embed_tokens.weight" in served and "model.norm.weight" in served
    assert "model.layers.0.self_attn.k_proj.bias" in served
    assert "model.layers.0.mlp.up_proj.weight" not in served
    _publish(engine, transport, _perturbed(base, seed=6), "4")
    assert engine.checksums().ranks[0].checksums != served
    _publish(engine, transport, base, "5")


def test_snapshot_and_compare_cover_the_readable_tensors(engine: VllmEngine, transport, base_model: Path):
    base = _base_tensors(base_model)
    assert engine.weights_check("snapshot").success
    assert engine.weights_check("compare").success
    _publish(engine, transport, _perturbed(base, seed=7), "6")
    assert not engine.weights_check("compare").success
    _publish(engine, transport, base, "7")
    assert engine.weights_check("compare").success


def test_reset_tensors_overwrites_what_is_served_the_repacked_linears_included(
    engine: VllmEngine, transport, base_model: Path
):
    """The seed's snapshot -> reset -> publish -> compare on vLLM: the compare sees the
    readable tensors, the probe the linears vLLM repacks."""
    from miles_events.rl.probe import max_difference, probe_batch, probe_vocab_size

    base = _base_tensors(base_model)
    prompts, responses = probe_batch(probe_vocab_size(str(base_model)), seed=5)
    _publish(engine, transport, base, "8")
    served = engine.probe_logprobs(prompts, responses)
    assert engine.weights_check("snapshot").success
    reset = engine.weights_check("reset_tensors", skip_tensor_list=["norm"])
    assert reset.success and reset.num_tensors > 0 and engine.weight_version == "8"
    assert not engine.weights_check("compare").success
    assert max_difference(served, engine.probe_logprobs(prompts, responses)) > 0.1
    # Only the norms (skipped) kept their values; reset the rest back by the publication.
    _publish(engine, transport, base, "9")
    assert engine.weights_check("compare").success
    assert max_difference(served, engine.probe_logprobs(prompts, responses)) < 1e-4


def test_a_push_over_http_loads_and_keeps_the_publication_canary(
    engine: VllmEngine, run_dir: Path, base_model: Path, transport: InProcessTransport
):
    # A second client of the same server, configured for the push through the extension.
    pusher = VllmEngine(
        name="engine-0", url=engine.url, model_path=base_model, run_dir=run_dir,
        config=VllmConfig(publication="push"), transport=transport,
    )  # fmt: skip
    try:
        assert pusher.holds_canary
        before = pusher.generate(PROMPTS, GREEDY)
        started = time.perf_counter()
        _publish(pusher, transport, _perturbed(_base_tensors(base_model), seed=8), "8")
        push_seconds = time.perf_counter() - started
        assert pusher.served_canary() == tensor_fingerprint(publication_canary("vllm-test", "8"))
        assert [c.response_logprobs for c in pusher.generate(PROMPTS, GREEDY)] != [
            c.response_logprobs for c in before
        ]
        _publish(pusher, transport, _base_tensors(base_model), "9")
        assert pusher.served_canary() == tensor_fingerprint(publication_canary("vllm-test", "9"))
        assert [c.response_ids for c in pusher.generate(PROMPTS, GREEDY)] == [c.response_ids for c in before]
        print(f"push publication: {push_seconds:.3f} s")
    finally:
        pusher._client.close()
    engine._weight_version = pusher.weight_version


def test_the_servers_worker_receives_weights_broadcast_over_the_collective_transport(
    engine: VllmEngine, run_dir: Path, base_model: Path, tmp_path: Path
):
    # vLLM's worker joins the engine's channel to the publishing rank (gloo) and loads.
    plane = CollectiveTransport("vllm-collective", tmp_path, CollectiveSettings(bucket_bytes=64 * 1024))
    receiver = VllmEngine(
        name="engine-0", url=engine.url, model_path=base_model, run_dir=run_dir,
        config=VllmConfig(), transport=plane,
    )  # fmt: skip

    def broadcast(tensors: dict[str, torch.Tensor], version: str) -> int:
        canary = publication_canary("vllm-test", version)
        buckets = Buckets.of({**tensors, CANARY_TENSOR: canary})
        ref = plane.stager.publish_buckets(f"weights-{version}", buckets, owner="trainer")
        try:
            return receiver.load_weights(ref, version)
        finally:
            plane.stager.free(ref)

    try:
        assert receiver.holds_canary
        before = receiver.generate(PROMPTS, GREEDY)
        broadcast(_perturbed(_base_tensors(base_model), seed=11), "11")
        assert receiver.weight_version == "11"
        assert receiver.served_canary() == tensor_fingerprint(publication_canary("vllm-test", "11"))
        assert [c.response_logprobs for c in receiver.generate(PROMPTS, GREEDY)] != [
            c.response_logprobs for c in before
        ]
        broadcast(_base_tensors(base_model), "12")  # over the same channel
        assert receiver.served_canary() == tensor_fingerprint(publication_canary("vllm-test", "12"))
        assert [c.response_ids for c in receiver.generate(PROMPTS, GREEDY)] == [
            c.response_ids for c in before
        ]
    finally:
        receiver._client.close()
        plane.close()
    engine._weight_version = receiver.weight_version


def test_a_payload_with_a_missing_tensor_is_refused_before_the_server_sees_it(
    engine: VllmEngine, transport: InProcessTransport, base_model: Path
):
    tensors = _base_tensors(base_model)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    version = engine.weight_version
    with pytest.raises(ValueError, match=f"missing: {dropped}"):
        _publish(engine, transport, tensors, "100")
    assert engine.weight_version == version


def test_a_bad_model_path_is_one_line_naming_the_log_within_the_timeout(run_dir: Path, tmp_path: Path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text("{}")
    config = _config(run_dir, not_a_model, startup_timeout=120.0)
    started = time.monotonic()
    with pytest.raises(ServerStartError) as error:
        launch_server(config, index=0, name="bad-model")
    message = str(error.value)
    assert time.monotonic() - started < 120
    assert "\n" not in message
    assert "exited during start" in message and str(run_dir / "vllm" / "bad-model.log") in message
    assert "Unrecognized model in" in message  # the cause, from the log
    assert (
        subprocess.run(["pgrep", "-f", str(not_a_model)], capture_output=True).returncode == 1
    )  # nothing left


def test_a_missing_model_directory_is_refused_before_any_launch(run_dir: Path, tmp_path: Path):
    with pytest.raises(ServerStartError, match="is not a directory"):
        launch_server(_config(run_dir, tmp_path / "absent"), index=0, name="absent-model")


def test_a_head_size_the_cpu_server_cannot_serve_is_refused_before_any_launch(run_dir: Path, tmp_path: Path):
    # The built-in default: 64 wide, 4 heads of 16.
    model = prepare_base_model(ModelConfig(), tmp_path, seed=1)
    started = time.monotonic()
    with pytest.raises(ServerStartError) as error:
        launch_server(_config(run_dir, model), index=0, name="small-heads")
    assert time.monotonic() - started < 5
    message = str(error.value)
    assert "\n" not in message and "no attention kernel for head size 16" in message
    assert "model.builtin.num_attention_heads" in message


def test_a_taken_port_is_one_line_at_once(run_dir: Path, base_model: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ServerStartError) as error:
            launch_server(_config(run_dir, base_model, port=port), index=0, name="taken-port")
    assert time.monotonic() - started < 5
    assert "\n" not in str(error.value) and f"port {port} on 127.0.0.1 is taken" in str(error.value)


def _trainer_logprobs(base_model: Path, tensors: dict[str, torch.Tensor], prompts, responses):
    from miles_events.rl.hf_model import load_model
    from miles_events.rl.probe import teacher_forced_logprobs

    model = load_model(base_model)
    model.load_state_dict(tensors, strict=False)
    return teacher_forced_logprobs(model, prompts, responses)


def test_the_probe_passes_a_faithful_reload_and_catches_a_corrupted_one_the_digests_miss(
    engine: VllmEngine, transport, base_model: Path, monkeypatch: pytest.MonkeyPatch
):
    """The disk reload is given a file whose down projection of layer 0 is negated (a
    faulty writer): what vLLM can read back still matches, the probe does not."""
    import actors.engine.vllm_engine as vllm_engine
    from miles_events.rl.probe import max_difference, probe_batch, probe_vocab_size

    assert engine.config.publication == "disk"
    prompts, responses = probe_batch(probe_vocab_size(str(base_model)), seed=11)
    tensors = _perturbed(_base_tensors(base_model), seed=21)
    expected = _trainer_logprobs(base_model, tensors, prompts, responses)
    skip = ["proj.weight"]

    _publish(engine, transport, tensors, "300")
    faithful = max_difference(expected, engine.probe_logprobs(prompts, responses))
    assert faithful < 1e-3, f"the same weights in float32: {faithful}"

    corrupted = "model.layers.0.mlp.down_proj.weight"
    real_save = vllm_engine.save_file

    def faulty_save(payload, path):  # type: ignore[no-untyped-def]
        real_save({**payload, corrupted: -payload[corrupted]}, path)

    monkeypatch.setattr(vllm_engine, "save_file", faulty_save)
    _publish(engine, transport, tensors, "301")
    readable = engine.checksums(skip).ranks[0].checksums
    published = fingerprints({n: t for n, t in tensors.items() if n in readable})
    assert readable == published, "the digests cannot see the corruption"
    difference = max_difference(expected, engine.probe_logprobs(prompts, responses))
    assert difference > 0.01, f"the probe sees it: {difference}"
    monkeypatch.undo()
    _publish(engine, transport, _base_tensors(base_model), "302")


def test_the_dashboards_engines_row_reads_a_real_servers_metrics(engine: VllmEngine, tmp_path: Path):
    """A real Prometheus finds the server through the file_sd target a run writes, and every
    vLLM expression of the engines row returns data for the run."""
    import json
    import shutil
    import signal

    from actors.engine.scrape_target import write_target
    from tests.test_grafana import (
        GRAFANA,
        expressions,
        free_ports,
        load_yaml,
        query,
        require,
        substitute,
        wait_until_ready,
    )

    prometheus = shutil.which("prometheus")
    require(prometheus is not None, "prometheus (Debian package prometheus)")
    assert engine.metrics_url is not None
    write_target(
        tmp_path / "targets",
        run_id="vllm-run",
        engine="engine-0",
        backend="vllm",
        metrics_url=engine.metrics_url,
    )
    settings = load_yaml(GRAFANA / "prometheus.yml")
    settings["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = [j for j in settings["scrape_configs"] if j["job_name"] == "inference-engines"]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["file_sd_configs"] = [{"files": [str(tmp_path / "targets" / "*.json")], "refresh_interval": "1s"}]
    settings["scrape_configs"] = [job]
    (tmp_path / "prometheus.yml").write_text(json.dumps(settings))
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = [
        str(prometheus), f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    overview = json.loads((GRAFANA / "dashboards" / "miles-rl-overview.json").read_text())
    pending = {n: substitute(e, "vllm-run") for n, e in expressions(overview) if "vllm:" in e}
    assert len(pending) >= 5
    with (tmp_path / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(url, server, tmp_path / "prometheus.log")
        deadline = time.monotonic() + 90
        while pending and time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            engine.generate(
                PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), torch.Generator().manual_seed(1)
            )
            for name, promql in list(pending.items()):
                if query(url, promql):
                    del pending[name]
            time.sleep(1)
        assert not pending, f"no data for {sorted(pending)}"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


# --- sleep mode: what the CPU build cannot run, checked against vLLM's own routes ----------------

SLEEP_ROUTES = """
import inspect, json
from vllm.entrypoints.serve.dev.sleep import api_router as module
routes = {r.path: {"methods": sorted(r.methods), "query": [p.name for p in r.dependant.query_params]}
          for r in module.router.routes}
print(json.dumps({"routes": routes, "wake_up": inspect.getsource(module.wake_up)}))
"""


def test_offload_maps_onto_vllms_own_sleep_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's sleep mode does not run on CPU (the input checks refuse it there), so what the
    engine sends is checked against the routes of the installed vLLM itself."""
    import json

    from actors.engine.vllm_engine import DEFAULT_PYTHON, server_command

    reply = subprocess.run(
        [str(DEFAULT_PYTHON), "-c", SLEEP_ROUTES], capture_output=True, text=True, timeout=120, check=True
    )
    found = json.loads(reply.stdout.strip().splitlines()[-1])
    routes = found["routes"]
    assert routes["/sleep"] == {"methods": ["POST"], "query": ["level", "mode"]}
    assert routes["/release_kv_cache_memory"]["methods"] == ["POST"]
    assert routes["/wake_up"]["methods"] == ["POST"] and 'query_params.getlist("tags")' in found["wake_up"]
    sent: list[tuple[str, dict]] = []
    engine = VllmEngine.__new__(VllmEngine)
    monkeypatch.setattr(engine, "_post", lambda route, **kwargs: sent.append((route, kwargs)))
    engine.release_memory(["cuda_graph", "kv_cache", "weights"])
    engine.release_memory(["cuda_graph", "kv_cache"])
    engine.release_memory(["cuda_graph"])
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache", "cuda_graph"])
    assert sent == [
        ("/sleep", {"params": {"level": 1, "mode": "wait"}}),
        ("/release_kv_cache_memory", {}),
        ("/wake_up", {"params": {"tags": ["weights"]}}),
        ("/wake_up", {"params": {"tags": ["kv_cache"]}}),
    ]
    for route, _ in sent:
        assert route in routes
    config = VllmConfig()
    assert "--enable-sleep-mode" in server_command(
        "py", "/m", 1, config, dtype="float32", max_model_len=8, sleep_mode=True
    )
    assert "--enable-sleep-mode" not in server_command(
        "py", "/m", 1, config, dtype="float32", max_model_len=8
    )


def test_an_engine_whose_digests_would_keep_the_unreadable_linears_is_refused_naming_them(
    engine: VllmEngine, run_dir: Path, base_model: Path
):
    """Without ``verifier.skip_tensor_list`` no publication's digests could match: the engine's
    rank refuses to start (the run's one line) naming a few of the tensors and the setting."""
    config = _config(run_dir, base_model)
    config = msgspec.structs.replace(
        config,
        generator=msgspec.structs.replace(config.generator, engine="vllm"),
        verifier=msgspec.structs.replace(config.verifier, skip_tensor_list=[]),
    )
    with pytest.raises(UnverifiableTensors) as refused:
        EngineWorker(config, engine, RankPlace(0, 1, run_dir))
    message = str(refused.value)
    assert re.search(
        r"^engine-0 \(vllm\) cannot read back \d+ of the tensors it serves in the trainer's layout", message
    )
    assert "model.layers.0.mlp.down_proj.weight" in message, message
    assert 'set verifier.skip_tensor_list = ["proj.weight"]' in message, message
