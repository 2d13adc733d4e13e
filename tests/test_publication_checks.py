"""The seed's publication checks over replies in SGLang's shapes (../shared/SGLANG.md):
both ``parallelism_info`` variants, ``None`` bodies from non-first nodes, the seed's messages."""

from __future__ import annotations

import hashlib
import json

import pytest

from miles_events.rl.publication_checks import (
    canonical_inference_checksums,
    canonical_weight_versions,
    changed_checksum_count,
    checksum_digest,
    flatten_inference_engine_checksums,
    require_initial_version_publication,
    require_version_increment,
    require_weight_check_success,
)


def rank(checksums: dict[str, str], gpu: int, *, as_list: bool = False) -> dict:
    info = {
        "tp_rank": gpu,
        "tp_size": 2,
        "dp_rank": 0,
        "dp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "rank": gpu,
        "size": 2,
    }
    parallelism = [{**info, "role": "target"}, {**info, "role": "draft"}] if as_list else info
    return {"checksums": checksums, "per_gpu_checksum": "0" * 64, "parallelism_info": parallelism}


def body(*ranks: dict, success: bool = True) -> dict:
    return {"success": success, "message": "", "ranks": list(ranks), "per_engine_checksum": "1" * 64}


TWO_ENGINES = [
    [body(rank({"b": "02", "a": "01"}, 0), rank({"a": "03"}, 1)), None],  # 2 nodes: the 2nd answers None
    [body(rank({"a": "11"}, 0, as_list=True))],
]


def test_flattening_names_every_tensor_by_rank_and_drops_non_first_nodes():
    assert flatten_inference_engine_checksums(TWO_ENGINES) == [
        {"rank0/b": "02", "rank0/a": "01", "rank1/a": "03"},
        {"rank0/a": "11"},
    ]


def test_canonical_checksums_are_sorted_engines_of_sorted_pairs():
    canonical = canonical_inference_checksums(TWO_ENGINES)
    assert canonical == (
        (("rank0/a", "01"), ("rank0/b", "02"), ("rank1/a", "03")),
        (("rank0/a", "11"),),
    )
    assert canonical_inference_checksums(list(reversed(TWO_ENGINES))) == canonical


def test_the_digest_is_sha256_of_compact_ascii_json():
    canonical = canonical_inference_checksums(TWO_ENGINES)
    expected = hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()
    assert checksum_digest(canonical) == expected
    assert (
        checksum_digest(canonical)
        == hashlib.sha256(
            b'[[["rank0/a","01"],["rank0/b","02"],["rank1/a","03"]],[["rank0/a","11"]]]'
        ).hexdigest()
    )


def test_an_empty_reply_is_the_seeds_error():
    with pytest.raises(RuntimeError, match="^inference weight checksum response was empty$"):
        canonical_inference_checksums([[None]])


def test_a_failed_or_rankless_checksum_body_is_refused():
    with pytest.raises(RuntimeError, match="did not succeed"):
        flatten_inference_engine_checksums([[body(rank({"a": "01"}, 0), success=False)]])
    with pytest.raises(RuntimeError, match="has no ranks"):
        flatten_inference_engine_checksums([[body()]])


def test_changed_tensors_are_counted_and_roster_changes_refused():
    before = canonical_inference_checksums(TWO_ENGINES)
    after = ((("rank0/a", "01"), ("rank0/b", "99"), ("rank1/a", "03")), (("rank0/a", "12"),))
    assert changed_checksum_count(before, after) == 2
    assert changed_checksum_count(before, before) == 0
    with pytest.raises(RuntimeError, match="^inference engine count changed during checkpoint publication$"):
        changed_checksum_count(before, before[:1])
    with pytest.raises(RuntimeError, match="^inference tensor roster changed during checkpoint publication$"):
        changed_checksum_count(before, (before[0], (("rank0/z", "11"),)))


def test_every_engine_must_succeed_a_weight_check():
    require_weight_check_success([[{"success": True}, None], [{"success": True}]], action="snapshot")
    with pytest.raises(
        RuntimeError, match="^inference weight check 'compare' did not succeed on every engine$"
    ):
        require_weight_check_success(
            [[{"success": True}], [{"success": False, "message": "differ"}]], action="compare"
        )
    with pytest.raises(
        RuntimeError, match="^inference weight check 'reset_tensors' did not succeed on every engine$"
    ):
        require_weight_check_success([[None]], action="reset_tensors")
    with pytest.raises(
        RuntimeError, match="^inference weight check 'compare' returned a malformed response$"
    ):
        require_weight_check_success(None, action="compare")


def test_weight_versions_and_their_transitions():
    assert canonical_weight_versions(["default", "default"]) == ("default", "default")
    with pytest.raises(RuntimeError, match="^inference weight-version response was empty$"):
        canonical_weight_versions([])
    with pytest.raises(RuntimeError, match=r"^inference weight version is invalid: ''$"):
        canonical_weight_versions(["1", ""])
    require_initial_version_publication(("default", "default"), ("1", "1"))
    with pytest.raises(
        RuntimeError, match=r"from 'default' to '1': \('default', 'default'\) -> \('1', '2'\)"
    ):
        require_initial_version_publication(("default", "default"), ("1", "2"))
    require_version_increment(("1", "1"), ("2", "2"), action="checkpoint republication")
    with pytest.raises(
        RuntimeError,
        match=r"^checkpoint republication did not increment every inference weight version exactly once",
    ):
        require_version_increment(("1", "1"), ("2", "3"), action="checkpoint republication")


# --- miles' own cases (tests/fast/utils/test_checksum_utils.py), over miles' body shapes ---------
# miles' bodies carry no ``per_gpu_checksum`` and a ``parallelism_info`` list of roles.


def miles_body(*, success: bool, ranks: list[dict] | None) -> dict:
    reply: dict = {"success": success, "message": "ok"}
    if ranks is not None:
        reply["ranks"] = ranks
    return reply


def miles_rank(gpu: int, checksums: dict[str, str]) -> dict:
    return {"checksums": checksums, "parallelism_info": [{"role": "target", "rank": gpu}]}


def test_one_engine_of_one_rank_flattens_to_its_prefixed_checksums():
    reply = [[miles_body(success=True, ranks=[miles_rank(0, {"w": "aaa"})])]]
    assert flatten_inference_engine_checksums(reply) == [{"rank0/w": "aaa"}]


def test_engines_of_every_server_group_flatten_into_one_list_in_order():
    reply = [
        [miles_body(success=True, ranks=[miles_rank(0, {"w": "e0"})])],
        [miles_body(success=True, ranks=[miles_rank(0, {"w": "e1"})])],
    ]
    assert flatten_inference_engine_checksums(reply) == [{"rank0/w": "e0"}, {"rank0/w": "e1"}]


def test_none_bodies_of_non_first_nodes_are_dropped():
    reply = [[miles_body(success=True, ranks=[miles_rank(0, {"w": "e0"})]), None]]
    assert flatten_inference_engine_checksums(reply) == [{"rank0/w": "e0"}]


def test_a_reply_of_none_bodies_only_is_refused():
    with pytest.raises(RuntimeError, match="^inference weight checksum response was empty$"):
        flatten_inference_engine_checksums([[None, None]])


def test_the_ranks_of_one_engine_merge_under_their_rank_prefix():
    reply = [[miles_body(success=True, ranks=[miles_rank(0, {"w": "r0"}), miles_rank(1, {"w": "r1"})])]]
    assert flatten_inference_engine_checksums(reply) == [{"rank0/w": "r0", "rank1/w": "r1"}]


def test_ranks_that_arrive_out_of_order_flatten_in_rank_order():
    out_of_order = [
        [miles_body(success=True, ranks=[miles_rank(1, {"w": "r1"}), miles_rank(0, {"w": "r0"})])]
    ]
    in_order = [[miles_body(success=True, ranks=[miles_rank(0, {"w": "r0"}), miles_rank(1, {"w": "r1"})])]]
    [flattened] = flatten_inference_engine_checksums(out_of_order)
    assert list(flattened) == ["rank0/w", "rank1/w"]
    assert [flattened] == flatten_inference_engine_checksums(in_order)


def test_an_engine_that_reports_failure_is_refused():
    reply = [[miles_body(success=False, ranks=[miles_rank(0, {"w": "aaa"})])]]
    with pytest.raises(
        RuntimeError, match="^inference weight checksum did not succeed on server group 0 engine 0: ok$"
    ):
        flatten_inference_engine_checksums(reply)


@pytest.mark.parametrize("ranks", [None, []], ids=["absent", "empty"])
def test_an_engine_without_ranks_is_refused(ranks):
    reply = [[miles_body(success=True, ranks=ranks)]]
    with pytest.raises(
        RuntimeError,
        match="^inference weight checksum of server group 0 engine 0: the checksum reply has no ranks$",
    ):
        flatten_inference_engine_checksums(reply)


def test_roles_that_share_a_gpu_rank_count_as_that_rank():
    rank_info = {
        "checksums": {"w": "aaa"},
        "parallelism_info": [{"role": "target", "rank": 0}, {"role": "draft", "rank": 0}],
    }
    assert flatten_inference_engine_checksums([[miles_body(success=True, ranks=[rank_info])]]) == [
        {"rank0/w": "aaa"}
    ]


def test_roles_that_name_different_gpu_ranks_are_refused():
    rank_info = {
        "checksums": {"w": "aaa"},
        "parallelism_info": [{"role": "target", "rank": 0}, {"role": "draft", "rank": 1}],
    }
    with pytest.raises(
        RuntimeError,
        match="^inference weight checksum of server group 0 engine 0: rank entry 0 .*expected one GPU rank",
    ):
        flatten_inference_engine_checksums([[miles_body(success=True, ranks=[rank_info])]])


# --- what a rank prefix must not hide ------------------------------------------------------------


@pytest.mark.parametrize(
    "second",
    [{"w": "r0"}, {"w": "other"}, {"v": "r0"}],
    ids=["same tensors", "other checksums", "other tensors"],
)
def test_a_reply_that_repeats_a_rank_is_refused(second):
    reply = [[None], [miles_body(success=True, ranks=[miles_rank(0, {"w": "r0"}), miles_rank(0, second)])]]
    with pytest.raises(
        RuntimeError,
        match="^inference weight checksum of server group 1 engine 0: the checksum reply reports rank 0 twice$",
    ):
        flatten_inference_engine_checksums(reply)


def test_a_rank_without_tensors_is_refused():
    reply = [[miles_body(success=True, ranks=[miles_rank(0, {"w": "r0"}), miles_rank(1, {})])]]
    with pytest.raises(
        RuntimeError,
        match="^inference weight checksum of server group 0 engine 0: rank 1 of the checksum reply has no tensors$",
    ):
        flatten_inference_engine_checksums(reply)


@pytest.mark.parametrize("entry", ["ok", 1, ["ranks"]], ids=["string", "number", "list"])
def test_an_engine_body_that_is_not_an_object_is_refused(entry):
    with pytest.raises(
        RuntimeError,
        match="^inference weight checksum reply of server group 0 engine 0 is malformed: Expected `object`",
    ):
        flatten_inference_engine_checksums([[entry]])


def test_more_than_ten_ranks_flatten_in_numeric_rank_order():
    ranks = [miles_rank(gpu, {"w": f"{gpu:02x}"}) for gpu in reversed(range(12))]
    [flattened] = flatten_inference_engine_checksums([[miles_body(success=True, ranks=ranks)]])
    assert list(flattened) == [f"rank{gpu}/w" for gpu in range(12)]
