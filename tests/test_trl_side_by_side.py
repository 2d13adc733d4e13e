"""``bench/trl_side_by_side.py``: its pure parts (ratios, table, RESULT line, the process
tree's PSS, reading an event log), and a 3-rollout run of all three arms that keeps the
harness working (slow; needs ``.venv-trl`` from ``bash .ci/setup-trl``, which CI has: with
``CI`` set a missing one fails instead of skipping)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_run"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


def load_bench():
    spec = importlib.util.spec_from_file_location("trl_side_by_side", ROOT / "bench" / "trl_side_by_side.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def arm(name: str, seed: int = 1, **figures) -> object:
    defaults = dict(
        command=[], returncode=0, process_seconds=10.0, peak_pss_bytes=600_000_000, peak_processes=1,
        process_names=["python"], pss_samples=5, loop_seconds=4.0, per_rollout_seconds=1.0,
        generate_seconds=0.4, train_seconds=0.6, rollouts_to_target=20,
    )  # fmt: skip
    return bench.ArmResult(arm=name, seed=seed, **{**defaults, **figures})


def test_ratios_of_a_round():
    ratios = bench.round_ratios(
        {
            "ray": arm("ray", per_rollout_seconds=1.2, process_seconds=40.0, peak_pss_bytes=2_400_000_000),
            "local": arm("local", per_rollout_seconds=0.8, process_seconds=12.0, peak_pss_bytes=600_000_000),
            "trl": arm("trl", per_rollout_seconds=1.0),
        }
    )
    assert ratios["ray_vs_trl"] == pytest.approx(1.2)
    assert ratios["local_vs_trl"] == pytest.approx(0.8)
    assert ratios["ray_vs_local"] == pytest.approx(1.5)
    assert ratios["ray_fixed_extra_s"] == pytest.approx(28.0)  # (40 - 4) - (12 - 4)
    assert ratios["ray_pss_vs_local"] == pytest.approx(4.0)
    missing = bench.round_ratios({"local": arm("local")})
    assert math.isnan(missing["ray_vs_trl"]) and math.isnan(missing["local_vs_trl"])


def test_table_and_result_line():
    rounds = [
        {
            "ray": arm(
                "ray", seed, per_rollout_seconds=1.2 * seed, peak_processes=13, rollouts_to_target=20 + seed
            ),
            "local": arm("local", seed, per_rollout_seconds=0.8 * seed, rollouts_to_target=20 + seed),
            "trl": arm(
                "trl",
                seed,
                per_rollout_seconds=1.0 * seed,
                torch_threads=2,
                rollouts_to_target=None if seed == 3 else 18,
            ),
        }
        for seed in (1, 2, 3)
    ]
    table = bench.format_table(rounds, 0.9)
    assert table[0] == "| | ours, ray | ours, local | TRL GRPOTrainer |"
    assert (
        table[2]
        == "| median s per rollout (ratio to TRL, TRL on 2 threads) | 1.20x (1.20-3.60 s) | 0.80x (0.80-2.40 s) | 1 (1.00-3.00 s) |"
    )
    assert table[3] == "| generation + training split (s) | 0.40 + 0.60 | 0.40 + 0.60 | 0.40 + 0.60 |"
    assert table[4] == "| fixed cost: process time minus loop time | 6.0 s | 6.0 s | 6.0 s |"
    assert (
        table[5]
        == "| peak memory, process tree (PSS) | 0.60 GB over 13 processes | 0.60 GB over 1 process | 0.60 GB over 1 process |"
    )
    assert (
        table[6] == "| rollouts to reward 0.9 (seeds 1/2/3) | 21 / 22 / 23 | 21 / 22 / 23 | 18 / 18 / none |"
    )
    line = bench.result_line(bench.result_values(rounds))
    assert line == (
        "RESULT ray_vs_trl=1.200 local_vs_trl=0.800 ray_vs_local=1.500 ray_fixed_extra_s=0.0 ray_pss_vs_local=1.000"
        " rollouts_to_0.9_ours=21/22/23 rollouts_to_0.9_trl=18/18/none eval_accuracy_ours=n/a/n/a/n/a"
        " eval_accuracy_trl=n/a/n/a/n/a seconds_to_accuracy_ours=n/a/n/a/n/a seconds_to_accuracy_trl=n/a/n/a/n/a"
    )
    assert list(bench.parse_result_line(line)) == list(bench.RESULT_KEYS)
    with pytest.raises(ValueError):
        bench.parse_result_line("ray_vs_trl=1")


def run_log(starts: list[float], evals: list[tuple[int, float, float, float]]) -> bench.RunLog:
    return bench.RunLog(
        rollouts=[
            bench.Rollout(rollout_id=k, start=t, generate_seconds=1.0, train_seconds=1.0, reward_mean=0.5,
                          num_completions=32)
            for k, t in enumerate(starts)
        ],
        loop_seconds=starts[-1] - starts[0],
        evals=[bench.Eval(rollout_id=k, start=t, seconds=d, accuracy=a) for k, t, d, a in evals],
    )  # fmt: skip


def test_time_to_a_held_out_accuracy_leaves_the_evals_out():
    # Rollouts every 10 s, an eval of 5 s before rollout 0 and after rollouts 1 and 3.
    ours = run_log(
        [0.0, 10.0, 25.0, 35.0, 50.0], [(0, -5.0, 5.0, 0.1), (1, 20.0, 5.0, 0.3), (3, 45.0, 5.0, 0.5)]
    )
    assert bench.seconds_to_accuracy(ours, 0.1) == 0.0
    assert bench.seconds_to_accuracy(ours, 0.3) == 20.0
    assert bench.seconds_to_accuracy(ours, 0.4) == 40.0  # 45 s less the 5 s eval after rollout 1
    assert bench.seconds_to_accuracy(ours, 0.6) is None
    assert bench.eval_intervals(ours) == {1, 3}
    theirs = run_log([0.0, 20.0, 40.0, 60.0, 80.0], [(0, -5.0, 5.0, 0.1), (3, 75.0, 5.0, 0.35)])
    arms = {"local": arm("local"), "trl": arm("trl")}
    bench.set_accuracy_target(arms, {"local": ours, "trl": theirs}, None)
    # Unset, the target is the best accuracy every arm reached: TRL's 0.35.
    assert arms["local"].target_accuracy == arms["trl"].target_accuracy == 0.35
    assert (arms["local"].seconds_to_accuracy, arms["trl"].seconds_to_accuracy) == (40.0, 75.0)
    bench.set_accuracy_target(arms, {"local": ours, "trl": theirs}, 0.5)
    assert (arms["local"].seconds_to_accuracy, arms["trl"].seconds_to_accuracy) == (40.0, None)
    for name, log in (("local", ours), ("trl", theirs)):
        bench.summarize(arms[name], log, excluded={1, 3}, target=0.9)
    values = bench.result_values([arms])
    assert values["eval_accuracy_ours"] == "0.500" and values["eval_accuracy_trl"] == "0.350"
    assert values["seconds_to_accuracy_ours"] == "40" and values["seconds_to_accuracy_trl"] == "n/a"
    assert bench.format_table([arms], 0.9)[-2:] == [
        "| held-out accuracy (accuracy@rollout, per seed) | 0.100@0 0.300@1 0.500@3 | 0.100@0 0.350@3 |",
        "| loop seconds, evals left out, to held-out accuracy (per seed) | 40 s to 0.500 | not reached to 0.500 |",
    ]
    assert "held-out accuracy 0.100@0 0.300@1 0.500@3" in "\n".join(
        bench.format_round(1, ["local", "trl"], arms, 0.9)
    )


def test_round_lines_name_every_arm_and_the_ratios():
    lines = bench.format_round(
        2, ["trl", "ray"], {"ray": arm("ray", 2), "trl": arm("trl", 2, error="exit code 1")}, 0.9
    )
    assert lines[0] == "round seed=2 (order: trl, ray)"
    assert [line.split()[0] for line in lines[1:3]] == ["ray", "trl"]
    assert "ERROR: exit code 1" in lines[2]
    assert "ray/trl 1.00x" in lines[3] and "local/trl n/a" in lines[3]


def test_pss_sums_the_whole_process_tree():
    own, counted = bench.tree_pss(os.getpid())
    assert os.getpid() in counted and own > 0
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while len(bench.process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree, counted = bench.tree_pss(child.pid, session=child.pid)
        assert len(counted) == 2  # the child and its grandchild
        assert tree > 0
        with_child, _ = bench.tree_pss(os.getpid())
        assert with_child > own  # this process's tree now holds both
        sampler = bench.PeakSampler(child.pid, 0.01, session=child.pid, duty=1.0, session_every=2)
        sampler.start()
        time.sleep(0.1)
        sampler.stop()
        assert sampler.peak_processes == 2 and sampler.peak_pss > 0 and sampler.samples >= 2
    finally:
        for pid in sorted(bench.process_tree(child.pid), reverse=True):
            os.kill(pid, 9)
        child.wait()


def test_pss_counts_a_process_that_left_the_tree_but_not_the_session():
    # The child starts a grandchild and exits: the grandchild is reparented, out of the tree.
    script = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])"
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    child.wait()
    orphans = bench.session_members(child.pid)
    try:
        assert len(orphans) == 1 and child.pid not in orphans
        assert bench.process_tree(child.pid) == set()
        total, counted = bench.tree_pss(child.pid, session=child.pid)
        assert counted == sorted(orphans) and total > 0
    finally:
        for pid in orphans:
            os.kill(pid, 9)


def test_reads_a_recorded_run():
    log = bench.read_our_run(FIXTURE)
    assert [r.rollout_id for r in log.rollouts] == [0, 1, 2]
    assert all(r.num_completions == 128 and 0 <= r.reward_mean <= 1 for r in log.rollouts)
    assert log.loop_seconds > 0 and len(log.eval_times) == 3  # before training, after rollouts 1 and 2
    # The eval after rollout 1 lies between the starts of rollouts 1 and 2; the one before
    # training precedes rollout 0's start, the last one follows rollout 2's.
    assert bench.eval_intervals(log) == {1}
    result = arm("local", per_rollout_seconds=math.nan)
    bench.summarize(result, log, excluded={1}, target=0.9)
    # Only interval 0 -> 1 is left, and it is the warm-up: with nothing else, it is used.
    assert result.counted_intervals == [0]
    assert result.per_rollout_seconds == pytest.approx(log.rollouts[1].start - log.rollouts[0].start)
    assert result.rollouts_to_target is None
    assert bench.rollouts_to(log.rollouts, 0.0) == 0


def test_trl_results_are_read_as_rollouts():
    result = {
        "train_begin": 100.0,
        "train_end": 110.0,
        "rollouts": [
            {"rollout_id": k, "start": 101.0 + 3 * k, "generate_seconds": 1.0, "train_seconds": 2.0,
             "reward_mean": 0.3 * k, "num_completions": 4096}
            for k in range(3)
        ],
    }  # fmt: skip
    log = bench.read_trl_run(result)
    assert log.loop_seconds == 10.0 and log.eval_times == []
    result["evals"] = [
        {"rollout_id": 0, "start": 99.0, "seconds": 1.0, "accuracy": 0.25, "reward_mean": 0.25}
    ]
    assert bench.read_trl_run(result).evals == [
        bench.Eval(rollout_id=0, start=99.0, seconds=1.0, accuracy=0.25)
    ]
    assert bench.intervals(log.rollouts) == {0: 3.0, 1: 3.0}
    assert bench.rollouts_to(log.rollouts, 0.5) == 2


def test_commands_pass_the_settings_through():
    ours = bench.our_command("py", "cfg.toml", "local", 3, 50, Path("/r"), ["trainer.lr=0.002"])
    assert ours[:4] == ["py", "-m", "miles_events.run", "cfg.toml"]
    assert ours[4:] == [
        "--set", 'run.dir="/r"', "--set", 'run.runtime="local"', "--set", "run.seed=3", "--set", "run.num_rollout=50",
        "--set", "metrics.port=0", "--set", "trainer.lr=0.002",
    ]  # fmt: skip
    trl = bench.trl_command("tpy", "cfg.toml", 3, 50, Path("/o.json"), Path("/w"), ["trainer.lr=0.002"])
    assert trl[0] == "tpy" and trl[1].endswith("bench/trl_grpo.py")
    assert trl[-6:] == ["--set", "run.seed=3", "--set", "run.num_rollout=50", "--set", "trainer.lr=0.002"]


def test_bad_arms_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "ray,vllm"])
    assert "unknown vllm" in capsys.readouterr().err


# --- the harness itself, 3 rollouts of each arm --------------------------------------------


@pytest.mark.slow
def test_three_rollouts_of_every_arm(tmp_path):
    if not TRL_PYTHON.exists():
        message = f"{TRL_PYTHON} is missing: run bash .ci/setup-trl"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: .ci/run creates it)")
        pytest.skip(message)
    out = tmp_path / "result.json"
    # A quarter of tiny.toml's prompts per rollout, in optimizer steps of a quarter of its
    # size: still 4 steps a rollout, through the settings passed to every arm.
    command = [
        sys.executable, str(ROOT / "bench" / "trl_side_by_side.py"), "--seeds", "1", "--rollouts", "3",
        "--arms", "ray,local,trl", "--json", str(out), "--work-dir", str(tmp_path / "runs"), "--no-setup",
        "--timeout", "400", "--set", "data.rollout_batch_size=16", "--set", "trainer.global_batch_size=256",
        "--set", "trainer.micro_batch_size=256",
    ]  # fmt: skip
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT "), lines[-5:]
    values = bench.parse_result_line(lines[-1])
    assert list(values) == list(bench.RESULT_KEYS)
    for key in bench.RESULT_KEYS[:5]:
        assert math.isfinite(float(values[key])), (key, values[key])
    # Every arm's exact command is printed.
    assert sum("miles_events.run" in line for line in lines) == 2 and any(
        "trl_grpo.py" in line for line in lines
    )

    report = json.loads(out.read_text())
    arms = report["rounds"][0]
    assert set(arms) == {"ray", "local", "trl"}
    for name, result in arms.items():
        assert result["returncode"] == 0 and not result["error"], (name, result["error"])
        assert [r["rollout_id"] for r in result["rollouts"]] == [0, 1, 2], name
        assert result["peak_pss_bytes"] > 0 and result["process_seconds"] > result["loop_seconds"] > 0
        assert all(r["num_completions"] == 16 * 64 for r in result["rollouts"]), name
    # TRL's rewards are exact_match's: in [0, 1], of 1024 completions, and the first rollout's
    # prompt ids were checked against the project's engine.
    trl = json.loads((tmp_path / "runs" / "seed1-trl" / "trl.json").read_text())
    assert (
        trl["optimizer_steps"] == 12
        and trl["settings"]["loss_type"] == "bnpo"
        and trl["settings"]["beta"] == 0
    )
    assert trl["rollouts"][0]["prompt_ids_as_engine"] is True
    for rollout in trl["rollouts"]:
        assert 0.0 <= rollout["reward_min"] <= rollout["reward_mean"] <= rollout["reward_max"] <= 1.0
        assert rollout["generate_seconds"] > 0 and rollout["train_seconds"] > 0
    assert any(r["reward_max"] == 1.0 for r in trl["rollouts"])  # some completion was right
    # Ray's processes (GCS, raylet, workers) are counted with the driver.
    assert arms["ray"]["peak_processes"] > 1
    assert {"raylet", "gcs_server"} <= set(arms["ray"]["process_names"])
    assert arms["local"]["peak_processes"] == 1
    # TRL starts from the very weights our run's actors load.
    ours = tmp_path / "runs" / "seed1-local" / "run" / "base_model" / "model.safetensors"
    theirs = tmp_path / "runs" / "seed1-trl" / "base_model" / "model.safetensors"
    assert ours.read_bytes() == theirs.read_bytes()
