"""Tensor fingerprints: equal bytes agree, any changed byte disagrees, on every code path."""

from __future__ import annotations

import msgspec
import pytest
import torch

from actors.engine.vllm_engine import WorkerChecksums, worker_checksums
from miles_events.device import fingerprint
from miles_events.device.fingerprint import fingerprints, tensor_fingerprint
from miles_events.rl.checksum import (
    ChecksumReplyError,
    checksum_order,
    per_engine_checksum,
    per_gpu_checksum,
    rank_of,
    ranked_checksums,
    report_checksums,
)
from schemas.checksums import EngineChecksumReport, ParallelismInfo, RankChecksums


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(1000, 70),
        torch.randn(7),
        torch.arange(200_003, dtype=torch.int64),
        torch.randn(3, 5).to(torch.bfloat16),
        torch.zeros(0),
        torch.randn((1 << 16) + 3),  # crosses a chunk boundary
    ],
)
def test_the_cpu_and_device_code_paths_agree(tensor):
    words = fingerprint._words(tensor)
    assert fingerprint._mix_sum_numpy(words.numpy()) == fingerprint._mix_sum_torch(words)


def test_a_copy_has_the_same_fingerprint():
    t = torch.randn(300, 300)
    assert tensor_fingerprint(t) == tensor_fingerprint(t.clone())
    assert len(tensor_fingerprint(t)) == 16 and int(tensor_fingerprint(t), 16) >= 0


@pytest.mark.parametrize("index", [0, 12345, (1 << 16) - 1, 1 << 16, 99_999])
def test_one_flipped_bit_anywhere_changes_the_fingerprint(index):
    t = torch.randn(100_000)
    flipped = t.clone()
    flipped.view(torch.int32)[index] ^= 1
    assert tensor_fingerprint(t) != tensor_fingerprint(flipped)


def test_swapped_elements_change_the_fingerprint():
    t = torch.arange(10, dtype=torch.float32)
    swapped = t.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    assert tensor_fingerprint(t) != tensor_fingerprint(swapped)


def test_dtype_and_shape_are_part_of_the_fingerprint():
    t = torch.randn(4, 6)
    assert tensor_fingerprint(t) != tensor_fingerprint(t.reshape(6, 4))
    assert tensor_fingerprint(t) != tensor_fingerprint(t.view(torch.int32))


def test_non_contiguous_tensors_are_fingerprinted_by_their_values():
    t = torch.randn(5, 8)
    assert tensor_fingerprint(t.t()) == tensor_fingerprint(t.t().contiguous())


def test_skip_list_and_order_independent_digest():
    tensors = {"a.weight": torch.ones(2), "visual.proj": torch.zeros(2), "b.bias": torch.ones(3)}
    sums = fingerprints(tensors, skip_tensor_list=["visual"])
    assert set(sums) == {"a.weight", "b.bias"}
    assert per_gpu_checksum(sums) == per_gpu_checksum(dict(reversed(list(sums.items()))))
    assert per_gpu_checksum(sums) != per_gpu_checksum({**sums, "b.bias": "0" * 16})


# Computed by hand, outside Python:
#   printf '%s' 'a.weight0000000000000001b.bias00000000000000ff' | sha256sum
#   printf '%s' <that digest> | sha256sum ;  printf '%s%s' <that digest> <sha256 of ""> | sha256sum
PER_GPU = "8fb6d1075a96a01035d3a6c91799e8ee9f0857ec4660c5b679418c4671f6972b"
EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_per_gpu_checksum_is_sglangs_definition():
    """sha256 over name + hex of every tensor in sorted name order, no separators."""
    assert per_gpu_checksum({"b.bias": "00000000000000ff", "a.weight": "0000000000000001"}) == PER_GPU
    assert per_gpu_checksum({}) == EMPTY
    # Names sort by code point, as Python's sorted() in SGLang does.
    assert (
        per_gpu_checksum(
            {"model.embed_tokens.weight": "0123456789abcdef", "lm_head.weight": "fedcba9876543210"}
        )
        == "57e72479daf2127d2c04676e5a673017e578f65ec92018ec230261af13517c06"
    )


def test_per_engine_checksum_is_sglangs_definition():
    """sha256 over the per-GPU checksums joined in TP-rank order, no separators."""
    assert (
        per_engine_checksum([PER_GPU]) == "abafd10f3b3a7c3cde530157d00f89b8499750593ee6aba044df204a99673020"
    )
    assert (
        per_engine_checksum([PER_GPU, EMPTY])
        == "13d6f2aa92051c2b2b575240df89302c9270d00bc17155744657e3b3297299c8"
    )
    assert per_engine_checksum([EMPTY, PER_GPU]) != per_engine_checksum([PER_GPU, EMPTY])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fingerprints_equal_cpu_fingerprints():
    for t in (torch.randn(4097, 333), torch.randn(1 << 20).to(torch.bfloat16), torch.arange(70_001)):
        words = fingerprint._words(t.cuda())
        expected = fingerprint._mix_sum_numpy(fingerprint._words(t).numpy())
        assert fingerprint._mix_sum_torch(words) == expected
        fused = fingerprint._triton_mix_sum()
        if fused is not None:
            assert fused(words, fingerprint.K1, fingerprint.K2, fingerprint.K3) == expected
        assert tensor_fingerprint(t.cuda()) == tensor_fingerprint(t)


SGLANG_REPLY = {
    "success": True,
    "message": "ok",
    "per_engine_checksum": "e" * 64,
    "ranks": [
        {
            "checksums": {"w": "1" * 16},
            "per_gpu_checksum": "a" * 64,
            "parallelism_info": {
                "tp_rank": 0,
                "tp_size": 2,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": 0,
                "size": 2,
            },
        },
        {
            "checksums": {"w": "2" * 16},
            "per_gpu_checksum": "b" * 64,
            "parallelism_info": [
                {"role": "target", "rank": 1, "size": 2, "tp_rank": 1, "tp_size": 2},
                {"role": "draft", "rank": 1, "size": 2, "tp_rank": 1, "tp_size": 2},
            ],
        },
    ],
    "some_newer_field": 1,
}


def test_both_sglang_parallelism_info_shapes_decode_and_flatten_by_gpu_rank():
    report = msgspec.json.decode(msgspec.json.encode(SGLANG_REPLY), type=EngineChecksumReport)
    assert [rank_of(rank) for rank in report.ranks] == [0, 1]
    assert report_checksums(report) == {"rank0/w": "1" * 16, "rank1/w": "2" * 16}


def test_one_rank_keeps_plain_names_and_a_failed_reply_is_an_error():
    one = EngineChecksumReport(
        success=True, ranks=[RankChecksums(checksums={"w": "1" * 16}, per_gpu_checksum="")]
    )
    assert report_checksums(one) == {"w": "1" * 16}
    with pytest.raises(ValueError, match="failed: busy"):
        report_checksums(EngineChecksumReport(success=False, message="busy"))
    with pytest.raises(ValueError, match="no ranks"):
        report_checksums(EngineChecksumReport(success=True))
    two_ranks = RankChecksums(
        checksums={}, per_gpu_checksum="", parallelism_info=[ParallelismInfo(rank=0), ParallelismInfo(rank=1)]
    )
    with pytest.raises(ValueError, match=r"2 GPU ranks \(\[0, 1\]\) across its roles, expected one GPU rank"):
        rank_of(two_ranks)


def ranked_report(*ranks: tuple[int, dict[str, str]]) -> EngineChecksumReport:
    """A successful reply of ranks (GPU rank, checksums), in the order given."""
    return EngineChecksumReport(
        success=True,
        ranks=[
            RankChecksums(
                checksums=sums,
                per_gpu_checksum=per_gpu_checksum(sums),
                parallelism_info=ParallelismInfo(rank=gpu),
            )
            for gpu, sums in ranks
        ],
    )


@pytest.mark.parametrize("parse", [report_checksums, ranked_checksums])
@pytest.mark.parametrize(
    "second",
    [{"w": "1" * 16}, {"w": "2" * 16}, {"v": "1" * 16}],
    ids=["same tensors", "other checksums", "other tensors"],
)
def test_a_report_that_repeats_a_rank_is_refused(parse, second):
    with pytest.raises(ChecksumReplyError, match="^the checksum reply reports rank 0 twice$"):
        parse(ranked_report((0, {"w": "1" * 16}), (1, {"w": "3" * 16}), (0, second)))


@pytest.mark.parametrize("parse", [report_checksums, ranked_checksums])
@pytest.mark.parametrize(
    "ranks", [[(0, {})], [(0, {"w": "1" * 16}), (1, {})]], ids=["its only rank", "one of two"]
)
def test_a_report_rank_without_tensors_is_refused(parse, ranks):
    gpu = ranks[-1][0]
    with pytest.raises(ChecksumReplyError, match=f"^rank {gpu} of the checksum reply has no tensors$"):
        parse(ranked_report(*ranks))


@pytest.mark.parametrize("parse", [report_checksums, ranked_checksums])
def test_a_failed_or_rankless_report_is_a_checksum_reply_error(parse):
    with pytest.raises(ChecksumReplyError, match="^the checksum action failed: busy$"):
        parse(EngineChecksumReport(success=False, message="busy"))
    with pytest.raises(ChecksumReplyError, match="^the checksum reply has no ranks$"):
        parse(EngineChecksumReport(success=True))


def test_a_rank_whose_roles_disagree_is_refused_naming_its_entry():
    roles = RankChecksums(
        checksums={"w": "1" * 16},
        per_gpu_checksum="",
        parallelism_info=[ParallelismInfo(rank=1), ParallelismInfo(rank=2)],
    )
    report = EngineChecksumReport(success=True, ranks=[*ranked_report((0, {"w": "1" * 16})).ranks, roles])
    with pytest.raises(
        ChecksumReplyError, match=r"^rank entry 1 of the checksum reply: parallelism_info names 2 GPU ranks"
    ):
        ranked_checksums(report)


@pytest.mark.parametrize("parse", [report_checksums, ranked_checksums])
def test_ranks_that_arrive_out_of_order_are_flattened_in_rank_order(parse):
    order = [3, 10, 0, 2, 11, 1]
    flattened = parse(ranked_report(*((gpu, {"w": f"{gpu:016x}"}) for gpu in order)))
    assert list(flattened) == [f"rank{gpu}/w" for gpu in sorted(order)]


def test_checksum_order_puts_ranks_in_numeric_order_and_other_names_by_name():
    names = ["rank10/a", "rank2/b", "rank2/a", "rank0/z"]
    assert sorted(names, key=checksum_order) == ["rank0/z", "rank2/a", "rank2/b", "rank10/a"]
    assert sorted(["b", "a", "c"], key=checksum_order) == ["a", "b", "c"]


# --- vLLM: the worker extension's answer to ``miles_checksums`` over ``/collective_rpc`` ----------


def test_the_vllm_workers_checksum_answer_is_its_readable_and_unreadable_tensors():
    answer = [{"checksums": {"w": "1" * 16}, "unreadable": ["proj.weight"]}]
    assert worker_checksums(answer) == WorkerChecksums(checksums={"w": "1" * 16}, unreadable=["proj.weight"])


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ([], "the worker extension gave no checksums (0 answers)"),
        (
            [{"checksums": {"w": "1" * 16}, "unreadable": []}] * 2,
            "the worker extension answered from 2 workers, one was expected",
        ),
        (["oops"], "the worker extension's checksum answer is malformed: Expected `object`, got `str`"),
        (
            [{"checksums": {"w": 1}, "unreadable": []}],
            "the worker extension's checksum answer is malformed: Expected `str`, got `int` - at `$.checksums[...]`",
        ),
        (
            [{"checksums": {"w": "1" * 16}}],
            "the worker extension's checksum answer is malformed: Object missing required field `unreadable`",
        ),
    ],
    ids=["none", "two workers", "not an object", "not a fingerprint", "no unreadable list"],
)
def test_a_vllm_workers_checksum_answer_that_cannot_be_used_is_refused(results, message):
    with pytest.raises(ChecksumReplyError) as raised:
        worker_checksums(results)
    assert str(raised.value) == message
