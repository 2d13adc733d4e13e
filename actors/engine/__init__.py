"""Inference engines behind the Generator: the ``Engine`` seam (``base.py``) and one file per
backend, chosen by ``generator.engine``.

``ENGINES`` names every backend as ``"module:Class"``; a backend's module is imported only
when a run asks for it, so one backend's dependencies (an HTTP client, a CUDA build) never
load for another. Adding a backend is one file here, its line in ``ENGINES`` and its config
section in ``schemas/config.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_events.util.registry import check_registered, registered, registered_module

if TYPE_CHECKING:
    from actors.engine.base import Engine
    from miles_events.transport.base import Transport
    from schemas.config import Config

ENGINES: dict[str, str] = {
    "torch": "actors.engine.torch_engine:TorchEngine",
    "sglang": "actors.engine.sglang_engine:SglangEngine",
    "vllm": "actors.engine.vllm_engine:VllmEngine",
}
"""Engine backend name -> ``"module:Class"`` of its ``Engine`` subclass."""

PARTIAL_READBACK: frozenset[str] = frozenset({"vllm"})
"""Backends whose engines cannot read back every tensor they serve in the trainer's layout
(vLLM on CPU repacks its linear layers): their digests leave those out, and the behavioural
probe (``verifier.probe = "auto"``) proves them."""


PROBING: frozenset[str] = frozenset({"torch", "vllm"})
"""Backends whose engines answer the behavioural probe (``Engine.probe_logprobs``)."""


def check_probe(name: str, probe: bool) -> None:
    """Raise ``ValueError`` (one line) when publications are to be probed and backend
    ``name`` cannot answer a probe."""
    if probe and name not in PROBING:
        raise ValueError(
            f"the {name} engine has no behavioural probe (engines with one: {', '.join(sorted(PROBING))})"
        )


def reads_back_every_tensor(name: str) -> bool:
    """Whether engines of backend ``name`` fingerprint every tensor they serve."""
    return name not in PARTIAL_READBACK


def check_engine(name: str) -> None:
    """Raise ``ValueError`` (one line, naming the known backends) for an unknown name."""
    check_registered(ENGINES, name, "engine")


def engine_module(name: str) -> str:
    """The module of backend ``name``, not imported."""
    return registered_module(ENGINES, name)


def engine_class(name: str) -> type[Engine]:
    """The ``Engine`` subclass registered as ``name``, imported now."""
    cls: type[Engine] = registered(ENGINES, name, "engine")
    return cls


def build_engine(config: Config, *, index: int, name: str, transport: Transport) -> Engine:
    """Engine ``index`` of the run, of the backend ``generator.engine`` names."""
    return engine_class(config.generator.engine).from_config(
        config, index=index, name=name, transport=transport
    )
