"""Tensor fingerprints: equal bytes agree, any changed byte disagrees, on every code path."""

from __future__ import annotations

import pytest
import torch

from miles_events.rl import checksum
from miles_events.rl.checksum import checksums_digest, fingerprints, tensor_fingerprint


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
    words = checksum._words(tensor)
    assert checksum._mix_sum_numpy(words.numpy()) == checksum._mix_sum_torch(words)


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
    assert checksums_digest(sums) == checksums_digest(dict(reversed(list(sums.items()))))
    assert checksums_digest(sums) != checksums_digest({**sums, "b.bias": "0" * 16})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fingerprints_equal_cpu_fingerprints():
    for t in (torch.randn(4097, 333), torch.randn(1 << 20).to(torch.bfloat16), torch.arange(70_001)):
        words = checksum._words(t.cuda())
        expected = checksum._mix_sum_numpy(checksum._words(t).numpy())
        assert checksum._mix_sum_torch(words) == expected
        fused = checksum._triton_mix_sum()
        if fused is not None:
            assert fused(words, checksum._K1, checksum._K2, checksum._K3) == expected
        assert tensor_fingerprint(t.cuda()) == tensor_fingerprint(t)
