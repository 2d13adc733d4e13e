"""Trainer backends: the seam (``base.py``) and one file per backend, chosen by ``trainer.backend``.

``BACKENDS`` names every backend as ``"module:Class"``; a backend's module is imported only
when a run asks for it. Adding a backend is one file here, its line in ``BACKENDS`` and its
config section in ``schemas/config.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_events.util.registry import check_registered, registered, registered_module

if TYPE_CHECKING:
    from actors.trainer_backend.base import TrainerBackend
    from schemas.config import Config

BACKENDS: dict[str, str] = {
    "torch": "actors.trainer_backend.torch_backend:TorchTrainerBackend",
    "megatron": "actors.trainer_backend.megatron_backend:MegatronTrainerBackend",
}
"""Trainer backend name -> ``"module:Class"`` of its ``TrainerBackend`` subclass."""


def check_backend(name: str) -> None:
    """Raise ``ValueError`` (one line, naming the known backends) for an unknown name."""
    check_registered(BACKENDS, name, "trainer backend")


def backend_module(name: str) -> str:
    """The module of backend ``name``, not imported."""
    return registered_module(BACKENDS, name)


def backend_class(name: str) -> type[TrainerBackend]:
    """The ``TrainerBackend`` subclass registered as ``name``, imported now."""
    cls: type[TrainerBackend] = registered(BACKENDS, name, "trainer backend")
    return cls


def build_backend(config: Config) -> TrainerBackend:
    """The backend ``trainer.backend`` names, built from the run's config."""
    return backend_class(config.trainer.backend)(config)
