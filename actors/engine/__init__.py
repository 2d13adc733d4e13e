"""Inference engines behind the Generator: the ``Engine`` seam and the embedded PyTorch one."""

from actors.engine.base import Completion, Engine, GenerateRequest, SamplingParams
from actors.engine.torch_engine import TorchEngine, sample_tokens

__all__ = [
    "Completion",
    "Engine",
    "GenerateRequest",
    "SamplingParams",
    "TorchEngine",
    "sample_tokens",
]
