"""Every request the SGLang backend builds is accepted by SGLang's own request classes (and a
wrong one is refused, so the check can fail), and every reply shape of the contract server,
in the older and the newer server variant, parses.

SGLang cannot serve without CUDA, but its request classes import here
(``tests/sglang_classes.py``), in a process of their own (``tests/sglang_validator.py``); the
tests skip where SGLang is not installed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from actors.engine import sglang_api as api
from tests import sglang_validator
from tests.sglang_server import NEWER, OLDER, VARIANTS, Refused, serve, validate_request

pytestmark = pytest.mark.skipif(not sglang_validator.available(), reason="sglang is not installed")

SAMPLING = api.SamplingParamsBody(
    max_new_tokens=6,
    temperature=0.8,
    top_p=0.95,
    stop=["\n\n"],
    stop_token_ids=[2],
    sampling_seed=11,
    no_stop_trim=True,
)


def every_request() -> list[tuple[str, api.Request]]:
    specs = [
        api.TensorSpec("model.embed_tokens.weight", "bfloat16", (1000, 64)),
        api.TensorSpec("lm_head.weight", "bfloat16", (1000, 64)),
    ]
    return [
        (api.GENERATE, api.generate_request([[1, 2, 3]], SAMPLING, rids=["r0"])),
        (
            api.GENERATE,
            api.generate_request(
                [[1, 2], [4]], api.SamplingParamsBody(temperature=0.0), return_logprob=False
            ),
        ),
        (
            api.UPDATE_WEIGHTS_FROM_DISK,
            api.UpdateWeightsFromDiskRequest(model_path="/tmp/x", weight_version="2"),
        ),
        *(
            (api.INIT_WEIGHTS_UPDATE_GROUP, r)
            for r in api.init_weights_update_group_requests([1, 2], "127.0.0.1", 29500)
        ),
        *(
            (api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, r)
            for r in api.update_weights_from_distributed_requests(specs, "2", max_bytes=200_000)
        ),
        (
            api.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
            api.update_weights_from_distributed_requests(specs, "2", selector="target")[0],
        ),
        (api.DESTROY_WEIGHTS_UPDATE_GROUP, api.DestroyWeightsUpdateGroupRequest()),
        (api.UPDATE_WEIGHT_VERSION, api.UpdateWeightVersionRequest(new_version="3")),
        *(
            (api.PAUSE_GENERATION, api.PauseGenerationRequest(mode=m))
            for m in ("abort", "retract", "in_place")
        ),
        (api.CONTINUE_GENERATION, api.ContinueGenerationRequest()),
        (api.RELEASE_MEMORY_OCCUPATION, api.ReleaseMemoryOccupationRequest()),
        (api.RELEASE_MEMORY_OCCUPATION, api.ReleaseMemoryOccupationRequest(tags=["kv_cache", "weights"])),
        (api.RESUME_MEMORY_OCCUPATION, api.ResumeMemoryOccupationRequest(tags=["cuda_graph"])),
        (api.ABORT_REQUEST, api.AbortRequest(abort_all=True)),
        (api.BEGIN_WEIGHT_UPDATE, api.BeginWeightUpdateRequest()),
        (api.END_WEIGHT_UPDATE, api.EndWeightUpdateRequest()),
        *(
            (api.WEIGHTS_CHECKER, api.WeightsCheckerRequest(action=a, skip_tensor_list=["visual"]))
            for a in api.CHECKER_ACTIONS
        ),
    ]


@pytest.mark.parametrize(
    ("path", "request_"), every_request(), ids=lambda v: v if isinstance(v, str) else type(v).__name__
)
def test_sglangs_classes_accept_every_request_the_backend_builds(path, request_):
    obj = validate_request(path, request_.to_dict())
    assert obj is not None


def test_what_sglang_reads_is_what_the_backend_meant():
    version = validate_request(
        api.UPDATE_WEIGHT_VERSION, api.UpdateWeightVersionRequest(new_version="3").to_dict()
    )
    assert version.new_version == "3" and version.abort_all_requests is False  # SGLang's default is True
    [first, last] = api.update_weights_from_distributed_requests(
        [api.TensorSpec("a", "float32", (10,)), api.TensorSpec("b", "float32", (10,))], "5", max_bytes=40
    )
    assert (
        validate_request(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, first.to_dict()).flush_cache is False
    )  # default True
    assert validate_request(api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, last.to_dict()).weight_version == "5"
    cont = validate_request(api.CONTINUE_GENERATION, api.ContinueGenerationRequest().to_dict())
    assert cont.torch_empty_cache is False  # SGLang's default is True
    gen = validate_request(api.GENERATE, api.generate_request([[1, 2, 3]], SAMPLING).to_dict())
    # normalized to a batch of one: one value per prompt
    assert gen.input_ids == [[1, 2, 3]] and gen.return_logprob == [True]
    params = gen.sampling_params if isinstance(gen.sampling_params, list) else [gen.sampling_params]
    assert [p["sampling_seed"] for p in params] == [11] and gen.logprob_start_len in (-1, [-1])


WRONG = [
    (api.UPDATE_WEIGHTS_FROM_DISK, {"weight_version": "2"}, "model_path"),
    (api.UPDATE_WEIGHTS_FROM_DISK, {"model_path": "/m", "flush_cache": "sometimes"}, "flush_cache"),
    (
        api.INIT_WEIGHTS_UPDATE_GROUP,
        {"master_address": "h", "master_port": "x", "rank_offset": 1, "world_size": 2},
        "master_port",
    ),
    (
        api.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
        {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1]], "selector": "both"},
        "selector",
    ),
    (api.UPDATE_WEIGHT_VERSION, {"version": "3"}, "no field version"),
    (api.PAUSE_GENERATION, {"mode": "stop"}, "mode"),
    (api.WEIGHTS_CHECKER, {"action": "checksum", "selector": "everything"}, "selector"),
    (api.WEIGHTS_CHECKER, {"action": "checksum", "skip_tensors": ["x"]}, "no field skip_tensors"),
    (api.GENERATE, {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}}, "temperature"),
    (api.GENERATE, {"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p"),
    (api.GENERATE, {"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}}, "max_tokens"),
    (api.GENERATE, {"sampling_params": {"max_new_tokens": 4}}, "Either text, input_ids"),
    (api.GENERATE, {"prompt_ids": [1, 2]}, "prompt_ids"),
]


@pytest.mark.parametrize(("path", "body", "why"), WRONG, ids=[f"{p}-{w}" for p, _, w in WRONG])
def test_sglangs_classes_refuse_a_wrong_request(path, body, why):
    with pytest.raises(Refused, match=why):
        validate_request(path, body)


# --- over HTTP, against both server variants -----------------------------------------------------


def call(url: str, path: str, body: bytes | None = None, method: str = "POST") -> tuple[int, bytes]:
    request = urllib.request.Request(
        url + path, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(params=VARIANTS, ids=lambda v: v.name)
def server(request, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"base weights")
    with serve(request.param, str(model), tp_size=2) as running:
        yield running


def model_info(url: str) -> api.ModelInfo:
    for path in api.MODEL_INFO_PATHS:
        status, body = call(url, path, method="GET")
        if status == 200:
            return api.decode(body, api.ModelInfo)
        assert status == 404
    raise AssertionError("no model_info endpoint")


def test_health_generate_answers_on_every_version_and_health_only_on_newer(server):
    assert api.is_ready(call(server.url, api.HEALTH_GENERATE, method="GET")[0])
    assert call(server.url, api.HEALTH, method="GET")[0] == (200 if server.state.variant.health else 404)


def test_the_served_version_is_read_from_model_info_under_either_name(server):
    assert model_info(server.url).weight_version == "default"
    assert call(server.url, "/get_weight_version", method="GET")[0] == 404


def test_generate_replies_parse_in_both_versions(server):
    status, body = call(server.url, api.GENERATE, api.generate_request([[5, 9], [3]], SAMPLING).body())
    assert status == 200, body
    replies = api.parse_generate_reply(body)
    assert len(replies) == 2
    for reply in replies:
        assert reply.finish in ("stop", "length") and reply.weight_version == "default"
        assert len(reply.output_logprobs) == len(reply.output_ids) > 0
        assert (reply.meta_info.weight_versions is not None) == server.state.variant.weight_version_spans
    assert server.state.refused == []


def publish(url: str, variant_newer: bool, path: str, version: str) -> None:
    """The disk publication: pause, flush, update from disk, version, continue."""
    assert call(url, api.PAUSE_GENERATION, api.pause_generation_body("retract"))[0] == 200
    api.flush_cache_with_retry(lambda: call(url, api.flush_cache_path(30)), interval=0.01, timeout=5)
    if variant_newer:
        assert call(url, api.BEGIN_WEIGHT_UPDATE, api.BeginWeightUpdateRequest().body())[0] == 200
    status, body = call(
        url,
        api.UPDATE_WEIGHTS_FROM_DISK,
        api.UpdateWeightsFromDiskRequest(model_path=path, weight_version=version).body(),
    )
    assert api.parse_success_reply(status, body, api.UpdateWeightsFromDiskReply).success, body
    if variant_newer:
        assert call(url, api.END_WEIGHT_UPDATE, api.EndWeightUpdateRequest().body())[0] == 200
    status, body = call(
        url, api.UPDATE_WEIGHT_VERSION, api.UpdateWeightVersionRequest(new_version=version).body()
    )
    reply = api.parse_success_reply(status, body, api.UpdateWeightVersionReply)
    assert reply.success and reply.new_version == version
    status, body = call(url, api.CONTINUE_GENERATION, api.ContinueGenerationRequest().body())
    assert status == 200 and api.decode(body, api.StatusReply).status == "ok"


def checker(url: str, action: str) -> tuple[int, bytes]:
    return call(
        url, api.WEIGHTS_CHECKER, api.WeightsCheckerRequest(action=action, skip_tensor_list=["visual"]).body()
    )


def test_the_seeds_protocol_snapshot_reset_publish_compare_passes_in_both_versions(server, tmp_path):
    newer = server.state.variant is NEWER
    server.state.busy_flushes = 2
    base = api.parse_checksum_reply(*checker(server.url, "checksum"))
    assert base.success and len(base.ranks) == 2
    for action in ("snapshot", "reset_tensors"):
        assert api.parse_check_reply(action, *checker(server.url, action)).success
    reset = api.parse_checksum_reply(*checker(server.url, "checksum"))
    assert reset.per_engine_checksum != base.per_engine_checksum
    failed = api.parse_check_reply("compare", *checker(server.url, "compare"))
    assert not failed.success and "check tensor equality failed" in failed.message
    publish(server.url, newer, server.state.model_path, "1")
    assert api.parse_check_reply("compare", *checker(server.url, "compare")).success
    served = api.parse_checksum_reply(*checker(server.url, "checksum"))
    assert served.per_engine_checksum == base.per_engine_checksum
    assert model_info(server.url).weight_version == "1"
    assert server.state.refused == []
    flushes = [p for _, p, _ in server.state.requests if p.startswith(api.FLUSH_CACHE)]
    assert len(flushes) == 3  # two busy answers retried


def test_an_update_outside_a_session_is_refused_where_the_version_requires_one(server, tmp_path):
    status, body = call(
        server.url,
        api.UPDATE_WEIGHTS_FROM_DISK,
        api.UpdateWeightsFromDiskRequest(model_path=server.state.model_path).body(),
    )
    reply = api.parse_success_reply(status, body, api.UpdateWeightsFromDiskReply)
    assert reply.success == (server.state.variant is OLDER)


def test_the_nccl_requests_are_accepted_and_an_older_server_is_never_sent_a_selector(server):
    [init] = api.init_weights_update_group_requests([2], "127.0.0.1", 29500)
    assert api.parse_success_reply(*call(server.url, api.INIT_WEIGHTS_UPDATE_GROUP, init.body())).success
    newer = server.state.variant is NEWER
    if newer:
        assert call(server.url, api.BEGIN_WEIGHT_UPDATE, api.BeginWeightUpdateRequest().body())[0] == 200
    specs = [
        api.TensorSpec(name, "bfloat16", (4, 4)) for name in ("model.embed_tokens.weight", "lm_head.weight")
    ]
    for request in api.update_weights_from_distributed_requests(
        specs, "2", max_bytes=32, selector="all" if newer else None
    ):
        assert api.parse_success_reply(
            *call(server.url, api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, request.body())
        ).success
    if newer:
        assert call(server.url, api.END_WEIGHT_UPDATE, api.EndWeightUpdateRequest().body())[0] == 200
    assert model_info(server.url).weight_version == "2"
    destroy = api.DestroyWeightsUpdateGroupRequest().body()
    assert api.parse_success_reply(*call(server.url, api.DESTROY_WEIGHTS_UPDATE_GROUP, destroy)).success
    assert server.state.refused == []


def test_a_selector_sent_to_an_older_server_is_caught():
    import tempfile

    with tempfile.TemporaryDirectory() as model, serve(OLDER, model) as server:
        [init] = api.init_weights_update_group_requests([1], "127.0.0.1", 29500)
        call(server.url, api.INIT_WEIGHTS_UPDATE_GROUP, init.body())
        [request] = api.update_weights_from_distributed_requests(
            [api.TensorSpec("lm_head.weight", "float32", (1,))], "2", selector="all"
        )
        assert not api.parse_success_reply(
            *call(server.url, api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, request.body())
        ).success


def test_release_and_resume_memory_around_an_idle_server(server):
    assert call(server.url, api.FLUSH_CACHE, method="GET")[0] == 200
    assert (
        call(server.url, api.RELEASE_MEMORY_OCCUPATION, api.ReleaseMemoryOccupationRequest().body())[0] == 200
    )
    assert call(server.url, api.HEALTH_GENERATE, method="GET")[0] == 503
    assert (
        call(server.url, api.RESUME_MEMORY_OCCUPATION, api.ResumeMemoryOccupationRequest().body())[0] == 200
    )
    assert call(server.url, api.HEALTH_GENERATE, method="GET")[0] == 200
    assert server.state.released == set()


def test_the_server_refuses_a_body_sglang_refuses_with_its_400_shape(server):
    status, body = call(server.url, api.UPDATE_WEIGHT_VERSION, json.dumps({"version": "3"}).encode())
    assert status == 400
    error: Any = json.loads(body)
    assert error["object"] == "error" and "no field version" in error["message"] and error["code"] == 400
    assert "HTTP 400" in api.error_message(status, body)


def test_sglangs_own_argument_parser_reads_the_launch_argv():
    launch = api.LaunchArgs(
        model_path="/m",
        port=15000,
        tp_size=2,
        mem_fraction_static=0.7,
        nccl_port=15100,
        base_gpu_id=2,
        random_seed=3,
        enable_memory_saver=True,
        enable_metrics=True,
        skip_server_warmup=True,
        extra_args=("--log-level", "warning"),
    )
    args = sglang_validator.launch_args(api.launch_argv(launch)[3:])
    assert [args[k] for k in ("model_path", "host", "port", "tp_size", "dp_size")] == [
        "/m",
        "127.0.0.1",
        15000,
        2,
        1,
    ]
    assert [args[k] for k in ("mem_fraction_static", "nccl_port", "base_gpu_id", "random_seed")] == [
        0.7,
        15100,
        2,
        3,
    ]
    assert args["enable_memory_saver"] and args["enable_metrics"] and args["skip_server_warmup"]
    assert args["log_level"] == "warning"
    with pytest.raises(Refused):
        sglang_validator.launch_args(["--model-path", "/m", "--tp-size", "x"])


def test_a_pause_without_a_body_is_refused_by_the_newer_endpoint_so_a_mode_is_sent_by_default():
    # SGLang 0.5.23 declares ``obj: Annotated[PauseGenerationReqInput, Body()]``: a required body.
    bodies = [api.pause_generation_body(None).decode(), api.pause_generation_body("retract").decode()]
    assert sglang_validator.pause_statuses(bodies) == [422, 200]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_the_contract_server_answers_a_bodiless_pause_as_its_version_does(variant, tmp_path):
    with serve(variant, str(tmp_path)) as server:
        status, _ = call(server.url, api.PAUSE_GENERATION, api.pause_generation_body(None) or None)
        assert status == (422 if variant is NEWER else 200)


def test_sglang_is_never_imported_by_the_test_process():
    # Importing SGLang patches transformers process-wide; only the validator process does.
    import sys

    validate_request(api.UPDATE_WEIGHT_VERSION, api.UpdateWeightVersionRequest(new_version="1").to_dict())
    assert not [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]
