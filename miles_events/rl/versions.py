"""Names of the run's parts that several actors must agree on."""

from __future__ import annotations

from schemas.config import Config


def engine_names(config: Config) -> list[str]:
    """The inference engines of a run, as they appear in events and metrics."""
    return [f"engine-{i}" for i in range(config.generator.num_engines)]


def version_number(weight_version: str) -> int:
    """``"default"`` (the bootstrap weights) is 0; published versions are 1, 2, ..."""
    return 0 if weight_version == "default" else int(weight_version)


def next_version(weight_version: str) -> str:
    """The version a publication after ``weight_version`` gets: ``"default"`` -> ``"1"``,
    ``"n"`` -> ``"n+1"``; each publication adds exactly one."""
    return str(version_number(weight_version) + 1)
