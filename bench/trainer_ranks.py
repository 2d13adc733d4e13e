"""The PyTorch trainer as N ranks of a process group against one process: state per rank, step time.

    python3 bench/trainer_ranks.py [--rounds 7] [--profile-steps 3] [--samples 16 --micro-batch 4
        --prompt-tokens 16 --response-tokens 24] [--hidden 512 --layers 8 --intermediate 1376 --heads 8 --kv-heads 4]
    python3 bench/trainer_ranks.py --device cuda --hidden 1536 --layers 28 --intermediate 8960
        --heads 12 --kv-heads 2 [--dtype bfloat16] [...]

The built-in Qwen2 model of that shape (its vocabulary is 18 tokens, so the decoder layers
hold nearly every parameter) is written to a temporary directory; every arm trains it from
the same weights on the same rollouts: ``--samples`` samples in groups of 4, prompts of
``--prompt-tokens``, responses of ``--response-tokens`` (give or take 4), one optimizer
step per rollout (global batch = the rollout), micro-batches of ``--micro-batch``; shared
prompts off, so that one process and the ranks do the same work. Each rank is a process
spawned here (``TorchTrainerBackend`` over a ``ProcessGroup``: gloo on CPU, NCCL on GPU),
meeting the others at a TCP store this process holds, as the Trainer's ranks do; the
single-process arm (``sharding = "none"``) is a process of its own too. The processes of
every arm stay up for the whole run and are asked for one step at a time.

On CPU (the default), three arms: one process (none), FSDP2 on one rank, FSDP2 on two
ranks; each rank gets ``cores / N`` torch threads (``--cores``, default the CPUs this
process may run on), so both N use the whole machine.

1. Memory per rank: the bytes of parameters, gradients and optimizer state the rank holds
   at the optimizer step of the second (warm-up) step, when all three exist
   (``state_bytes()``, read in an optimizer pre-step hook), checked against a count of its
   own: the distinct storages behind those tensors' local shards, and against the
   unsharded figure over N (goal: each rank within 10% of 1/N of the one process's). Also
   ``state_bytes()`` after the step (gradients are released by then), and the process's
   peak RSS (``ru_maxrss``) once the model is loaded and at the end.
2. Step time, N = 2 (FSDP2) against N = 1 (none): ``--rounds`` rounds of one step each,
   interleaved (N = 1, N = 2, N = 1, ...), after the two warm-up steps; the time of a step
   is the slowest rank's ``train()``. Medians and their ratio, and the best steps' ratio;
   beside each step its CPU use (the ranks' CPU time over wall time x cores): on a shared
   machine, a step that got less than the whole machine shows it (two OpenMP threads
   stall badly when another process takes one of the two cores). Then ``--profile-steps``
   more steps of N = 2, each under its own ``torch.profiler`` on rank 0, the main thread's
   time of each split (the fastest one's in full) into: collectives (the ``c10d``/``gloo``
   ops, everything inside them, and the self time of FSDP2's ``all_gather``,
   ``post_backward_reduce`` and ``post_backward_rs_wait`` scopes, where the rank waits on
   a synchronous collective: transfer and waiting for the other rank), FSDP2's own work
   (copy-in/out of the gathered and reduced buffers, its hooks), the other ops (the
   model's compute, the optimizer), and the rest of the wall time (Python between ops).
   The gloo threads' busy time is shown beside it.
3. A publication's staging on the trainer, each round after the step: the weights copied
   into staging buckets in the model's dtype (``weights_copy``, as ``Trainer._stage_weights``
   does), gathered whole on rank 0 first when sharded; the slowest rank's time, medians.

``--device cuda`` (one GPU, N = 1; skipped with a message and exit code 0 without CUDA):
FSDP2 on one rank (NCCL) against the single process, the same model in ``--dtype``
(default bfloat16 on CUDA), interleaved as above, per-step medians; goal: FSDP2 no slower
than 1.1x. Peak GPU memory (``max_memory_allocated``) per arm beside the state figures.

The last lines are ``RESULT`` lines: memory (``state_mb_<arm>_r<rank>``,
``state_ratio_<arm>_r<rank>`` against the single process, ``rss_mb_...``) and time
(``step_ms_<arm>``, ``step_ratio``, and on CPU the profiled split's fractions).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the repository root is on the path, for plain python3)

from actors.trainer_backend.parallel import local_shard  # noqa: E402

GROUP_SIZE = 4
"""Samples per prompt in the bench's rollouts."""
SEED = 1


@dataclass(frozen=True)
class Arm:
    """One way of training: ``sharding`` over ``world`` ranks."""

    sharding: str
    world: int

    @property
    def key(self) -> str:
        return f"{self.sharding}_x{self.world}"


ONE_PROCESS = Arm("none", 1)
FSDP2_ONE = Arm("fsdp2", 1)
FSDP2_TWO = Arm("fsdp2", 2)


# --- what every rank process runs -----------------------------------------------------------


def rollout(rollout_id: int, settings: dict[str, Any]) -> Any:
    """``settings["samples"]`` samples in groups of ``GROUP_SIZE`` sharing a prompt, response
    lengths spread over +-4 tokens around ``response_tokens``, rewards that differ within
    each group; the same for a given ``rollout_id`` in every process."""
    from schemas.rollout import RolloutBatch, Sample

    generator = torch.Generator().manual_seed(1000 + rollout_id)
    low, high = 3, settings["vocab"]  # the built-in tokenizer's digits and symbols
    samples = []
    prompt: list[int] = []
    for i in range(settings["samples"]):
        if i % GROUP_SIZE == 0:
            prompt = torch.randint(low, high, (settings["prompt_tokens"],), generator=generator).tolist()
        length = max(1, settings["response_tokens"] - 4 + (i * 5 + rollout_id) % 9)
        response = torch.randint(low, high, (length,), generator=generator).tolist()
        samples.append(
            Sample(
                index=i // GROUP_SIZE,
                group=i // GROUP_SIZE,
                prompt="",
                label="",
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=[-1.0] * length,
                response="",
                reward=float((i * 7 + rollout_id) % 3),
                weight_version="bench",
                engine="bench",
                finish_reason="stop",
            )
        )
    return RolloutBatch(rollout_id=rollout_id, samples=samples)


def held_bytes(backend: Any) -> dict[str, int]:
    """Parameters, gradients and optimizer state: the bytes of the distinct storages behind
    this rank's local tensors (a count independent of ``state_bytes()``: a flat bucket or a
    reduce-scatter output that several tensors view counts once, padding included)."""
    seen: set[int] = set()

    def storages(tensors: list[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = local_shard(tensor).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    parameters = list(backend.root.parameters())
    return {
        "parameters": storages(parameters),
        "gradients": storages([p.grad for p in parameters if p.grad is not None]),
        "optimizer": storages(
            [
                v
                for state in backend.optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ]
        ),
    }


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def profile_split(profiler: Any, wall_seconds: float) -> dict[str, float]:
    """Seconds of the main thread's step by kind (see the module's docstring), and the
    gloo threads' busy time."""
    events = list(profiler.events())
    main = Counter(event.thread for event in events).most_common(1)[0][0]
    collective = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")

    def is_wait(name: str) -> bool:
        """A scope of FSDP2's that blocks in a synchronous collective (its self time)."""
        return name == "FSDP::all_gather" or name.startswith(
            ("FSDP::all_gather (", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")
        )

    def kind(name: str, itself: bool) -> str | None:
        if name.startswith(collective):
            return "collectives"
        if is_wait(name):
            return "collectives" if itself else "fsdp"  # an op inside it is FSDP2's own work
        if name.startswith(("FSDP::", "fsdp::")):
            return "fsdp"
        return None

    split = dict.fromkeys(("collectives", "fsdp", "ops"), 0.0)
    gloo_busy = 0.0
    for event in events:
        seconds = event.self_cpu_time_total / 1e6
        if event.thread != main:
            if event.name.startswith("gloo:"):
                gloo_busy += event.cpu_time_total / 1e6
            continue
        # The event's own kind, else its innermost enclosing collective or FSDP2 scope's; an
        # op under none is compute.
        found = kind(event.name, itself=True)
        parent = event.cpu_parent
        while found is None and parent is not None:
            found = kind(parent.name, itself=False)
            parent = parent.cpu_parent
        split[found or "ops"] += seconds
    split["python"] = max(wall_seconds - sum(split.values()), 0.0)
    split["gloo_threads"] = gloo_busy
    return split


def rank_main(
    rank: int,
    arm: Arm,
    port: int,
    threads: int,
    device_type: str,
    config_json: bytes,
    settings: dict[str, Any],
    conn: Connection,
) -> None:
    """One rank: build the backend, then answer the parent's commands until ``close``."""
    try:
        import msgspec

        from actors.trainer_backend.parallel import ProcessGroup
        from actors.trainer_backend.save_staging import weights_copy
        from actors.trainer_backend.torch_backend import TorchTrainerBackend
        from schemas.config import Config

        torch.set_num_threads(threads)
        config = msgspec.json.decode(config_json, type=Config)
        cuda = device_type == "cuda"
        if cuda:
            torch.cuda.set_device(0)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        started = time.perf_counter()
        parallel = None
        if arm.sharding != "none":
            parallel = ProcessGroup(
                "fsdp2" if arm.sharding == "fsdp2" else "ddp",
                rank,
                arm.world,
                ("127.0.0.1", port),
                settings["timeout"],
                device,
            )
        backend = TorchTrainerBackend(config, parallel)
        at_step: dict[str, Any] = {}

        def measure(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            at_step.update(state_bytes=backend.state_bytes(), held=held_bytes(backend))

        conn.send(
            (
                "ready",
                {
                    "load_seconds": time.perf_counter() - started,
                    "rss_loaded": peak_rss_bytes(),
                    "gpu_loaded": torch.cuda.max_memory_allocated() if cuda else 0,
                    "threads": torch.get_num_threads(),
                },
            )
        )
        while True:
            command, argument = conn.recv()
            if command == "close":
                break
            reply: dict[str, Any] = {}
            batch = rollout(argument["rollout_id"], settings)
            if command == "train":
                hook = backend.optimizer.register_step_pre_hook(measure) if argument["measure"] else None
                if cuda:
                    torch.cuda.synchronize()
                start, cpu_start = time.perf_counter(), time.process_time()
                metrics = backend.train(batch)
                if cuda:
                    torch.cuda.synchronize()
                reply["seconds"] = time.perf_counter() - start
                reply["cpu_seconds"] = time.process_time() - cpu_start
                # What a publication costs the trainer before the transport: the weights
                # copied into staging buckets in the engines' dtype (gathered on rank 0 first
                # when sharded), as ``Trainer._stage_weights`` does.
                start = time.perf_counter()
                staged = weights_copy(backend, backend.dtype)
                if cuda:
                    torch.cuda.synchronize()
                reply["publish_seconds"] = time.perf_counter() - start
                del staged
                if hook is not None:
                    hook.remove()
                    reply.update(at_step, state_bytes_after=backend.state_bytes())
            else:  # profile: rank 0 under torch.profiler, the others as usual
                from torch.profiler import ProfilerActivity, profile

                profiler = profile(activities=[ProfilerActivity.CPU]) if rank == 0 else None
                with profiler or contextlib.nullcontext():
                    start = time.perf_counter()
                    metrics = backend.train(batch)
                    reply["seconds"] = time.perf_counter() - start
                if profiler is not None:
                    reply["split"] = profile_split(profiler, reply["seconds"])
            reply.update(
                loss=metrics.loss,
                grad_norm=metrics.grad_norm,
                steps=metrics.num_optimizer_steps,
                rss_peak=peak_rss_bytes(),
                gpu_peak=torch.cuda.max_memory_allocated() if cuda else 0,
            )
            conn.send(("done", reply))
        if parallel is not None:
            parallel.close()
        conn.send(("closed", {}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# --- the parent: one group of rank processes per arm ----------------------------------------


class Ranks:
    """The processes of one arm, started here, asked for a step at a time."""

    def __init__(
        self, arm: Arm, threads: int, device: str, config_json: bytes, settings: dict[str, Any]
    ) -> None:
        import torch.distributed as dist

        self.arm = arm
        self.timeout = settings["timeout"]
        self.store = None
        port = 0
        if arm.sharding != "none":
            # Held here for the ranks' rendezvous, as the Trainer actor holds it.
            self.store = dist.TCPStore(
                "127.0.0.1",
                0,
                arm.world,
                is_master=True,
                timeout=datetime.timedelta(seconds=self.timeout),
                wait_for_workers=False,
            )
            port = self.store.port
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.processes = []
        for rank in range(arm.world):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=rank_main,
                args=(rank, arm, port, threads, device, config_json, settings, child_end),
                daemon=True,
            )
            process.start()
            child_end.close()
            self.conns.append(parent_end)
            self.processes.append(process)
        self.ready = self._replies("ready")

    def _replies(self, expected: str) -> list[dict[str, Any]]:
        replies = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout):
                self.kill()
                raise SystemExit(
                    f"error: {self.arm.key} rank {rank} did not answer within {self.timeout:.0f} s"
                )
            kind, body = conn.recv()
            if kind == "error":
                self.kill()
                raise SystemExit(f"error: {self.arm.key} rank {rank} failed:\n{body}")
            assert kind == expected, (kind, expected)
            replies.append(body)
        return replies

    def ask(self, command: str, **argument: Any) -> list[dict[str, Any]]:
        for conn in self.conns:
            conn.send((command, argument))
        return self._replies("done")

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("close", {}))
        self._replies("closed")
        for process in self.processes:
            process.join(self.timeout)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()


# --- the bench ------------------------------------------------------------------------------


def prepare_model(args: argparse.Namespace, directory: Path) -> tuple[Path, int]:
    """The built-in Qwen2 model of ``args``' shape, written under ``directory``; its vocabulary size."""
    from miles_events.rl.hf_model import prepare_base_model
    from schemas.config import BuiltinModelConfig, ModelConfig

    longest = args.prompt_tokens + args.response_tokens + 4
    builtin = BuiltinModelConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(64, longest),
    )
    path = prepare_base_model(ModelConfig(builtin=builtin, dtype=args.dtype), directory, seed=SEED)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return path, int(vocab)


def make_config(args: argparse.Namespace, model: Path, arm: Arm, run_dir: Path) -> bytes:
    import msgspec

    from schemas.config import Config, DataConfig, ModelConfig, RunConfig, TrainerConfig

    config = Config(
        run=RunConfig(dir=str(run_dir), seed=SEED, runtime="local"),
        model=ModelConfig(path=str(model), dtype=args.dtype),
        data=DataConfig(
            rollout_batch_size=max(1, args.samples // GROUP_SIZE), n_samples_per_prompt=GROUP_SIZE
        ),
        trainer=TrainerConfig(
            num_ranks=arm.world,
            sharding=arm.sharding,  # type: ignore[arg-type]
            collective_timeout=args.timeout,
            lr=1e-6,
            global_batch_size=args.samples,
            micro_batch_size=args.micro_batch,
            shared_prompts=False,
        ),
    )
    return msgspec.json.encode(config)


def mb(num_bytes: float) -> float:
    return num_bytes / 2**20


def memory_report(arms: list[Arm], measured: dict[Arm, list[dict[str, Any]]], cuda: bool) -> dict[str, str]:
    """Print the memory table; the RESULT values."""
    single = measured[ONE_PROCESS][0]["state_bytes"]
    result: dict[str, str] = {}
    print("\nmemory per rank at the optimizer step (parameters + gradients + optimizer state), MiB")
    print(
        f"{'arm':10}{'rank':>5}{'state_bytes':>13}{'storages':>10}{'params':>9}{'grads':>8}{'optim':>8}"
        f"{'ratio':>8}{'x 1/N':>8}{'after':>8}{'rss load':>10}{'rss peak':>10}"
        + (f"{'gpu peak':>10}" if cuda else "")
    )
    goal_met = True
    for arm in arms:
        for rank, reply in enumerate(measured[arm]):
            held = reply["held"]
            ratio = reply["state_bytes"] / single
            of_share = ratio * arm.world  # 1.0: exactly 1/N of the single process's
            if arm.sharding == "fsdp2":
                goal_met = goal_met and abs(of_share - 1) <= 0.1
            print(
                f"{arm.key:10}{rank:5}{mb(reply['state_bytes']):13.1f}{mb(sum(held.values())):10.1f}"
                f"{mb(held['parameters']):9.1f}{mb(held['gradients']):8.1f}{mb(held['optimizer']):8.1f}"
                f"{ratio:8.3f}{of_share:8.3f}{mb(reply['state_bytes_after']):8.1f}{mb(reply['rss_loaded']):10.0f}"
                f"{mb(reply['rss_peak']):10.0f}" + (f"{mb(reply['gpu_peak']):10.0f}" if cuda else "")
            )
            name = f"{arm.key}_r{rank}"
            result[f"state_mb_{name}"] = f"{mb(reply['state_bytes']):.1f}"
            result[f"state_ratio_{name}"] = f"{ratio:.4f}"
            result[f"rss_mb_{name}"] = f"{mb(reply['rss_peak']):.0f}"
            if cuda:
                result[f"gpu_peak_mb_{name}"] = f"{mb(reply['gpu_peak']):.0f}"
            counted = sum(held.values())
            if abs(counted - reply["state_bytes"]) > 0.01 * counted:
                print(
                    f"  {name}: state_bytes() and the storages differ by {mb(counted - reply['state_bytes']):+.1f} MiB"
                )
    print(
        "ratio: the state over the single process's; x 1/N: over its 1/N (goal for FSDP2: within 10% of 1.0);\n"
        "storages: the distinct storages behind the same tensors; after: state_bytes() once train() returned\n"
        "(gradients released); rss: the process's peak RSS once the model was loaded, and at the end"
    )
    result["state_goal_met"] = str(goal_met).lower()
    return result


def time_report(
    arms: list[Arm],
    times: dict[Arm, list[float]],
    cpu: dict[Arm, list[float]],
    cores: int,
    goal: float | None,
) -> dict[str, str]:
    base, other = arms
    medians = {arm: statistics.median(times[arm]) for arm in arms}
    ratio = medians[other] / medians[base]
    best = min(times[other]) / min(times[base])
    per_round = [b / a for a, b in zip(times[base], times[other], strict=True)]
    print(
        f"\nstep time, {len(times[base])} interleaved rounds (slowest rank's train()), ms "
        f"(in brackets: the ranks' CPU time over the step's wall time x {cores} cores)"
    )
    for arm in arms:
        print(
            f"{arm.key:10} median {medians[arm] * 1000:8.1f}   each: "
            + ", ".join(
                f"{t * 1000:.0f} ({c / (t * cores):.0%})" for t, c in zip(times[arm], cpu[arm], strict=True)
            )
        )
    print(
        f"{other.key} / {base.key}: {ratio:.3f}x the medians, {best:.3f}x the best steps "
        f"(per round {min(per_round):.3f}-{max(per_round):.3f}x, median {statistics.median(per_round):.3f}x)"
        + (f"; goal <= {goal}x: {'met' if ratio <= goal else 'not met'}" if goal is not None else "")
    )
    result = {
        f"step_ms_{base.key}": f"{medians[base] * 1000:.1f}",
        f"step_ms_{other.key}": f"{medians[other] * 1000:.1f}",
        "step_ratio": f"{ratio:.3f}",
        "step_ratio_best": f"{best:.3f}",
    }
    if goal is not None:
        result["step_goal_met"] = str(ratio <= goal).lower()
    return result


def split_report(arm: Arm, profiled: list[tuple[float, dict[str, float]]], median: float) -> dict[str, str]:
    """Each profiled step's split; the fastest one's in full (the least disturbed by other
    load on a shared machine, as the best steps are; its parts add up to its wall time)."""
    labels = {
        "collectives": "collectives (issue, transfer, wait for the other rank)",
        "fsdp": "FSDP2's own work (copy-in/out, hooks)",
        "ops": "other ops (the model's compute, optimizer)",
        "python": "the rest (Python between ops)",
    }
    print(
        f"\n{arm.key} rank 0 under torch.profiler, {len(profiled)} steps (unprofiled median "
        f"{median * 1000:.0f} ms); % of each step: " + ", ".join(labels)
    )
    for wall, split in profiled:
        print(f"  {wall * 1000:6.0f} ms: " + ", ".join(f"{100 * split[key] / wall:.0f}%" for key in labels))
    seconds, split = min(profiled, key=lambda step: step[0])
    print(f"the fastest, {seconds * 1000:.0f} ms:")
    for key, label in labels.items():
        print(f"  {label:56}{split[key] * 1000:8.0f} ms {100 * split[key] / seconds:6.1f}%")
    print(f"  {'(gloo threads busy, beside the main thread)':56}{split['gloo_threads'] * 1000:8.0f} ms")
    return {f"{key}_fraction": f"{split[key] / seconds:.3f}" for key in labels}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16, help="per rollout (one optimizer step)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads shared by one arm's ranks",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds any rank may take to answer (and each collective)",
    )
    parser.add_argument(
        "--profile-steps", type=int, default=3, help="profiled steps of N = 2 after the rounds (0: none)"
    )
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("skipped: --device cuda asked for and no CUDA device is available")
        return 0
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks (spawned) train on the CPU
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.samples % GROUP_SIZE or args.samples < GROUP_SIZE:
        print(
            f"error: --samples {args.samples}: a positive multiple of {GROUP_SIZE} is needed", file=sys.stderr
        )
        return 2

    directory = Path(tempfile.mkdtemp(prefix="trainer-ranks-"))
    model, vocab = prepare_model(args, directory)
    settings = {
        "vocab": vocab,
        "samples": args.samples,
        "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.response_tokens,
        "timeout": args.timeout,
    }
    arms = [ONE_PROCESS, FSDP2_ONE] if cuda else [ONE_PROCESS, FSDP2_ONE, FSDP2_TWO]
    timed = [ONE_PROCESS, FSDP2_ONE] if cuda else [ONE_PROCESS, FSDP2_TWO]
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, heads "
        f"{args.heads}/{args.kv_heads}, vocab {vocab}, {args.dtype}, {args.device}; rollouts of {args.samples} "
        f"samples (prompts {args.prompt_tokens}, responses ~{args.response_tokens} tokens), one step each, "
        f"micro-batches of {args.micro_batch}; {args.cores} cores, load average {os.getloadavg()[0]:.2f}"
    )

    groups: dict[Arm, Ranks] = {}
    measured: dict[Arm, list[dict[str, Any]]] = {}
    warmup = 2
    try:
        # Started one arm at a time; two warm-up steps each, the second measured (by then the
        # optimizer state exists: at its optimizer step, parameters, gradients and state do).
        for arm in arms:
            threads = max(1, args.cores // arm.world)
            ranks = Ranks(arm, threads, args.device, make_config(args, model, arm, directory), settings)
            groups[arm] = ranks
            for rollout_id in range(warmup):
                replies = ranks.ask("train", rollout_id=rollout_id, measure=rollout_id == warmup - 1)
            measured[arm] = [{**ready, **reply} for ready, reply in zip(ranks.ready, replies, strict=True)]
            print(
                f"{arm.key}: {arm.world} rank(s), {ranks.ready[0]['threads']} thread(s) each, loaded in "
                f"{max(r['load_seconds'] for r in ranks.ready):.1f} s, warm-up step "
                f"{max(r['seconds'] for r in replies) * 1000:.0f} ms",
                flush=True,
            )
            if arm not in timed:
                ranks.close()
                del groups[arm]
        memory = memory_report(arms, measured, cuda)

        times: dict[Arm, list[float]] = {arm: [] for arm in timed}
        cpu: dict[Arm, list[float]] = {arm: [] for arm in timed}
        norms: dict[Arm, list[float]] = {arm: [] for arm in timed}
        publish: dict[Arm, list[float]] = {arm: [] for arm in timed}
        for round_number in range(args.rounds):
            for arm in timed:
                replies = groups[arm].ask("train", rollout_id=warmup + round_number, measure=False)
                times[arm].append(max(r["seconds"] for r in replies))
                cpu[arm].append(sum(r["cpu_seconds"] for r in replies))
                norms[arm].append(replies[0]["grad_norm"])
                publish[arm].append(max(r["publish_seconds"] for r in replies))
        goal = 1.1 if cuda else None
        timing = time_report(timed, times, cpu, args.cores, goal)
        staged = {arm: statistics.median(publish[arm]) for arm in timed}
        base, other = timed
        print(
            "a publication's weights staged (gathered on rank 0 when sharded, copied into buckets), "
            f"median ms: {base.key} {staged[base] * 1000:.1f}, {other.key} {staged[other] * 1000:.1f}: "
            f"{staged[other] / staged[base]:.2f}x"
        )
        timing.update(
            {
                f"publish_ms_{base.key}": f"{staged[base] * 1000:.1f}",
                f"publish_ms_{other.key}": f"{staged[other] * 1000:.1f}",
                "publish_ratio": f"{staged[other] / staged[base]:.2f}",
            }
        )
        apart = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(*norms.values(), strict=True))
        print(f"gradient norms of the two arms, largest relative difference over the rounds: {apart:.1e}")

        split: dict[str, str] = {}
        sharded = timed[1]
        if sharded.world > 1 and args.profile_steps > 0:
            profiled = []
            for number in range(args.profile_steps):
                replies = groups[sharded].ask("profile", rollout_id=warmup + args.rounds + number)
                profiled.append((replies[0]["seconds"], replies[0]["split"]))
            split = split_report(sharded, profiled, statistics.median(times[sharded]))
        for arm in list(groups):
            groups.pop(arm).close()
    finally:
        for ranks in groups.values():
            ranks.kill()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min)")
    print("RESULT " + " ".join(f"{key}={value}" for key, value in memory.items()))
    print("RESULT " + " ".join(f"{key}={value}" for key, value in {**timing, **split}.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
