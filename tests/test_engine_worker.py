"""An engine rank at start: the tensors its engine cannot read back in the trainer's layout
must be left out of the digests (``verifier.skip_tensor_list``), or the run stops there,
before the first publication, with one line naming them and the setting."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest

from actors.engine.worker import EngineWorker, UnverifiableTensors, check_readback
from miles_events.bus.workers import RankPlace
from schemas.config import Config, GeneratorConfig, RunConfig, VerifierConfig

REPACKED = [
    f"model.layers.{layer}.{module}.weight"
    for layer in range(2)
    for module in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj")
]


class PartialReadback:
    """An engine whose served ``REPACKED`` tensors cannot be read back (as vLLM on CPU)."""

    name = "engine-0"
    metrics_url = None

    def __init__(self) -> None:
        self.closed = False

    def unreadable_tensors(self) -> list[str]:
        return list(REPACKED)

    def close(self) -> None:
        self.closed = True


def run_config(tmp_path: Path, **verifier: object) -> Config:
    return Config(
        run=RunConfig(dir=str(tmp_path), runtime="local"),
        generator=GeneratorConfig(engine="vllm"),
        verifier=VerifierConfig(**verifier),  # type: ignore[arg-type]
    )


def test_an_engine_whose_unreadable_tensors_are_not_skipped_stops_the_rank_naming_them_and_the_fix(tmp_path: Path):
    with pytest.raises(UnverifiableTensors) as caught:
        EngineWorker(run_config(tmp_path), PartialReadback(), RankPlace(0, 1, tmp_path))  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "engine-0 (vllm) cannot read back 10 of the tensors it serves in the trainer's layout "
        "(model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.gate_proj.weight, "
    ), message
    assert "(+" in message and "more)" in message, "a few named, the count of the rest"
    assert message.endswith(
        "so no publication's digests could match; set verifier.skip_tensor_list = [\"proj.weight\"] "
        "(the behavioural probe, verifier.probe = \"auto\", then proves the skipped tensors)"
    ), message


def test_the_suggested_skip_list_keeps_what_is_skipped_already_and_adds_what_is_missing():
    verifier = VerifierConfig(skip_tensor_list=["norm", "down_proj"])
    with pytest.raises(UnverifiableTensors, match=r'verifier.skip_tensor_list = \["norm", "down_proj", "proj.weight"\]'):
        check_readback("engine-1", "vllm", REPACKED, verifier)
    with pytest.raises(UnverifiableTensors, match=r'= \["fc1.weight", "fc2.weight"\]') as caught:
        check_readback("engine-1", "vllm", ["model.layers.0.fc2.weight", "model.layers.0.fc1.weight"], VerifierConfig())
    assert "cannot read back 2 of the tensors" in str(caught.value)


def test_skipped_unreadable_tensors_pass_and_so_does_a_run_that_verifies_nothing():
    check_readback("engine-0", "vllm", REPACKED, VerifierConfig(skip_tensor_list=["proj.weight"]))
    check_readback("engine-0", "vllm", REPACKED, VerifierConfig(enabled=False))
    check_readback("engine-0", "torch", [], VerifierConfig())


def test_skipped_tensors_the_probe_does_not_prove_either_are_said_to_be_unverified(caplog: pytest.LogCaptureFixture):
    verifier = VerifierConfig(skip_tensor_list=["proj.weight"], probe="off")
    with caplog.at_level(logging.WARNING, logger="actors.engine.worker"):
        check_readback("engine-0", "vllm", REPACKED, verifier)
    [record] = caplog.records
    assert record.getMessage().startswith(
        'engine-0: 10 tensors are neither in the digests (verifier.skip_tensor_list) nor probed '
        '(verifier.probe = "off"): '
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actors.engine.worker"):
        check_readback("engine-0", "vllm", REPACKED, msgspec.structs.replace(verifier, probe="auto"))
    assert not caplog.records
