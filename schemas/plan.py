"""The run plan: what the driver works out before any actor starts, handed to every actor."""

from __future__ import annotations

import msgspec


class RunPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The loop's bounds, and where a resumed run picks up."""

    start_rollout_id: int
    num_rollout: int
    num_rollout_per_epoch: int | None
    """Rollouts per epoch when ``num_rollout`` was derived from the data; None (no epoch
    boundary, no epoch-end triggers) when it was given."""
    resumed: bool = False
    weight_version: str = "default"
    """The trainer's version at start: ``"default"`` on a fresh run, the saved one on resume."""
    engines: tuple[str, ...] = ()
    runtime: str = "local"
    config_digest: str = ""
    load_checkpoint: str | None = None
    """The checkpoint directory the trainer restores (verified once, by the plan): this run's
    latest on resume, else the one ``run.load`` (or ``run.ref_load``) names."""
    reference_checkpoint: str | None = None
    """The checkpoint whose weights are the KL reference (``run.ref_load``'s); None: the base
    model."""
    critic_checkpoint: str | None = None
    """PPO (``trainer.use_critic``): the checkpoint whose ``critic/`` the critic restores (the
    loaded one where it holds a critic, else ``run.critic_load``'s); None: a new critic."""
    rollout_only: bool = False
    """``run.rollout_only_from_checkpoint``: prove the checkpoint's publication, then only
    generate."""
    checkpoint_iteration: int | None = None
    """The iteration ``latest_checkpointed_iteration.txt`` of the loaded root named."""
    lineage: str = ""
    """The run id of the fresh run this run continues (its own on a fresh run); every
    checkpoint it saves records it."""
    regenerated: tuple[int, ...] = ()
    """On resume: the rollouts from ``start_rollout_id`` on that the runs before asked for
    (their samples are not kept; each is generated again with the same id and seeds)."""
    trainer_ranks: int = 1
    """``trainer.num_ranks``: the processes that train."""
    trainer_sharding: str = "none"
    """``trainer.sharding`` resolved: ``none`` for one rank, ``fsdp2`` for more on ``auto``;
    ``ddp`` with the megatron backend."""
    probe: bool = False
    """Whether every publication carries the behavioural probe (``verifier.probe``: on, or
    auto with an engine that cannot read back every tensor it serves)."""
