"""The Coordinator's protocols, each a state machine: not actors, and pure (no bus, no clock,
no files but those a protocol is given a reader for). A step takes the fact that arrived and
returns the next command: an event for the Coordinator to publish, or done, or failed.

- ``steps``: the facts, the commands, and the replies of every engine to one weight check.
- ``opening``: what comes before the loop's first rollout: the initial publication, the
  seed's ``check_weight_update_equal`` and the rollout-only checkpoint-backed proof.
- ``healing``: the rules every cell that heals follows (names, restart limits and backoff,
  the signal of each injected fault).
"""
