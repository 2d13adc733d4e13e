"""Trainer backends: the seam (``TrainerBackend``) and its PyTorch implementation."""

from __future__ import annotations

from actors.trainer_backend.base import TrainerBackend, TrainMetrics
from actors.trainer_backend.torch_backend import TorchTrainerBackend
from schemas.config import Config

__all__ = ["TorchTrainerBackend", "TrainMetrics", "TrainerBackend", "build_backend"]


def build_backend(config: Config) -> TrainerBackend:
    """The backend the config asks for; PyTorch is the only one built in."""
    return TorchTrainerBackend(config)
