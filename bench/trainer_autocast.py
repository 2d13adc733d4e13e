"""The trainer's step with ``trainer.autocast = "bfloat16"`` against the same step in float32.

    .venv/bin/python bench/trainer_autocast.py [--config examples/smollm2_math.toml] [--rounds 3]
        [--groups 4] [--group-size 8] [--prompt-tokens 90] [--response-tokens 20-64] [--set KEY=VALUE ...]

Builds the run's model (``model.gguf`` converted as a run converts it, or ``model.path``, or
the built-in one) twice in one process, as the torch trainer backend does, one with
``trainer.autocast = "off"`` and one with ``"bfloat16"``, and trains each on the same
synthetic rollout (``--groups`` prompts of ``--prompt-tokens`` random ids, ``--group-size``
responses each of a random length in the ``--response-tokens`` range, rewards 0/1), the
config's batch sizes and learning rate, alternating the two for ``--rounds`` rounds (the
machine is shared: a round compares like with like). Prints each step's seconds and loss and
``RESULT autocast_vs_fp32=<median of the rounds' ratios> fp32_s=... bf16_s=...``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec

from actors.trainer_backend.torch_backend import TorchTrainerBackend
from miles_events.app.config import load_config
from miles_events.app.preflight import resolve_model_source
from miles_events.rl.hf_model import prepare_base_model
from schemas.rollout import RolloutBatch, Sample

ROOT = Path(__file__).resolve().parents[1]


def synthetic_rollout(
    groups: int, group_size: int, prompt_tokens: int, lengths: tuple[int, int]
) -> RolloutBatch:
    rng = random.Random(0)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_tokens)]
        for _ in range(group_size):
            n = rng.randint(*lengths)
            samples.append(
                Sample(
                    index=group, group=group, prompt="", label="", prompt_ids=prompt,
                    response_ids=[rng.randrange(1000, 30000) for _ in range(n)], response_logprobs=[-1.0] * n,
                    response="", reward=float(rng.random() < 0.3), weight_version="1", engine="bench",
                    finish_reason="stop",
                )
            )  # fmt: skip
    return RolloutBatch(rollout_id=0, samples=samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "smollm2_math.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=90)
    parser.add_argument("--response-tokens", default="20-64")
    args = parser.parse_args(argv)
    low, high = (int(v) for v in args.response_tokens.split("-"))
    config = resolve_model_source(load_config(args.config, args.overrides))
    if config.model.path is None:
        work = Path(tempfile.mkdtemp(prefix="autocast-"))
        model = msgspec.structs.replace(
            config.model, path=str(prepare_base_model(config.model, work, config.run.seed))
        )
        config = msgspec.structs.replace(config, model=model)
    rollout = synthetic_rollout(args.groups, args.group_size, args.prompt_tokens, (low, high))
    backends = {
        mode: TorchTrainerBackend(
            msgspec.structs.replace(config, trainer=msgspec.structs.replace(config.trainer, autocast=mode))
        )
        for mode in ("off", "bfloat16")
    }
    seconds: dict[str, list[float]] = {mode: [] for mode in backends}
    ratios = []
    for round_number in range(args.rounds):
        order = list(backends) if round_number % 2 == 0 else list(reversed(backends))
        for mode in order:
            started = time.perf_counter()
            metrics = backends[mode].train(rollout)
            seconds[mode].append(time.perf_counter() - started)
            print(
                f"round {round_number + 1} {mode}: {seconds[mode][-1]:.2f} s, loss {metrics.loss:+.5f}",
                flush=True,
            )
        ratios.append(seconds["bfloat16"][-1] / seconds["off"][-1])
    print(
        f"RESULT autocast_vs_fp32={statistics.median(ratios):.3f} fp32_s={statistics.median(seconds['off']):.2f}"
        f" bf16_s={statistics.median(seconds['bfloat16']):.2f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
