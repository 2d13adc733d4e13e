"""A weight load that lands between the decode steps of a generation in progress
(``rollout.partial``): it waits for a step boundary, the requests in flight go on with the
new weights, and each completion says from which token on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from actors.engine.base import SamplingParams
from actors.engine.in_flight import InFlightUpdates
from actors.engine.torch_engine import TorchEngine

PROMPTS = ["3+4=", "12*3=", "9-", "7*8+1="]


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_load_waits_for_the_decode_loop_to_reach_a_step_boundary_and_generation_waits_for_a_load():
    updates = InFlightUpdates()
    order: list[str] = []

    def load() -> None:
        with updates.loading():
            order.append("load")

    with updates.generating():
        loader = threading.Thread(target=load)
        loader.start()
        wait_until(lambda: updates._waiting == 1)
        order.append("step 1")  # the load does not run during a step
        assert updates.boundary()  # it runs here, while the loop is parked
        order.append("step 2")
        assert not updates.boundary()  # nothing waiting: the loop goes on at once
    loader.join()
    assert order == ["step 1", "load", "step 2"]


@pytest.fixture
def eager(model_dir: Path) -> TorchEngine:
    return TorchEngine.from_pretrained(model_dir, max_batch_size=8, decode="eager")


def test_a_publication_mid_generation_lands_between_two_decode_steps_and_tokens_keep_their_version(eager):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    new_weights = {name: t + 0.05 for name, t in eager.served_tensors().items()}
    before = eager.generate(PROMPTS, sampling, torch.Generator().manual_seed(7))
    assert all(c.version_spans == [] and c.weight_version == "default" for c in before)

    boundary, calls = eager.updates.boundary, []

    def load() -> None:
        with eager.in_flight_load():
            eager.load_tensors(new_weights, "1")

    def boundary_with_a_load_waiting_at_the_third() -> bool:
        calls.append(1)
        if len(calls) == 3:
            threading.Thread(target=load).start()
            wait_until(lambda: eager.updates._waiting == 1)
        return boundary()

    eager.updates.boundary = boundary_with_a_load_waiting_at_the_third  # type: ignore[method-assign]
    during = eager.generate(PROMPTS, sampling, torch.Generator().manual_seed(7))
    wait_until(lambda: eager.weight_version == "1")
    # Boundaries come before the forward of steps 1, 2, 3: the third's tokens on are "1".
    assert all(c.version_spans == [(0, "default"), (3, "1")] for c in during)
    assert [c.response_ids[:3] for c in during] == [c.response_ids[:3] for c in before]
    assert [c.response_ids for c in during] != [c.response_ids for c in before]
