"""The SGLang contract (``actors/engine/sglang_api.py``): every request the backend builds
and every reply it parses, pure; SGLang's own classes accept each request (and refuse a
wrong one) in ``test_sglang_contract.py``."""

from __future__ import annotations

import json

import msgspec
import pytest

from actors.engine import sglang_api as api
from miles_events.rl.checksum import (
    ChecksumReplyError,
    per_engine_checksum,
    per_gpu_checksum,
    rank_of,
    ranked_checksums,
)

MiB = 1024**2


def test_launch_argv_names_the_model_host_port_and_parallelism():
    argv = api.launch_argv(
        api.LaunchArgs(
            model_path="/m",
            port=15000,
            tp_size=2,
            mem_fraction_static=0.7,
            nccl_port=15100,
            random_seed=3,
            enable_memory_saver=True,
            skip_server_warmup=True,
            extra_args=("--log-level", "warning"),
        ),
        python="/py",
    )
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model-path"] == "/m" and pairs["--host"] == "127.0.0.1" and pairs["--port"] == "15000"
    assert pairs["--tp-size"] == "2" and pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--nccl-port"] == "15100" and pairs["--random-seed"] == "3"
    assert (
        "--enable-memory-saver" in argv and "--skip-server-warmup" in argv and "--enable-metrics" not in argv
    )
    assert argv[-2:] == ["--log-level", "warning"]


def test_buckets_keep_the_order_and_stay_within_512_mib():
    specs = [api.TensorSpec(f"t{i}", "bfloat16", (100 * MiB // 2,)) for i in range(12)]  # 100 MiB each
    buckets = api.bucket_tensors(specs)
    assert [s for bucket in buckets for s in bucket] == specs
    assert all(sum(s.num_bytes for s in bucket) <= api.MAX_BUCKET_BYTES for bucket in buckets)
    assert [len(b) for b in buckets] == [5, 5, 2]


def test_a_tensor_larger_than_a_bucket_is_a_bucket_of_its_own():
    small = api.TensorSpec("a", "float32", (4,))
    huge = api.TensorSpec("b", "float32", (200 * MiB,))  # 800 MiB
    assert api.bucket_tensors([small, huge, small]) == [[small], [huge], [small]]


def test_only_the_last_bucket_flushes_and_sets_the_version():
    specs = [api.TensorSpec(f"t{i}", "torch.bfloat16", (256 * MiB // 2 + 1,)) for i in range(3)]
    requests = api.update_weights_from_distributed_requests(specs, "7")
    assert len(requests) == 3
    assert [r.flush_cache for r in requests] == [False, False, True]
    assert [r.weight_version for r in requests] == [None, None, "7"]
    body = json.loads(requests[0].body())
    assert body["flush_cache"] is False and "weight_version" not in body and "selector" not in body
    assert body["dtypes"] == ["bfloat16"] and body["shapes"] == [[256 * MiB // 2 + 1]]
    assert (
        json.loads(api.update_weights_from_distributed_requests(specs, "7", selector="target")[0].body())[
            "selector"
        ]
        == "target"
    )


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype"):
        api.TensorSpec("a", "complex32", (1,)).num_bytes  # noqa: B018


def test_engine_i_joins_the_group_after_the_gpus_of_the_engines_before_it():
    requests = api.init_weights_update_group_requests([2, 1, 4], "10.0.0.1", 29500)
    assert [r.rank_offset for r in requests] == [1, 3, 4]
    assert {r.world_size for r in requests} == {8}
    assert json.loads(requests[0].body()) == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 8,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    with pytest.raises(ValueError):
        api.init_weights_update_group_requests([], "h", 1)


def test_update_weight_version_always_sends_abort_all_requests_false():
    assert json.loads(api.UpdateWeightVersionRequest(new_version="2").body()) == {
        "new_version": "2",
        "abort_all_requests": False,
    }


def test_pause_sends_a_mode_or_no_body():
    assert json.loads(api.pause_generation_body("retract")) == {"mode": "retract"}
    assert api.pause_generation_body(None) == b""


def test_generate_request_sends_token_ids_and_no_unset_field():
    sampling = api.SamplingParamsBody(
        max_new_tokens=8, temperature=0.7, top_p=0.9, stop=["\n"], stop_token_ids=[2], sampling_seed=5
    )
    body = json.loads(api.generate_request([[1, 2], [3]], sampling, rids=["a", "b"]).body())
    assert body["input_ids"] == [[1, 2], [3]] and body["rid"] == ["a", "b"]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    assert body["sampling_params"]["stop"] == ["\n"] and body["sampling_params"]["sampling_seed"] == 5
    plain = json.loads(api.generate_request([[1]], api.SamplingParamsBody()).body())
    assert "rid" not in plain and "stop" not in plain["sampling_params"]
    assert "sampling_seed" not in plain["sampling_params"]
    with pytest.raises(ValueError):
        api.generate_request([], sampling)
    with pytest.raises(ValueError):
        api.generate_request([[1]], sampling, rids=["a", "b"])


def _reply(**meta):
    return {"text": "x y", "output_ids": [5, 6], "meta_info": {"id": "r", **meta}}


def test_a_single_reply_and_a_batch_reply_both_parse():
    one = api.parse_generate_reply(json.dumps(_reply(weight_version="3")).encode())
    many = api.parse_generate_reply(json.dumps([_reply(weight_version="3")] * 2).encode())
    assert len(one) == 1 and len(many) == 2 and one[0].output_ids == [5, 6]


@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        ({"type": "stop", "matched": 2}, "stop"),
        ({"type": "stop", "matched": "\n"}, "stop"),
        ({"type": "length", "length": 2}, "length"),
        ({"type": "abort", "message": "Abort before prefill"}, "abort"),
    ],
)
def test_every_finish_reason_parses(reason, finish):
    [reply] = api.parse_generate_reply(json.dumps(_reply(finish_reason=reason, weight_version="1")).encode())
    assert reply.finish == finish


def test_an_unfinished_or_unknown_finish_reason_is_an_error():
    [unfinished] = api.parse_generate_reply(json.dumps(_reply(finish_reason=None)).encode())
    [odd] = api.parse_generate_reply(json.dumps(_reply(finish_reason={"type": "eos"})).encode())
    with pytest.raises(ValueError, match="no finish_reason"):
        unfinished.finish  # noqa: B018
    with pytest.raises(ValueError, match="unknown finish_reason"):
        odd.finish  # noqa: B018


def test_output_logprobs_are_read_per_token_and_checked_against_the_ids():
    entries = [[-0.5, 5, None], [-1.5, 6, "y"]]
    [reply] = api.parse_generate_reply(json.dumps(_reply(output_token_logprobs=entries)).encode())
    assert reply.output_logprobs == [-0.5, -1.5]
    [wrong] = api.parse_generate_reply(
        json.dumps(_reply(output_token_logprobs=[[-0.5, 9, None]] * 2)).encode()
    )
    with pytest.raises(ValueError, match="does not match"):
        wrong.output_logprobs  # noqa: B018
    [missing] = api.parse_generate_reply(json.dumps(_reply()).encode())
    with pytest.raises(ValueError, match="return_logprob"):
        missing.output_logprobs  # noqa: B018


def test_the_weight_version_comes_from_meta_info_or_its_spans():
    [older] = api.parse_generate_reply(json.dumps(_reply(weight_version="4")).encode())
    assert older.weight_version == "4"
    assert older.weight_version_spans == [api.WeightVersionSpan(version="4", start=0, end=2)]
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    [newer] = api.parse_generate_reply(json.dumps(_reply(weight_version="4", weight_versions=spans)).encode())
    assert newer.weight_version == "4" and [s.version for s in newer.weight_version_spans] == ["3", "4"]
    [disagree] = api.parse_generate_reply(
        json.dumps(_reply(weight_version="5", weight_versions=spans)).encode()
    )
    with pytest.raises(ValueError, match="disagrees"):
        disagree.weight_version  # noqa: B018
    [none] = api.parse_generate_reply(json.dumps(_reply()).encode())
    with pytest.raises(ValueError, match="no weight_version"):
        none.weight_version  # noqa: B018


def test_model_info_parses_with_or_without_a_weight_version():
    info = api.decode(
        b'{"model_path":"/m","tokenizer_path":"/m","is_generation":true,"weight_version":"2","x":1}',
        api.ModelInfo,
    )
    assert info.weight_version == "2"
    assert api.decode(b'{"model_path":"/m"}', api.ModelInfo).weight_version is None


def test_weight_update_replies_parse_on_success_and_on_400():
    ok = api.parse_success_reply(
        200, b'{"success":true,"message":"ok","num_paused_requests":0}', api.UpdateWeightsFromDiskReply
    )
    failed = api.parse_success_reply(
        400, b'{"success":false,"message":"no such dir","num_paused_requests":0}'
    )
    invalid = api.parse_success_reply(422, b'{"detail":[{"msg":"field required"}]}')
    crashed = api.parse_success_reply(500, b"Internal Server Error")
    assert ok.success and not failed.success and failed.message == "no such dir"
    assert not invalid.success and "HTTP 422" in invalid.message
    assert not crashed.success and "Internal Server Error" in crashed.message
    version = api.parse_success_reply(
        200, b'{"success":true,"message":"m","new_version":"3"}', api.UpdateWeightVersionReply
    )
    assert version.new_version == "3"


def test_flush_cache_retries_while_busy_and_gives_up_at_the_deadline():
    now = [0.0]
    answers = iter([(400, b"Flush cache failed.\n")] * 3 + [(200, b"Cache flushed.\n")])
    attempts = api.flush_cache_with_retry(
        lambda: next(answers),
        timeout=10,
        interval=1,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert attempts == 4 and now[0] == 3
    now[0] = 0.0
    with pytest.raises(api.FlushCacheBusy, match="still busy after 3 attempts"):
        api.flush_cache_with_retry(
            lambda: (400, b"busy"),
            timeout=2.5,
            interval=1,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )
    with pytest.raises(RuntimeError, match="HTTP 500"):
        api.flush_cache_with_retry(lambda: (500, b"boom"), sleep=lambda s: None)
    assert api.flush_cache_path() == "/flush_cache" and api.flush_cache_path(5) == "/flush_cache?timeout=5"


def _rank(tp_rank, listed):
    checksums = {"w": f"{tp_rank:016x}", "b": "00000000000000ff"}
    info = {
        "tp_rank": tp_rank,
        "tp_size": 2,
        "dp_rank": 0,
        "dp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "rank": tp_rank,
        "size": 2,
    }
    return {
        "checksums": checksums,
        "per_gpu_checksum": per_gpu_checksum(checksums),
        "parallelism_info": [{**info, "role": "target"}] if listed else info,
    }


@pytest.mark.parametrize("listed", [False, True], ids=["dict", "list-with-role"])
def test_a_checksum_reply_parses_with_either_parallelism_info_shape(listed):
    ranks = [_rank(0, listed), _rank(1, listed)]
    body = {
        "success": True,
        "message": "",
        "ranks": ranks,
        "per_engine_checksum": per_engine_checksum(r["per_gpu_checksum"] for r in ranks),
    }
    report = api.parse_checksum_reply(200, json.dumps(body).encode())
    assert report.success and len(report.ranks) == 2
    assert ranked_checksums(report) == {
        "rank0/w": "0" * 16,
        "rank0/b": "00000000000000ff",
        "rank1/w": "0" * 15 + "1",
        "rank1/b": "00000000000000ff",
    }


def _checksum_body(*ranks: dict) -> bytes:
    return json.dumps(
        {"success": True, "message": "", "ranks": list(ranks), "per_engine_checksum": "e" * 64}
    ).encode()


def test_a_checksum_reply_whose_ranks_arrive_out_of_order_is_parsed_in_rank_order():
    report = api.parse_checksum_reply(200, _checksum_body(_rank(1, True), _rank(0, False)))
    assert [rank_of(rank) for rank in report.ranks] == [0, 1]
    assert list(ranked_checksums(report)) == ["rank0/w", "rank0/b", "rank1/w", "rank1/b"]


def test_a_checksum_reply_that_repeats_a_rank_is_refused():
    with pytest.raises(ChecksumReplyError, match="^the checksum reply reports rank 1 twice$"):
        api.parse_checksum_reply(200, _checksum_body(_rank(0, False), _rank(1, False), _rank(1, True)))


def test_a_checksum_reply_with_a_rank_without_tensors_is_refused():
    empty = {**_rank(1, False), "checksums": {}}
    with pytest.raises(ChecksumReplyError, match="^rank 1 of the checksum reply has no tensors$"):
        api.parse_checksum_reply(200, _checksum_body(_rank(0, False), empty))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"<html>502</html>", "JSON is malformed"),
        (b'{"success": true, "ranks": "all"}', "Expected `array`, got `str` - at `$.ranks`"),
        (b'{"success": true, "ranks": [null]}', "Expected `object`, got `null` - at `$.ranks[0]`"),
        (
            b'{"success": true, "ranks": [{"parallelism_info": {"rank": 0}}]}',
            "missing required field `checksums`",
        ),
    ],
    ids=["not json", "ranks not a list", "rank not an object", "rank without checksums"],
)
def test_a_checksum_reply_that_does_not_decode_is_refused_in_one_line(body, why):
    with pytest.raises(ChecksumReplyError, match="^the checksum reply is malformed: ") as raised:
        api.parse_checksum_reply(200, body)
    assert why in str(raised.value) and "\n" not in str(raised.value)


def test_an_unsuccessful_checksum_reply_is_returned_as_it_is():
    report = api.parse_checksum_reply(200, b'{"success": false, "message": "busy", "ranks": []}')
    assert (report.success, report.message) == (False, "busy")


def test_a_failed_checker_call_is_an_unsuccessful_result_with_the_servers_message():
    failed = api.parse_check_reply(
        "compare", 400, b'{"success":false,"message":"check tensor equality failed:\\nname=w"}'
    )
    assert (
        not failed.success and "check tensor equality failed" in failed.message and failed.action == "compare"
    )
    ok = api.parse_check_reply(
        "snapshot", 200, b'{"success":true,"message":"Success."}', weight_version="2", num_tensors=3
    )
    assert ok.success and ok.weight_version == "2" and ok.num_tensors == 3
    assert not api.parse_checksum_reply(400, b'{"success":false,"message":"Unsupported"}').success


def test_every_checker_request_sends_every_field():
    for action in api.CHECKER_ACTIONS:
        body = json.loads(api.WeightsCheckerRequest(action=action, skip_tensor_list=["visual"]).body())
        assert body == {
            "action": action,
            "allow_quant_error": False,
            "selector": "all",
            "skip_tensor_list": ["visual"],
        }


def test_memory_requests_send_their_tags_or_nothing_for_all():
    assert json.loads(api.ReleaseMemoryOccupationRequest(tags=["kv_cache"]).body()) == {"tags": ["kv_cache"]}
    assert json.loads(api.ResumeMemoryOccupationRequest().body()) == {}
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"tags": ["gpu"]}, api.ReleaseMemoryOccupationRequest)
