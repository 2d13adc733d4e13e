"""Checkpoints: the format and its atomic writes and verification (``format``), the choice
of where a run continues (``resume``), and pruning (``prune``)."""
