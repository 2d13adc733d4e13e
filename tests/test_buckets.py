"""Weights as flat buckets: layout, packing, fingerprints equal to each tensor's own, the
fused segment kernel bit-identical to the CPU reference, modules moved into buckets."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miles_events.device import host_copy
from miles_events.device.buckets import (
    ALIGN_BYTES,
    Buckets,
    bucket_parameters,
    fingerprint_buckets,
    plan_layouts,
    require_finite_buckets,
)
from miles_events.device.fingerprint import fingerprints
from miles_events.device.host_copy import (
    DeviceArenaPool,
    PinnedPool,
    capture_point,
    copy_to_host,
    plan_chunks,
)
from miles_events.rl.finite import NonFiniteError
from miles_events.rl.hf_model import load_model, prepare_base_model
from schemas.config import BuiltinModelConfig, ModelConfig
from tests.support import torch_save_bytes

ROOT = Path(__file__).resolve().parent.parent


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Several dtypes, shapes whose bytes are not a multiple of 8 (padded words), an empty
    tensor and a scalar."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 11, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
        "q.bias": torch.randn(5, generator=gen),
        "empty": torch.zeros(0),
        "scale": torch.tensor(2.5),
        "counts": torch.arange(9, dtype=torch.int64),
        "mask": torch.tensor([1, 0, 1], dtype=torch.uint8),
        "head.weight": torch.randn(129, 7, generator=gen).to(torch.bfloat16),
    }


def test_every_tensor_starts_aligned_in_the_bucket_of_its_dtype_in_given_order():
    layouts = plan_layouts(mixed_tensors())
    assert [layout.dtype for layout in layouts] == ["bfloat16", "float32", "int64", "uint8"]
    assert [s.name for s in layouts[0].slots] == ["embed.weight", "norm.weight", "head.weight"]
    for layout in layouts:
        itemsize = getattr(torch, layout.dtype).itemsize
        for slot in layout.slots:
            assert (slot.offset * itemsize) % ALIGN_BYTES == 0
        ends = [s.offset + s.numel for s in layout.slots]
        assert all(end <= nxt.offset for end, nxt in zip(ends, layout.slots[1:], strict=False))
        assert (layout.numel * itemsize) % ALIGN_BYTES == 0 and layout.numel >= ends[-1]


def test_packed_buckets_view_every_tensor_with_its_values_and_zero_gaps():
    tensors = mixed_tensors()
    buckets = Buckets.of(tensors)
    views = buckets.tensors()
    assert list(views) == [s.name for layout in buckets.layouts for s in layout.slots]
    for name, tensor in tensors.items():
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor)
    assert all(gap.numel() == 0 or not gap.any() for gap in buckets._gaps())
    tensors["q.bias"].zero_()  # a copy was packed
    assert views["q.bias"].abs().sum() > 0
    assert buckets.tensor_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_packing_tensors_that_do_not_fit_the_layout_is_refused():
    buckets = Buckets.of(mixed_tensors())
    with pytest.raises(ValueError, match="do not fit"):
        buckets.pack({"embed.weight": torch.zeros(37, 11)})


def test_bucket_fingerprints_equal_each_tensors_own_with_the_skip_list():
    tensors = mixed_tensors()
    buckets = Buckets.of(tensors)
    assert fingerprint_buckets(buckets) == fingerprints(tensors)
    assert fingerprint_buckets(buckets, ["bias", "mask"]) == fingerprints(tensors, ["bias", "mask"])


def test_a_copy_between_buckets_of_one_layout_copies_every_tensor():
    target = Buckets.of(mixed_tensors(seed=0))
    source = Buckets.of(mixed_tensors(seed=1))
    target.copy_from(source)
    assert fingerprint_buckets(target) == fingerprints(mixed_tensors(seed=1))
    other = Buckets.of({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="layouts differ"):
        target.copy_from(other)


def test_non_finite_weights_in_a_bucket_are_named_and_refused():
    tensors = mixed_tensors()
    require_finite_buckets(Buckets.of(tensors), "weight version 1")
    tensors["head.weight"][3, 2] = float("nan")
    tensors["q.bias"][0] = float("inf")
    with pytest.raises(
        NonFiniteError, match=r"2 tensor\(s\) \(q.bias, head.weight\)|2 tensor\(s\) \(head.weight, q.bias\)"
    ):
        require_finite_buckets(Buckets.of(tensors), "weight version 1")


@pytest.mark.parametrize("tied", [False, True])
def test_a_modules_weights_moved_into_buckets_keep_its_values_outputs_and_ties(tmp_path: Path, tied: bool):
    config = ModelConfig(builtin=BuiltinModelConfig(tie_word_embeddings=tied))
    model = load_model(str(prepare_base_model(config, tmp_path, seed=5)), "float32").eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    before_state = {n: t.clone() for n, t in model.state_dict().items()}
    with torch.no_grad():
        before = model(ids).logits
    names = [n for n in before_state if not (tied and n == "lm_head.weight")]
    buckets = bucket_parameters(model, names)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    state = model.state_dict()
    assert all(torch.equal(state[n], before_state[n]) for n in before_state)
    bucket = buckets.buffers[0]
    for name in names:  # every weight now lives in the bucket
        assert state[name].untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    bucket.zero_()  # writing the bucket writes the module
    assert not any(p.any() for p in model.parameters())


INTERPRETED = textwrap.dedent(
    """
    import torch
    from miles_events.device import checksum_triton, fingerprint
    from miles_events.device.buckets import Buckets

    checksum_triton._multiprocessors = lambda device: 2  # no CUDA device in the interpreter
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(700, generator=gen).to(torch.bfloat16),
        "c": torch.randn(9001, generator=gen).to(torch.bfloat16),
        "d": torch.randn(1, generator=gen),
        "e": torch.randn(3000, generator=gen),
        "f": torch.randint(-2**62, 2**62, (600,), generator=gen),
    }
    buckets = Buckets.of(tensors)
    for layout, buffer in zip(buckets.layouts, buckets.buffers):
        for slots in (layout.slots, layout.slots[1:]):
            for block, per_job in ((64, 1), (128, 3)):
                sums = checksum_triton.segment_sums(
                    buffer, layout, slots, fingerprint.K1, fingerprint.K2, fingerprint.K3, block=block, tiles_per_job=per_job
                )
                expected = [fingerprint._mix_sum_numpy(fingerprint._words(tensors[s.name]).numpy()) for s in slots]
                assert sums == expected, (layout.dtype, block, per_job)
    words = fingerprint._words(tensors["c"])
    assert checksum_triton.mix_sum(words, fingerprint.K1, fingerprint.K2, fingerprint.K3, block=128) == (
        fingerprint._mix_sum_numpy(words.numpy())
    )
    print("bit-identical")
    """
)


def test_the_fused_segment_kernel_is_bit_identical_to_the_cpu_reference_in_tritons_interpreter():
    """The kernel's own code, run by Triton's CPU interpreter: whole and partial tiles,
    several tensors per program, a subset of a bucket's tensors."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0 and "bit-identical" in done.stdout, done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bucket_fingerprints_on_cuda_equal_the_cpu_ones():
    tensors = {**mixed_tensors(), "big": torch.randn(3 * 4096 * 8 + 13).to(torch.bfloat16)}
    cuda = Buckets.of({n: t.cuda() for n, t in tensors.items()})
    assert fingerprint_buckets(cuda) == fingerprints(tensors)
    assert fingerprint_buckets(cuda, ["big"]) == fingerprints(tensors, ["big"])


# --- host copies -----------------------------------------------------------------------------


def test_a_host_copy_of_cpu_state_is_the_state_itself() -> None:
    state = {"weights": Buckets.of({"a": torch.ones(3)}), "optimizer": {"state": [torch.zeros(2)], "lr": 0.1}}
    assert copy_to_host(state) == (state, None)
    assert capture_point(torch.device("cpu")) is None


def test_a_pinned_pool_pins_an_arena_once_and_every_later_save_of_the_same_state_reuses_it() -> None:
    pool = PinnedPool(pin=False)  # the same bookkeeping, in pageable memory
    state = [torch.ones(3, 5), torch.zeros(7, dtype=torch.bfloat16), torch.ones(100)]
    arena = pool.take(state)
    hosts = [arena.carve(t) for t in state]
    assert [(h.shape, h.dtype) for h in hosts] == [(t.shape, t.dtype) for t in state]
    assert pool.take(state) is not arena, "in use until given back: another is pinned"
    pool.give_back(arena)
    again = pool.take(state)
    assert again is arena and pool.num_pinned == 2
    assert again.carve(state[0]).data_ptr() == hosts[0].data_ptr(), "carving starts over"
    pool.give_back(again)
    assert pool.take([torch.ones(3, 5)]) is not arena, "an arena serves a state of its own shapes only"


def test_a_pinned_pool_prepares_an_arena_ahead_that_the_save_of_that_state_takes() -> None:
    pool = PinnedPool(pin=False)
    state = [torch.ones(3, 5), torch.zeros(7, dtype=torch.bfloat16)]
    signature = pool.reserve(state)
    assert signature is not None and pool.reserve(state) is None, "claimed already"
    pool.prepare(signature)
    assert pool.reserve(state) is None and pool.num_pinned == 1, "one idle already"
    arena = pool.take(state)
    assert pool.num_pinned == 1 and arena.signature == (((3, 5), torch.float32), ((7,), torch.bfloat16))
    pool.give_back(arena)
    other = pool.take([torch.ones(4)])  # the state's shapes changed: the idle arena goes
    assert pool.num_pinned == 2 and pool._idle == []
    pool.give_back(other)
    assert pool.reserve(state) is None, "a state was taken already: saves pin their own"


def test_a_save_taking_an_arena_while_it_is_prepared_waits_for_it_rather_than_pinning_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    pool = PinnedPool(pin=False)
    state = [torch.ones(3, 5)]
    finish = threading.Event()
    make = pool._arena
    monkeypatch.setattr(pool, "_arena", lambda signature: finish.wait(10) and make(signature))
    signature = pool.reserve(state)  # on the caller's thread: a take from now on waits
    assert signature is not None
    taken: list[Any] = []
    taking = threading.Thread(target=lambda: taken.append(pool.take(state)))
    taking.start()
    for _ in range(1000):
        if pool._lock._waiters:  # type: ignore[attr-defined]
            break
        time.sleep(0.01)
    assert pool._lock._waiters, "the save waits for the arena claimed"  # type: ignore[attr-defined]
    preparing = threading.Thread(target=pool.prepare, args=(signature,))
    preparing.start()
    finish.set()
    preparing.join(10)
    taking.join(10)
    assert len(taken) == 1 and pool.num_pinned == 1 and pool._idle == []


def test_an_arena_prepared_for_shapes_no_longer_taken_or_after_the_pool_closed_is_dropped() -> None:
    pool = PinnedPool(pin=False)
    old = pool.reserve([torch.ones(2)])
    assert old is not None
    pool.take([torch.ones(3)])  # a save of other shapes came first: it pinned its own
    pool.prepare(old)
    assert pool._idle == []
    closed = PinnedPool(pin=False)
    signature = closed.reserve([torch.ones(2)])
    assert signature is not None
    closed.close()
    closed.prepare(signature)
    assert closed._idle == [] and closed.reserve([torch.ones(2)]) is None


def test_an_arena_that_fails_to_be_prepared_is_pinned_by_the_save(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = PinnedPool(pin=False)
    make = pool._arena

    def refused(signature: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pool, "_arena", refused)
    signature = pool.reserve([torch.ones(2)])
    assert signature is not None
    with pytest.raises(OSError, match="allocate"):
        pool.prepare(signature)
    monkeypatch.setattr(pool, "_arena", make)
    assert pool.take([torch.ones(2)]).signature == (((2,), torch.float32),) and pool.num_pinned == 1


@pytest.mark.parametrize("memory", ["memory file", "out of memory for it", "no memory files"])
def test_an_arena_is_one_zeroed_block_its_tensors_aligned_in_it_and_alive_without_it(
    memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pages allocated up front in a memory file, or anonymous memory where that fails;
    each tensor at an aligned offset of the one mapping, zeroed."""
    import errno
    import gc
    import os

    from miles_events.device import host_copy

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if memory == "out of memory for it":
        monkeypatch.setattr(os, "posix_fallocate", no_room)
    if memory == "no memory files":
        monkeypatch.delattr(os, "memfd_create", raising=False)
    state = [
        torch.ones(3, 5),
        torch.zeros(7, dtype=torch.bfloat16),
        torch.ones(0),
        torch.ones(1000, dtype=torch.float64),
    ]
    offsets, num_bytes = host_copy.block_offsets([(tuple(t.shape), t.dtype) for t in state])
    assert offsets == [0, 4096, 8192, 8192] and num_bytes == 8192 + 8192
    arena = PinnedPool(pin=False).take(state)
    assert arena.block is not None and arena.block.num_bytes == num_bytes
    assert [t.data_ptr() - arena.block.address for t in arena.tensors if t.numel()] == [0, 4096, 8192]
    assert all(not t.any() for t in arena.tensors)
    last = arena.carve(state[0]).fill_(2)
    del arena
    gc.collect()
    assert torch.equal(last, torch.full((3, 5), 2.0)), "a tensor keeps its block's memory"


def _kernel_populates() -> bool:
    """Whether this kernel knows ``MADV_POPULATE_WRITE`` (Linux 5.14 on)."""
    import mmap

    probe = mmap.mmap(-1, 4096)
    start = ctypes.c_char.from_buffer(probe)
    known = host_copy._libc().madvise(ctypes.addressof(start), 4096, host_copy.MADV_POPULATE_WRITE) == 0
    del start
    probe.close()
    return known


@pytest.mark.parametrize("advice", ["populate", "unknown to the kernel"])
def test_a_blocks_page_tables_are_filled_range_by_range(advice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapped without MAP_POPULATE, whose one call holds the process's memory-map lock
    throughout: its pages are mapped a range at a time (the mapping's resident set is the
    whole block); where the kernel knows no such advice, the block still works."""
    monkeypatch.setattr(host_copy, "POPULATE_BYTES", 1 << 20)
    if advice == "unknown to the kernel":
        monkeypatch.setattr(host_copy, "MADV_POPULATE_WRITE", 10_000)
    elif not _kernel_populates():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14)")
    libc, calls = host_copy._libc(), []

    def madvise(address: int, length: int, kind: int) -> int:
        calls.append(length)
        return libc.madvise(address, length, kind)

    monkeypatch.setattr(host_copy, "_libc", lambda: SimpleNamespace(madvise=madvise))
    block = host_copy.HostBlock((5 << 20) + 4096, pin=False)
    assert calls == ([1 << 20] * 5 + [4096] if advice == "populate" else [1 << 20])

    def resident_kib() -> int:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{block.address:x}-"))
        return next(int(line.split()[1]) for line in lines[start + 1 :] if line.startswith("Rss:"))

    assert resident_kib() == (block.num_bytes >> 10 if advice == "populate" else 0)
    tensor = block.tensor(0, (block.num_bytes,), torch.uint8)
    assert not tensor.any()
    tensor.fill_(7)
    assert resident_kib() == block.num_bytes >> 10


def test_a_device_arena_pool_makes_its_arenas_on_its_device_and_reuses_them() -> None:
    pool = DeviceArenaPool(torch.device("cpu"))  # the bookkeeping; on a GPU, CUDA memory
    state = [torch.ones(3, 5), torch.zeros(7, dtype=torch.bfloat16)]
    arena = pool.take(state)
    assert [(t.device.type, t.shape, t.dtype) for t in arena.tensors] == [
        ("cpu", t.shape, t.dtype) for t in state
    ]
    assert not arena.tensors[0].is_pinned()
    pool.give_back(arena)
    assert pool.take(state) is arena and pool.num_pinned == 1
    other = pool.take(state)  # two saves at once: a second arena
    pool.give_back(arena)
    pool.give_back(other)
    assert pool.take(state) is other and pool.take(state) is not arena, "one arena kept idle, not both"


def test_each_host_copy_owns_its_memory_so_a_saved_state_holds_its_own_bytes_alone() -> None:
    # torch.save writes a view's whole storage: copies carved from one shared buffer would
    # carry each other's bytes (the weights' in the optimizer's file) into every file.
    weights = [torch.randn(64, 32), torch.randn(32)]
    optimizer = {"state": {0: {"exp_avg": torch.randn(64, 32), "step": torch.tensor(2.0)}}}
    arena = PinnedPool(pin=False).take([*weights, optimizer["state"][0]["exp_avg"]])
    for tensor in weights:
        arena.carve(tensor)
    exp_avg = arena.carve(optimizer["state"][0]["exp_avg"])
    assert exp_avg.untyped_storage().nbytes() == exp_avg.numel() * exp_avg.element_size()
    carved = {
        "state": {0: {"exp_avg": exp_avg.copy_(optimizer["state"][0]["exp_avg"]), "step": torch.tensor(2.0)}}
    }
    assert len(torch_save_bytes(carved)) == len(torch_save_bytes(optimizer))


def test_a_host_copy_is_queued_in_chunks_of_at_most_the_chunk_size_in_order() -> None:
    # (elements, bytes an element): 10 floats, 3 bf16, nothing, 1 piece of 40 bytes.
    chunks = plan_chunks([(10, 4), (3, 2), (0, 2), (1, 40)], chunk_bytes=16)
    assert chunks == [
        [(0, 0, 4)],
        [(0, 4, 8)],
        [(0, 8, 10), (1, 0, 3)],  # 8 + 6 bytes: no room left for a 40-byte piece
        [(3, 0, 1)],  # larger than a chunk: one chunk of its own
    ]
    covered = {i: [] for i in range(4)}
    for chunk in chunks:
        for index, start, end in chunk:
            covered[index].append((start, end))
    assert covered == {0: [(0, 4), (4, 8), (8, 10)], 1: [(0, 3)], 2: [], 3: [(0, 1)]}
    assert plan_chunks([(5, 4)], chunk_bytes=1 << 20) == [[(0, 0, 5)]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_copy_in_chunks_copies_every_byte_of_large_and_strided_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_copy, "CHUNK_BYTES", 1 << 16)
    big = torch.randn(1 << 20, device="cuda")  # 4 MB: 64 chunks
    strided = torch.randn(300, 200, device="cuda").t()  # copied whole
    state = {"big": big, "strided": strided, "small": torch.arange(7, device="cuda", dtype=torch.bfloat16)}
    copied, arena = copy_to_host(state, capture_point(big.device), PinnedPool())
    assert arena is not None
    for name, tensor in state.items():
        assert copied[name].is_pinned() and torch.equal(copied[name], tensor.cpu()), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_host_copy_takes_the_state_at_its_capture_point_into_pinned_memory() -> None:
    weights = Buckets.of({"a": torch.randn(1 << 20, device="cuda"), "b": torch.randn(7, 3, device="cuda")})
    optimizer = {
        "state": {0: {"exp_avg": torch.randn(5, device="cuda"), "step": torch.tensor(3.0)}},
        "lr": 0.1,
    }
    expected = (tuple(2 * b.cpu() for b in weights.buffers), detached_cpu(optimizer))
    for buffer in weights.buffers:  # still being written on the trainer's stream when captured
        torch.cuda._sleep(50_000_000)
        buffer.mul_(2)
    ready = capture_point(weights.device)
    pool = PinnedPool()
    (host_weights, host_optimizer), arena = copy_to_host((weights, optimizer), ready, pool)
    assert host_weights.layouts == weights.layouts
    for got, want in zip(host_weights.buffers, expected[0], strict=True):
        assert got.device.type == "cpu" and got.is_pinned()
        assert torch.equal(got, want)  # the copy stream waited for the writes before the capture point
    assert torch.equal(host_optimizer["state"][0]["exp_avg"], expected[1]["state"][0]["exp_avg"])
    assert host_optimizer["state"][0]["step"] is optimizer["state"][0]["step"]  # CPU tensors as they are
    assert host_optimizer["lr"] == 0.1
    # The next save copies into the same pinned memory once this one is given back.
    assert arena is not None
    pool.give_back(arena)
    (again, _), reused = copy_to_host((weights, optimizer), capture_point(weights.device), pool)
    assert reused is arena and pool.num_pinned == 1
    assert again.buffers[0].data_ptr() == host_weights.buffers[0].data_ptr()
    assert torch.equal(again.buffers[0], expected[0][0])


def detached_cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: detached_cpu(v) for k, v in obj.items()}
    return obj
