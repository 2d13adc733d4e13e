"""What start-up built, kept out of the cyclic garbage collector's full passes.

Before its loop begins, a run's process imports torch and transformers and builds models,
tokenizers and engines: over a million Python objects, which every full (generation 2)
collection walks again, every few rollouts of a small run. Once the actors have
started, ``freeze_start_up`` moves every object alive into the permanent generation
(``gc.freeze``): a full collection then walks only what was allocated since.
Frozen objects are still freed by reference counting; only a reference cycle among them
would outlive its last use. ``thaw`` gives them back to the collector (a process that
goes on after its run).
"""

from __future__ import annotations

import gc


def freeze_start_up() -> None:
    """Keep every object alive now out of later full collections."""
    gc.collect()  # what start-up left as garbage goes first, not into the permanent generation
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector."""
    gc.unfreeze()
