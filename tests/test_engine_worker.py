"""An engine rank at start: the tensors its engine cannot read back in the trainer's layout
must be left out of the digests (``verifier.skip_tensor_list``), or the run stops there,
before the first publication, with one line naming them and the setting. A rank's load and
checks answer with the event the Generator publishes, less the header the bus stamps."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import msgspec
import pytest

from actors.engine.base import single_rank_report
from actors.engine.worker import EngineWorker, UnverifiableTensors, check_readback
from miles_events.bus.workers import RankPlace
from miles_events.rl.checksum import per_gpu_checksum
from schemas.checksums import EngineChecksumReport, WeightsCheckResult
from schemas.config import Config, GeneratorConfig, RunConfig, VerifierConfig, skip_tensor_list
from schemas.data import DataRef
from schemas.events import WeightsCheckFinished, WeightsCheckRequested, WeightsLoaded

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


def test_an_engine_whose_unreadable_tensors_are_not_skipped_stops_the_rank_naming_them_and_the_fix(
    tmp_path: Path,
):
    with pytest.raises(UnverifiableTensors) as caught:
        EngineWorker(
            run_config(tmp_path, skip_tensor_list=[]),
            PartialReadback(),
            RankPlace(0, 1, tmp_path),  # type: ignore[arg-type]
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "engine-0 (vllm) cannot read back 10 of the tensors it serves in the trainer's layout "
        "(model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.gate_proj.weight, "
    ), message
    assert "(+" in message and "more)" in message, "a few named, the count of the rest"
    assert message.endswith(
        'so no publication\'s digests could match; set verifier.skip_tensor_list = ["proj.weight"] '
        '(the behavioural probe, verifier.probe = "auto", then proves the skipped tensors)'
    ), message


def test_vllm_leaves_its_fused_and_repacked_projections_to_the_probe_unless_told_otherwise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    config = run_config(tmp_path)
    assert config.verifier.skip_tensor_list is None
    assert skip_tensor_list(config) == ["proj.weight"]
    for engine in ("torch", "sglang"):
        assert (
            skip_tensor_list(msgspec.structs.replace(config, generator=GeneratorConfig(engine=engine))) == []
        )
    assert skip_tensor_list(run_config(tmp_path, skip_tensor_list=["norm"])) == ["norm"]
    with caplog.at_level(logging.WARNING, logger="actors.engine.worker"):
        worker = EngineWorker(config, PartialReadback(), RankPlace(0, 1, tmp_path))  # type: ignore[arg-type]
    assert not caplog.records, "the default's tensors are probed: nothing goes unverified"
    worker.close()


def test_the_suggested_skip_list_keeps_what_is_skipped_already_and_adds_what_is_missing():
    verifier = VerifierConfig(skip_tensor_list=["norm", "down_proj"])
    with pytest.raises(
        UnverifiableTensors, match=r'verifier.skip_tensor_list = \["norm", "down_proj", "proj.weight"\]'
    ):
        check_readback("engine-1", "vllm", REPACKED, verifier, verifier.skip_tensor_list or [])
    with pytest.raises(UnverifiableTensors, match=r'= \["fc1.weight", "fc2.weight"\]') as caught:
        check_readback(
            "engine-1",
            "vllm",
            ["model.layers.0.fc2.weight", "model.layers.0.fc1.weight"],
            VerifierConfig(),
            [],
        )
    assert "cannot read back 2 of the tensors" in str(caught.value)


def test_skipped_unreadable_tensors_pass_and_so_does_a_run_that_verifies_nothing():
    check_readback("engine-0", "vllm", REPACKED, VerifierConfig(), ["proj.weight"])
    check_readback("engine-0", "vllm", REPACKED, VerifierConfig(enabled=False), [])
    check_readback("engine-0", "torch", [], VerifierConfig(), [])


def test_skipped_tensors_the_probe_does_not_prove_either_are_said_to_be_unverified(
    caplog: pytest.LogCaptureFixture,
):
    verifier = VerifierConfig(skip_tensor_list=["proj.weight"], probe="off")
    with caplog.at_level(logging.WARNING, logger="actors.engine.worker"):
        check_readback("engine-0", "vllm", REPACKED, verifier, verifier.skip_tensor_list or [])
    [record] = caplog.records
    assert record.getMessage().startswith(
        "engine-0: 10 tensors are neither in the digests (verifier.skip_tensor_list) nor probed "
        '(verifier.probe = "off"): '
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="actors.engine.worker"):
        check_readback(
            "engine-0", "vllm", REPACKED, msgspec.structs.replace(verifier, probe="auto"), ["proj.weight"]
        )
    assert not caplog.records


class ServingEngine:
    """An engine that serves one tensor and answers every check (a unit test's stand-in)."""

    name = "engine-1"
    metrics_url = None
    holds_canary = False

    def __init__(self) -> None:
        self.weight_version = "default"
        self.checksum_reply = single_rank_report({"w": "0123456789abcdef"}, "checksummed")

    def in_flight_load(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def unreadable_tensors(self) -> list[str]:
        return []

    def load_weights(self, weights: DataRef, weight_version: str) -> int:
        self.weight_version = weight_version
        return weights.num_bytes

    def checksums(self, skip_tensor_list: object = (), selector: str = "all") -> EngineChecksumReport:
        return self.checksum_reply

    def weights_check(
        self, action: str, selector: str, skip: list[str], allow_quant_error: bool
    ) -> WeightsCheckResult:
        return WeightsCheckResult(
            success=True,
            message=f"{action} of {skip}",
            action=action,
            weight_version=self.weight_version,
            num_tensors=3,
        )

    def close(self) -> None:
        pass


def serving_worker(tmp_path: Path) -> EngineWorker:
    return EngineWorker(run_config(tmp_path), ServingEngine(), RankPlace(1, 2, tmp_path))  # type: ignore[arg-type]


def test_a_load_answers_with_its_engines_weights_loaded_event_less_the_header(tmp_path: Path) -> None:
    worker = serving_worker(tmp_path)
    loaded = worker.load(DataRef("inprocess", "weights-1", "trainer", num_bytes=64), "1", [])
    digest = per_gpu_checksum({"w": "0123456789abcdef"})
    assert loaded == WeightsLoaded(
        engine="engine-1",
        weight_version="1",
        previous_version="default",
        digest=digest,
        num_tensors=1,
        num_bytes=64,
        checksums_manifest=loaded.checksums_manifest,
        canary=None,
        probe_logprobs=None,
    )
    assert loaded.checksums_manifest and (tmp_path / loaded.checksums_manifest).is_file()
    assert (loaded.run_id, loaded.seq, loaded.time, loaded.source) == ("", 0, 0.0, ""), (
        "the bus stamps the header"
    )


def test_a_checksum_check_answers_with_the_event_carrying_the_request_id(tmp_path: Path) -> None:
    worker = serving_worker(tmp_path)
    finished = worker.check(WeightsCheckRequested(action="checksum", request_id="proof:base"))
    assert finished == WeightsCheckFinished(
        engine="engine-1",
        action="checksum",
        success=True,
        message="checksummed",
        digest=per_gpu_checksum({"rank0/w": "0123456789abcdef"}),
        num_tensors=1,
        checksums_manifest=finished.checksums_manifest,
        weight_version="default",
        request_id="proof:base",
    )
    assert (tmp_path / finished.checksums_manifest).is_file()


def test_an_unsuccessful_checksum_reply_is_an_unsuccessful_check_with_the_engines_message(
    tmp_path: Path,
) -> None:
    worker = serving_worker(tmp_path)
    worker.engine.checksum_reply = EngineChecksumReport(success=False, message="no checker")  # type: ignore[attr-defined]
    finished = worker.check(WeightsCheckRequested(action="checksum", request_id="r"))
    assert finished == WeightsCheckFinished(
        engine="engine-1",
        action="checksum",
        success=False,
        message="no checker",
        weight_version="default",
        request_id="r",
    )


def test_a_tensor_check_answers_with_the_engines_result_as_the_event(tmp_path: Path) -> None:
    worker = serving_worker(tmp_path)
    request = WeightsCheckRequested(action="compare", skip_tensor_list=["norm"], request_id="after-load")
    assert worker.check(request) == WeightsCheckFinished(
        engine="engine-1",
        action="compare",
        success=True,
        message="compare of ['norm']",
        num_tensors=3,
        weight_version="default",
        request_id="after-load",
    )
