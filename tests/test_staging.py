"""The staging pool: a publication's buckets are reused once its readers are done, never before."""

from __future__ import annotations

import pytest
import torch

from miles_events.device.buckets import Buckets, plan_layouts
from miles_events.device.staging import IDLE_PER_LAYOUT, StagingPool

LAYOUTS = plan_layouts({"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)})
CPU = torch.device("cpu")


def test_buckets_given_back_are_taken_again_for_the_same_layouts_and_device() -> None:
    pool = StagingPool()
    first = pool.take(LAYOUTS, CPU)
    pool.lend("weights-v1", first)
    pool.give_back("weights-v1")
    again = pool.take(LAYOUTS, CPU)
    assert again is first and pool.num_allocated == 1
    other = pool.take(plan_layouts({"w": torch.zeros(2)}), CPU)
    assert other is not first and pool.num_allocated == 2


def test_buckets_lent_or_forgotten_are_never_taken() -> None:
    pool = StagingPool()
    lent = pool.take(LAYOUTS, CPU)
    pool.lend("weights-v1", lent)
    assert pool.take(LAYOUTS, CPU) is not lent  # its readers have not said they are done
    pool.forget("weights-v1")
    pool.give_back("weights-v1")  # a late release of what was forgotten changes nothing
    assert pool.num_allocated == 2 and pool.take(LAYOUTS, CPU) is not lent


def test_gaps_between_tensors_are_zero_and_few_idle_buckets_are_kept() -> None:
    pool = StagingPool()
    taken = [pool.take(LAYOUTS, CPU) for _ in range(IDLE_PER_LAYOUT + 1)]
    for number, buckets in enumerate(taken):
        assert isinstance(buckets, Buckets) and all(not gap.any() for gap in buckets._gaps())
        pool.lend(f"weights-v{number}", buckets)
    for number in range(len(taken)):
        pool.give_back(f"weights-v{number}")
    kept = {id(pool.take(LAYOUTS, CPU)) for _ in range(IDLE_PER_LAYOUT + 1)}
    assert len(kept & {id(b) for b in taken}) == IDLE_PER_LAYOUT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_buckets_asked_for_on_cuda_are_taken_again_on_its_current_device() -> None:
    pool = StagingPool()
    first = pool.take(LAYOUTS, "cuda")
    pool.lend("weights-v1", first)
    pool.give_back("weights-v1")  # the buffers say cuda:0
    assert pool.take(LAYOUTS, torch.device("cuda")) is first and pool.num_allocated == 1


class Read:
    """A reader's event as the pool asks it: ``query``, or raising where its process is gone."""

    def __init__(self, done: bool | None) -> None:
        self.done = done

    def query(self) -> bool:
        if self.done is None:
            raise RuntimeError("CUDA error: invalid resource handle")
        return self.done


def test_buckets_given_back_with_reads_still_running_are_taken_only_once_those_have_run() -> None:
    pool = StagingPool()
    first = pool.take(LAYOUTS, CPU)
    pool.lend("weights-v1", first)
    read = Read(done=False)
    pool.give_back("weights-v1", [Read(done=True), read])
    assert pool.take(LAYOUTS, CPU) is not first and pool.num_allocated == 2
    read.done = True
    assert pool.take(LAYOUTS, CPU) is first and pool.num_allocated == 2


def test_buckets_whose_read_cannot_be_asked_are_never_taken_again() -> None:
    pool = StagingPool()
    first = pool.take(LAYOUTS, CPU)
    pool.lend("weights-v1", first)
    read = Read(done=None)
    pool.give_back("weights-v1", [read])
    assert pool.take(LAYOUTS, CPU) is not first
    read.done = True
    assert pool.take(LAYOUTS, CPU) is not first and pool.num_allocated == 3


def test_buckets_whose_reads_never_end_give_way_to_those_given_back_after_them() -> None:
    pool = StagingPool()
    sets = [pool.take(LAYOUTS, CPU) for _ in range(IDLE_PER_LAYOUT + 1)]
    for number, buckets in enumerate(sets):
        pool.lend(f"weights-v{number}", buckets)
    pool.give_back("weights-v0", [Read(done=False)])  # a reader that never gets to run its copy
    for number in range(1, len(sets)):
        pool.give_back(f"weights-v{number}")
    taken = [pool.take(LAYOUTS, CPU) for _ in range(IDLE_PER_LAYOUT)]
    assert taken == sets[:0:-1] and pool.num_allocated == len(sets)
