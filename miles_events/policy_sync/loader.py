"""Loading a plugin as the seed's ``_load_external_policy_sync`` does: ``load_function(path)(config)``,
then its declared role support checked against the run."""

from __future__ import annotations

from typing import Any

from miles_events.util.registry import load_function
from schemas.config import Config

NO_CRITIC_SUPPORT = "the configured external policy synchronizer does not declare critic support"
"""The seed's refusal of a plugin without ``supports_critic`` in a run with a critic."""
HOOKS = ("initialize", "after_local_train", "finalize")
"""The hooks every plugin has (``after_inference_publication`` is optional, as in the seed)."""


def load_policy_sync(config: Config) -> Any | None:
    """The plugin ``run.external_policy_sync_path`` names, built from ``config``; None when
    none is configured. ``ValueError`` (one line) for a path that does not import or is not
    callable, a factory that raises, a plugin that lacks a hook, or a plugin without
    ``supports_critic`` in a run with a critic."""
    path = config.run.external_policy_sync_path
    if path is None:
        return None
    factory = load_function(path)
    try:
        plugin = factory(config)
    except Exception as error:
        raise ValueError(f"{path!r} raised {type(error).__name__}: {error}") from None
    missing = [hook for hook in HOOKS if not callable(getattr(plugin, hook, None))]
    if missing:
        raise ValueError(f"{path!r} returned {type(plugin).__name__}, which has no {', '.join(missing)}")
    if config.trainer.use_critic and not getattr(plugin, "supports_critic", False):
        raise ValueError(NO_CRITIC_SUPPORT)
    return plugin
