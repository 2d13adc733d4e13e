"""The run plan: the loop's bounds as miles derives them, and where a resumed run picks up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_events.app.plan import make_plan
from miles_events.rl.prompts import DataError
from schemas.config import Config, DataConfig, RunConfig

TINY_PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "data" / "arith_train.jsonl"


def config(tmp_path: Path, prompts: Path | None = TINY_PROMPTS, **run: object) -> Config:
    data = DataConfig(prompt_data=str(prompts) if prompts else "", rollout_batch_size=64)
    return Config(run=RunConfig(dir=str(tmp_path), **run), data=data)  # type: ignore[arg-type]


def prompts(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i}+0=", "label": str(i)}) + "\n" for i in range(n)))
    return path


def test_a_given_num_rollout_has_no_epoch_boundary(tmp_path):
    """The embedded default: 55 prompts, batches of 64, num_rollout = 50. In miles the rollouts
    per epoch are None then, so intervals alone trigger evals and saves."""
    plan = make_plan(config(tmp_path, num_rollout=50), "local")
    assert plan.num_rollout == 50 and plan.num_rollout_per_epoch is None


def test_an_unset_num_rollout_is_epochs_of_whole_batches(tmp_path):
    plan = make_plan(config(tmp_path, prompts(tmp_path, 200), num_epoch=3), "local")
    assert plan.num_rollout_per_epoch == 3 and plan.num_rollout == 9


def test_an_unset_num_rollout_with_fewer_prompts_than_a_batch_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"55 prompts, fewer than one rollout batch \(data.rollout_batch_size = 64\)"):
        make_plan(config(tmp_path), "local")


def test_a_fresh_plan_starts_at_rollout_zero_with_default_weights(tmp_path):
    plan = make_plan(config(tmp_path, num_rollout=3, resume=True), "ray")
    assert (plan.start_rollout_id, plan.weight_version, plan.resumed, plan.load_checkpoint) == (0, "default", False, None)
    assert plan.engines == ("engine-0",) and plan.runtime == "ray"


def test_start_rollout_id_overrides_the_start(tmp_path):
    assert make_plan(config(tmp_path, num_rollout=9, start_rollout_id=4), "local").start_rollout_id == 4
