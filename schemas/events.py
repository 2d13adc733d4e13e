"""Every event that crosses the bus: frozen msgspec Structs in one tagged union.

Commands end in ``Requested`` (they ask for work); facts name what happened. Every event
carries the same header: ``run_id`` and ``seq`` (both stamped by the bus, ``seq`` strictly
increasing), ``time`` (seconds since the epoch, stamped where the event was made) and
``source`` (the actor that emitted it). Header fields have defaults so that an actor builds
an event with its own fields only.

Schema evolution: a field added later must have a default, so that recorded logs stay
decodable. Fields are never renamed. A field is dropped only when what it held moved
elsewhere (the per-tensor checksum maps moved to manifest files); old records still decode,
since unknown fields are skipped, and a dropped name is never reused. Fields that moved into
a record of their own (``TrainStepFinished.metrics``) are moved back into it when an old
log is read (``miles_events.bus.codec.decode_logged_event``).

Checksums: a publication's events carry SGLang's ``per_gpu_checksum`` of the tensors'
fingerprints (``digest``), their count and the path of the checksum manifest that lists
them, never the per-tensor map itself (``miles_events.rl.checksum_manifest``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Literal

import msgspec

from schemas.checkpoint import TrainerState
from schemas.checksums import CheckAction, Selector
from schemas.data import DataRef
from schemas.evidence import CheckpointRolloutEvidence
from schemas.plan import RunPlan

RunStatus = Literal["completed", "failed", "stopped"]
"""How a run ended (``RunFinished.status``)."""
PublicationPhase = Literal["stage", "load", "version"]
"""Where a publication failed (``PublicationFailed.phase``)."""
SaveReason = Literal["interval", "last", "sentinel", "request", "stop"]
"""Why a checkpoint is saved (``SaveRequested.reason``)."""


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag=True):
    """The header every event carries."""

    run_id: str = ""
    seq: int = 0
    time: float = 0.0
    source: str = ""

    advisory_fields: ClassVar[tuple[str, ...]] = ()
    """Fields that are not decisions: advice to the receiver on how to schedule its work, or
    measurements that differ from run to run as durations (``*_seconds``) do. A replay does
    not compare them (a log written before one existed could not say it)."""


# --- run lifecycle -------------------------------------------------------------------


class RunStarted(Event, frozen=True, kw_only=True):
    """The Coordinator has every actor ready and starts the seed's loop."""

    runtime: str
    config_digest: str
    start_rollout_id: int
    num_rollout: int
    num_rollout_per_epoch: int | None
    """None: ``num_rollout`` was given, so no epoch-end triggers (as in miles)."""
    resumed: bool = False
    weight_version: str = "default"
    """The trainer's version at start: ``"default"`` on a fresh run, the saved one on resume."""
    engines: list[str] = []
    rollout_only: bool = False
    """``run.rollout_only_from_checkpoint``: prove the checkpoint's publication, then only
    generate."""
    checkpoint_iteration: int | None = None
    """The iteration of the checkpoint root the trainer loaded, when it loaded one."""
    trainer_ranks: int = 1
    """``trainer.num_ranks``: the processes that train (1 in logs written before ranks)."""
    trainer_sharding: str = "none"
    """How the trainer's ranks share the model, ``trainer.sharding`` resolved: ``fsdp2``,
    ``ddp``, or ``none`` (one rank, no process group)."""
    regenerated: list[int] = []
    """On resume: the rollouts from ``start_rollout_id`` on that the runs before asked for
    (queued, in flight, generated or trained after the checkpoint): none of their samples is
    kept, each is generated again with the same id, prompts and seeds."""


class StopRequested(Event, frozen=True, kw_only=True):
    """Someone (a user, a sentinel, a failure) asks the run to stop."""

    reason: str
    now: bool = False
    """False: after the current step (its save and publication), as the seed's
    ``should_stop``. True: the step in progress ends at its next cancellation point (it is
    not trained on, nothing half-trained is kept) and the run stops after the last complete
    step."""


class StepCancelled(Event, frozen=True, kw_only=True):
    """A step in progress ended at a cancellation point (a stop with ``now``); nothing it
    did is kept."""

    rollout_id: int
    phase: Literal["generate", "eval", "train"]
    reason: str = ""


class RunFinished(Event, frozen=True, kw_only=True):
    status: RunStatus
    reason: str = ""
    last_rollout_id: int = -1
    weight_version: str = "default"
    """The version the engines serve at the end (the oldest of them when a publication that
    failed part-way left them apart; each engine's is in its last ``WeightsLoaded``)."""


class ActorFailed(Event, frozen=True, kw_only=True):
    """A handler raised, or an actor process died. The run stops with this message."""

    actor: str
    error: str
    """One line: exception type, message and where it was raised."""
    event_type: str = ""
    event_seq: int = -1
    traceback: str = ""
    """The full traceback, for post-mortems from the event log."""


class DataReleased(Event, frozen=True, kw_only=True):
    """The consumer of a bulk-data reference is done with it; its owner frees it."""

    ref: DataRef


# --- rollouts and training --------------------------------------------------------------


class RolloutRequested(Event, frozen=True, kw_only=True):
    rollout_id: int


class SampleExcerpt(msgspec.Struct, frozen=True, kw_only=True):
    """One sample of a rollout or an evaluation, kept in the event log so that a reader can
    see what the policy wrote (``python -m miles_events.replay LOG --samples``).

    Texts (prompt, response, label) longer than ``rollout.log_sample_chars`` keep their
    beginning and their end, joined by ``…``; ``prompt_chars`` and ``response_chars`` are
    the lengths before the cut.
    """

    index: int
    """Position of the prompt in the dataset."""
    group: int
    """The prompt's group in its rollout (samples of one prompt share it)."""
    prompt: str
    """The prompt text as the engine was given it."""
    response: str
    """The text the engine returned."""
    label: str
    """The prompt's label, as the reward function was given it."""
    reward: float
    """What the reward function gave the response."""
    response_tokens: int
    """Tokens of the response (the whole response, not the kept text)."""
    finish_reason: str
    """``"stop"`` or ``"length"``, as in ``schemas.rollout.Sample``."""
    weight_version: str
    """The weight version of the engine that sampled it."""
    prompt_chars: int
    """Characters of the whole prompt."""
    response_chars: int
    """Characters of the whole response."""


class RolloutGenerated(Event, frozen=True, kw_only=True):
    rollout_id: int
    batch: DataRef
    """A ``schemas.rollout.RolloutBatch`` in the data plane."""
    num_samples: int
    reward_mean: float
    weight_versions: list[str]
    """The distinct weight versions the samples were generated with, sorted."""
    response_tokens: int = 0
    generate_seconds: float = 0.0
    samples: list[SampleExcerpt] = []
    """``rollout.log_samples`` of the rollout's samples, their texts cut to
    ``rollout.log_sample_chars``: the first sample of each prompt in group order, then the
    second of each, and so on. Empty with ``rollout.log_samples = 0`` and in logs written
    before samples were kept."""


class TrainMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What training on one rollout did, as the trainer backend reports it.

    ``loss``, ``pg_loss``, ``kl``, ``entropy`` and ``clipfrac`` are token-level means over
    every response token of the rollout (each step's values weighted by its tokens);
    ``grad_norm`` is the pre-clip gradient norm of the rollout's last optimizer step;
    ``num_optimizer_steps`` counts this rollout's steps only.
    """

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    clipfrac: float = 0.0
    train_tokens: int = 0
    num_optimizer_steps: int = 0
    lr: float = 0.0
    """The learning rate of the rollout's last optimizer step (``trainer.lr_decay_style``)."""
    importance_weight: float = 0.0
    """With ``trainer.rollout_is_cap``: the mean truncated importance weight of the trained
    tokens (1 where the engine sampled with the trainer's weights)."""


class RankStep(msgspec.Struct, frozen=True, kw_only=True):
    """One trainer rank's part of training on a rollout, as that rank measured it."""

    rank: int
    """The rank in the trainer's process group (0: the Trainer's own process)."""
    pid: int
    """The rank's process id."""
    step_seconds: float
    """Wall time of the rank's part of the rollout's training."""
    peak_memory_bytes: int
    """The rank process's peak memory so far: on a GPU, CUDA's maximum allocated bytes
    (``torch.cuda.max_memory_allocated``: tensors, not the caching allocator's reserve);
    on CPU, the process's peak resident set size (``getrusage``'s ``ru_maxrss``)."""
    state_bytes: int
    """Bytes of the model parameters, gradients and optimizer state this rank holds: its
    shard under FSDP2, a whole replica under DDP."""


class TrainStepFinished(Event, frozen=True, kw_only=True):
    rollout_id: int
    weight_version: str
    """The trainer's version when the batch was consumed (the one being improved upon)."""
    metrics: TrainMetrics = TrainMetrics()
    """The backend's report, as it gave it."""
    staleness_max: int = 0
    """Trainer version minus the oldest version a sample was generated with."""
    token_staleness: list[int] = []
    """How many trained response tokens were sampled ``i`` publications behind the trainer's
    version, at index ``i`` (tokens left out are not counted)."""
    stale_samples: int = 0
    """Samples left out of training because a token was older than ``run.max_staleness``
    publications (``run.staleness_policy`` ``drop``, and ``wait`` should one occur)."""
    stale_tokens: int = 0
    """Response tokens older than the bound: of the samples left out, or masked (``mask``)."""
    trained_prompts: list[int] = []
    """The dataset index of the prompt of each sample trained on, in sample order: a run's
    log says which prompts its steps trained (a resumed run's, exactly once)."""
    train_seconds: float = 0.0
    critic_only: bool = False
    """PPO before ``trainer.num_critic_only_steps``: the critic trained, the policy did not."""
    ranks: list[RankStep] = []
    """One entry per trainer rank, in rank order. Empty from a single-process trainer that
    did not report its ranks, and in logs written before they were reported. Timings,
    memory and pids differ from run to run: a replay does not compare them."""

    advisory_fields: ClassVar[tuple[str, ...]] = ("ranks",)


class CriticMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """What training the critic on one rollout did: token-level means over every response
    token of the rollout (each optimizer step's weighted by its tokens)."""

    value_loss: float = 0.0
    """PPO's clipped value loss, ``0.5 * max((V - R)^2, (V_clip - R)^2)``."""
    value_clipfrac: float = 0.0
    """Share of tokens whose clipped error was the larger."""
    value_mean: float = 0.0
    """The critic's values of the rollout before it trained on it."""
    return_mean: float = 0.0
    """The GAE returns it was trained towards."""
    grad_norm: float = 0.0
    train_tokens: int = 0
    num_optimizer_steps: int = 0
    lr: float = 0.0


class CriticStepFinished(Event, frozen=True, kw_only=True):
    """The critic valued every response token of rollout ``rollout_id`` (with its weights
    before this rollout: the values PPO's advantages are computed from) and then trained on
    it. ``values`` holds them in the data plane (msgpack: sample position -> one value per
    response token), owned by the critic until the policy's trainer releases it."""

    rollout_id: int
    values: DataRef
    metrics: CriticMetrics = CriticMetrics()
    train_seconds: float = 0.0
    ranks: list[RankStep] = []
    """One entry per critic rank, as ``TrainStepFinished.ranks``."""

    advisory_fields: ClassVar[tuple[str, ...]] = ("ranks",)


class EvalRequested(Event, frozen=True, kw_only=True):
    rollout_id: int


class EvalFinished(Event, frozen=True, kw_only=True):
    rollout_id: int
    metrics: dict[str, float]
    weight_versions: list[str] = []
    eval_seconds: float = 0.0
    samples: list[SampleExcerpt] = []
    """``rollout.log_samples`` of the evaluation's samples, chosen and cut as
    ``RolloutGenerated.samples``."""


# --- publication saga --------------------------------------------------------------------


class PublishRequested(Event, frozen=True, kw_only=True):
    """Publish the trainer's current weights to every engine."""

    rollout_id: int | None = None
    """None for the initial publication ("always update weights first")."""


class ProbeBatch(msgspec.Struct, frozen=True):
    """The behavioural probe of one publication (``miles_events.rl.probe``): token ids, and
    the trainer's log-probability of every response token with the published weights."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]


class WeightsStaged(Event, frozen=True, kw_only=True):
    """The trainer put version ``weight_version`` in the data plane, with the digest of it."""

    weight_version: str
    weights: DataRef
    digest: str
    """SGLang's ``per_gpu_checksum`` over the fingerprint of every published tensor not in
    ``verifier.skip_tensor_list``: of exactly the bytes published."""
    num_tensors: int
    """Tensors the digest covers."""
    num_bytes: int
    """Bytes staged in the data plane."""
    checksums_manifest: str = ""
    """The checksum manifest of those tensors (name -> fingerprint), relative to the run
    directory: ``checksums/<digest>.msgpack``."""
    rollout_id: int | None = None
    stage_seconds: float = 0.0
    canary: str = ""
    """The fingerprint of the publication canary the payload carries
    (``miles_events.rl.canary``); "" in logs recorded before canaries."""
    probe: ProbeBatch | None = None
    """The behavioural probe, when the run probes publications (``verifier.probe``)."""


class WeightsLoadStarted(Event, frozen=True, kw_only=True):
    """Asynchronous training (``run.max_staleness``): the Generator began loading the
    publication of ``weight_version`` on its engines. A publication may wait behind the
    rollout being generated; its load timeout (``publisher.load_timeout``) counts from here."""

    weight_version: str


class WeightsLoaded(Event, frozen=True, kw_only=True):
    """One engine now serves ``weight_version``; the digest is of what it serves."""

    engine: str
    weight_version: str
    previous_version: str
    digest: str
    """SGLang's ``per_gpu_checksum`` over the fingerprint of every served tensor not in
    ``verifier.skip_tensor_list``."""
    num_tensors: int = 0
    """Tensors the digest covers."""
    num_bytes: int = 0
    """Bytes the engine loaded."""
    checksums_manifest: str = ""
    """The checksum manifest of those tensors, relative to the run directory."""
    checksum_error: str = ""
    """Why the engine's checksum reply after this load cannot be used (one line naming the
    engine and, where it lies there, the rank); ``digest`` is then "" and the Verifier
    reports a mismatch with this reason. "" when the reply was usable."""
    load_seconds: float = 0.0
    canary: str | None = None
    """The fingerprint of the publication canary the engine holds after this load ("" for
    none); None when the engine cannot hold one."""
    probe_logprobs: list[list[float]] | None = None
    """The engine's log-probabilities of the publication's probe batch after this load;
    None when the publication carried no probe."""
    restore: bool = False
    """A restarted engine loaded the current publication again (``run.ft_components``):
    not part of a publication saga; the Verifier answers it with ``RestoreVerified``."""


class WeightsPublished(Event, frozen=True, kw_only=True):
    """Every engine loaded ``weight_version`` with the version semantics of the seed."""

    weight_version: str
    engines: list[str]
    previous_versions: list[str]
    rollout_id: int | None = None
    stage_seconds: float = 0.0
    load_seconds: float = 0.0
    publish_seconds: float = 0.0


class PublicationFailed(Event, frozen=True, kw_only=True):
    weight_version: str
    phase: PublicationPhase
    reason: str
    rollout_id: int | None = None


class TensorMismatch(msgspec.Struct, frozen=True):
    engine: str
    tensor: str
    """The tensor's name; ``"*"`` when the tensors cannot be named (see ``reason``)."""
    expected: str
    """Trainer fingerprint, or "" when the engine serves a tensor the trainer did not publish
    (with ``tensor="*"``: the trainer's digest)."""
    actual: str
    """Engine fingerprint, or "" when the engine is missing the tensor (with ``tensor="*"``:
    the engine's digest)."""
    reason: str = ""
    """Why the tensors are not named, e.g. a checksum manifest that cannot be read."""


class PublicationVerified(Event, frozen=True, kw_only=True):
    weight_version: str
    digest: str
    num_tensors: int
    engines: list[str]
    rollout_id: int | None = None
    verify_seconds: float = 0.0
    write_proof: Literal["canary", "none"] = "none"
    """``canary``: every engine also showed this publication's canary, so each load applied
    the payload; ``none``: the digests alone (an engine that cannot hold a canary)."""
    probe_max_diff: float | None = None
    """With the behavioural probe: the largest difference of a probe token's log-probability,
    trainer against any engine (within ``verifier.probe_tolerance``); None without one."""


class PublicationMismatch(Event, frozen=True, kw_only=True):
    weight_version: str
    mismatches: list[TensorMismatch]
    expected_digest: str
    engine_digests: dict[str, str]
    rollout_id: int | None = None
    verify_seconds: float = 0.0


# --- engine weight checks (SGLang's weights_checker actions) ------------------------------


class WeightsCheckRequested(Event, frozen=True, kw_only=True):
    action: CheckAction
    selector: Selector = "all"
    skip_tensor_list: list[str] = []
    allow_quant_error: bool = False
    request_id: str = ""


class WeightsCheckFinished(Event, frozen=True, kw_only=True):
    engine: str
    action: str
    success: bool
    message: str = ""
    digest: str = ""
    """``checksum``: SGLang's ``per_gpu_checksum`` over the engine's checksums flattened as
    miles does (``rank{r}/{name}`` for every rank); "" for the other actions."""
    num_tensors: int = 0
    """Tensors the action covered."""
    checksums_manifest: str = ""
    """``checksum``: the checksum manifest of the engine's tensors, relative to the run
    directory."""
    weight_version: str = "default"
    request_id: str = ""


# --- rollout-only evidence ------------------------------------------------------------


class PublicationEvidenceRequested(Event, frozen=True, kw_only=True):
    """The checkpoint-backed publication is proven: write its evidence file at ``path``."""

    path: str
    evidence: CheckpointRolloutEvidence


class PublicationEvidenceWritten(Event, frozen=True, kw_only=True):
    path: str
    served_digest: str
    """The evidence's ``served_language_checksum_sha256``."""


class PublicationEvidenceFailed(Event, frozen=True, kw_only=True):
    path: str
    reason: str


# --- checkpoints ---------------------------------------------------------------------


class SaveRequested(Event, frozen=True, kw_only=True):
    rollout_id: int
    reason: SaveReason = "interval"
    publication_follows: bool = False
    """The Coordinator asks for the publication of the same rollout right after (the
    seed's save, then update_weights): a trainer staging the save in the background starts
    its host copy once that publication is staged, which then shares nothing with it."""

    advisory_fields: ClassVar[tuple[str, ...]] = ("publication_follows",)


class TrainStateStaged(Event, frozen=True, kw_only=True):
    """The trainer's full state after training ``rollout_id`` is in the data plane.

    ``weights`` holds the model's tensors under their Hugging Face names (no tied
    duplicates); ``optimizer`` and ``rng`` hold ``torch.save`` bytes of the optimizer's
    state dict and of the RNG states; ``trainer_state`` is saved as ``trainer_state.json``.
    """

    rollout_id: int
    weights: DataRef
    optimizer: DataRef
    rng: DataRef
    trainer_state: TrainerState
    reason: str = "interval"


class CriticStateStaged(Event, frozen=True, kw_only=True):
    """The critic's state after training ``rollout_id`` is in the data plane, as
    ``TrainStateStaged``'s: a PPO run's checkpoint holds both (its ``critic/`` directory)."""

    rollout_id: int
    weights: DataRef
    optimizer: DataRef
    rng: DataRef
    num_optimizer_steps: int


class CheckpointSaved(Event, frozen=True, kw_only=True):
    rollout_id: int
    path: str
    weight_version: str
    """The version the saved weights were trained from (the trainer's when the rollout's
    batch reached it); they are published as the next, and a run resumed from them
    publishes them under that same next number."""
    num_bytes: int
    save_seconds: float = 0.0


class CheckpointFailed(Event, frozen=True, kw_only=True):
    rollout_id: int
    reason: str


# --- offload and onload (run.offload_train, run.offload_rollout) ----------------------------

MemoryTarget = Literal["rollout", "actor", "critic"]
"""Whose device memory: the engines' (``rollout``), the trainer's (``actor``) or the critic's."""
MemoryTag = Literal["cuda_graph", "kv_cache", "weights"]
"""An engine's kinds of device memory, by SGLang's names (``GPU_MEMORY_TYPE_*``). A trainer
group has one kind: all it holds (weights, gradients, optimizer state); its tags are empty."""


class MemoryPart(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine, or one trainer rank, released or took back."""

    name: str
    """``engine-0``..., or ``rank-0``..."""
    device: str
    """Where the memory was: ``cuda:0``, ``cpu``."""
    bytes: int
    """Tensor bytes moved to a host copy or dropped (offload), or put back (onload); a
    server engine, which does not say, reports 0."""
    device_free_before: int = 0
    """The device's free bytes (``torch.cuda.mem_get_info``) before; 0 off CUDA."""
    device_free_after: int = 0
    """... and after: on CUDA, what really came free (or was taken) is the difference."""
    seconds: float = 0.0


class _MemoryCommand(Event, frozen=True, kw_only=True):
    target: MemoryTarget
    tags: list[MemoryTag] = []
    rollout_id: int | None = None
    """The step it belongs to; None before the first rollout."""
    request_id: str = ""


class OffloadRequested(_MemoryCommand, frozen=True, kw_only=True):
    """Release ``target``'s device memory of kinds ``tags`` (the seed's
    ``rollout_manager.offload(tags)``, ``actor_model.offload()``)."""


class OnloadRequested(_MemoryCommand, frozen=True, kw_only=True):
    """Take ``target``'s device memory of kinds ``tags`` back (the seed's ``onload_weights``,
    ``onload_kv``, ``actor_model.onload()``)."""


class _MemoryFact(_MemoryCommand, frozen=True, kw_only=True):
    parts: list[MemoryPart] = []
    """One per engine or trainer rank."""
    seconds: float = 0.0

    advisory_fields: ClassVar[tuple[str, ...]] = ("parts",)


class MemoryOffloaded(_MemoryFact, frozen=True, kw_only=True):
    """``target`` released its memory of kinds ``tags``, as the request with ``request_id``
    asked. A trainer group that offloads itself (after a PPO step, as the seed's
    ``train()`` does) says so with an empty ``request_id``."""


class MemoryOnloaded(_MemoryFact, frozen=True, kw_only=True):
    """``target`` took its memory of kinds ``tags`` back. A trainer group onloads itself at
    the start of its next step (``request_id`` empty)."""


# --- external policy sync (``run.external_policy_sync_path``) -------------------------------

PolicySyncHook = Literal["initialize", "after_inference_publication", "after_local_train", "finalize"]
"""The hooks of an external policy synchronizer, as the seed calls them."""
ModelRole = Literal["actor", "critic"]
"""Whose weights: the policy's trainer (``actor``) or PPO's critic."""


class PolicySyncRequested(Event, frozen=True, kw_only=True):
    """The Coordinator asks the policy-sync driver to run one hook of the plugin."""

    hook: PolicySyncHook
    rollout_id: int | None = None
    """The step the hook is about; None for ``initialize``, ``finalize`` and the
    ``after_inference_publication`` of the initial publication."""


class PolicySyncFinished(Event, frozen=True, kw_only=True):
    hook: PolicySyncHook
    rollout_id: int | None = None
    stop: bool = False
    """``after_local_train`` returned a truthy value: the run stops after this step's
    publication."""
    seconds: float = 0.0

    advisory_fields: ClassVar[tuple[str, ...]] = ("seconds",)


class PolicySyncFailed(Event, frozen=True, kw_only=True):
    """A hook raised or timed out: the run fails with this reason."""

    hook: PolicySyncHook
    rollout_id: int | None = None
    reason: str


class ModelWeightsRequested(Event, frozen=True, kw_only=True):
    """Stage the current trained weights of ``role`` in the data plane (for a plugin)."""

    request_id: str
    role: ModelRole = "actor"


class ModelWeightsStaged(Event, frozen=True, kw_only=True):
    """The answer to ``ModelWeightsRequested``: the weights (Hugging Face names, the train
    dtype) in the data plane, owned by the trainer until the reader releases them with
    ``DataReleased``; ``digest`` is ``miles_events.device.fingerprint.weights_digest`` of them."""

    request_id: str
    role: ModelRole = "actor"
    weights: DataRef
    digest: str
    num_tensors: int
    weight_version: str
    """The trainer's version (the one last published); "" for the critic."""


class ModelWeightsLoadRequested(Event, frozen=True, kw_only=True):
    """Load ``weights`` (a plugin's, in the data plane, owned by the requester) into the
    live model of ``role``, keeping its optimizer state. The policy's next publication
    publishes them."""

    request_id: str
    role: ModelRole = "actor"
    weights: DataRef
    digest: str
    """``weights_digest`` of them, checked before they are loaded."""


class ModelWeightsLoaded(Event, frozen=True, kw_only=True):
    """The answer to ``ModelWeightsLoadRequested``; the reader is done with its weights."""

    request_id: str
    role: ModelRole = "actor"
    digest: str = ""
    """``weights_digest`` of the model's weights after the load; "" when it failed."""
    error: str = ""
    """Why the weights were not loaded (one line); "" when they were."""


# --- fault tolerance and the control server -------------------------------------------

FaultMode = Literal["sigkill", "exit", "segfault", "deadlock"]
"""How ``inject-fault`` breaks a cell (miles' modes): SIGKILL, a clean exit, SIGSEGV, or
SIGSTOP (the process hangs, holding what it holds)."""


class CheckpointRequested(Event, frozen=True, kw_only=True):
    """Someone (the control server's ``POST /api/v1/save``) asks for a checkpoint: the
    current step's, once it is trained (or the last trained step's, when none is running)."""

    reason: str = ""


class CellSuspendRequested(Event, frozen=True, kw_only=True):
    """Suspend (``suspend``) or resume a cell (``PATCH /api/v1/cells/{name}``): a
    suspended engine is stopped and given no work; resumed, it is started again with the
    current weights."""

    cell: str
    suspend: bool


class FaultInjectionRequested(Event, frozen=True, kw_only=True):
    """``POST /api/v1/cells/{name}/inject-fault``: break process ``sub_index`` of the cell."""

    cell: str
    mode: FaultMode
    sub_index: int = 0


class FaultInjected(Event, frozen=True, kw_only=True):
    """The fault was delivered: ``pid`` got the signal (or was asked to exit)."""

    cell: str
    mode: FaultMode
    pid: int
    sub_index: int = 0
    error: str = ""
    """Why the fault was not delivered (no such process, one shared with the actor); ""
    when it was."""


class CellFailed(Event, frozen=True, kw_only=True):
    """A cell's process died or hung (or a fault could not be delivered: ``restart``
    False): the actor that owns it restarts it unless its restarts are spent."""

    cell: str
    reason: str
    """One line: what was seen (``engine-1 (pid 123) died: killed by SIGKILL``)."""
    hung: bool = False
    """Its health checks went unanswered (it was killed); False: it died."""
    restarts: int = 0
    """Restarts of this cell before this failure."""
    rollout_id: int | None = None
    """The rollout in flight, whose prompts on this cell are sampled again."""


class CellRestarted(Event, frozen=True, kw_only=True):
    """The cell runs again: a new process, given the current weights (``weight_version``)."""

    cell: str
    attempt: int
    """1 for the first restart of this cell in the run."""
    pid: int
    weight_version: str
    restart_seconds: float
    """From the failure seen to the weights loaded again."""


class CellSuspended(Event, frozen=True, kw_only=True):
    cell: str


class CellResumed(Event, frozen=True, kw_only=True):
    cell: str
    pid: int
    weight_version: str


class CellHealth(Event, frozen=True, kw_only=True):
    """A cell's health changed (its health endpoint or heartbeat answered, or stopped
    answering ``failures`` times in a row)."""

    cell: str
    healthy: bool
    reason: str = ""


HealStep = Literal["suspend", "resume", "done", "failed"]


class CellHealing(Event, frozen=True, kw_only=True):
    """A step of the mini FT controller's heal of an unhealthy cell (``run.mini_ft_controller``)."""

    cell: str
    step: HealStep
    reason: str = ""
    """Why the heal failed (``failed``)."""
    backoff_seconds: float = 0.0
    """How long the controller leaves the cell alone after a failed heal."""


class RestoreVerified(Event, frozen=True, kw_only=True):
    """A restarted engine serves the current publication again: its digest (and canary,
    probe) match what the trainer published as ``weight_version``."""

    engine: str
    weight_version: str
    digest: str
    write_proof: Literal["canary", "none"] = "none"
    probe_max_diff: float | None = None


class TrainerRestoreRequested(Event, frozen=True, kw_only=True):
    """The trainer's group was restarted after a rank failed (``"train"`` in
    ``run.ft_components``): load ``checkpoint``, the latest the run saved (None: the state
    the run started from), whose last rollout is ``rollout_id``. The rollouts in ``redo``,
    trained or in training after it, are generated and trained again, with the same ids."""

    checkpoint: str | None
    rollout_id: int
    """The last rollout the restored state has trained (``start_rollout_id - 1`` for the
    run's start)."""
    redo: list[int] = msgspec.field(default_factory=list)


class TrainerRestored(Event, frozen=True, kw_only=True):
    """The restarted trainer holds the state of ``checkpoint`` (None: the run's start); its
    next publication is the version after ``weight_version``."""

    checkpoint: str | None
    rollout_id: int
    weight_version: str
    restore_seconds: float = 0.0


AnyEvent = (
    RunStarted
    | StopRequested
    | StepCancelled
    | RunFinished
    | ActorFailed
    | DataReleased
    | RolloutRequested
    | RolloutGenerated
    | TrainStepFinished
    | CriticStepFinished
    | EvalRequested
    | EvalFinished
    | PublishRequested
    | WeightsStaged
    | WeightsLoadStarted
    | WeightsLoaded
    | WeightsPublished
    | PublicationFailed
    | PublicationVerified
    | PublicationMismatch
    | WeightsCheckRequested
    | WeightsCheckFinished
    | PublicationEvidenceRequested
    | PublicationEvidenceWritten
    | PublicationEvidenceFailed
    | SaveRequested
    | TrainStateStaged
    | CriticStateStaged
    | CheckpointSaved
    | CheckpointFailed
    | OffloadRequested
    | OnloadRequested
    | MemoryOffloaded
    | MemoryOnloaded
    | PolicySyncRequested
    | PolicySyncFinished
    | PolicySyncFailed
    | ModelWeightsRequested
    | ModelWeightsStaged
    | ModelWeightsLoadRequested
    | ModelWeightsLoaded
    | CheckpointRequested
    | CellSuspendRequested
    | FaultInjectionRequested
    | FaultInjected
    | CellFailed
    | CellRestarted
    | CellSuspended
    | CellResumed
    | CellHealth
    | CellHealing
    | RestoreVerified
    | TrainerRestoreRequested
    | TrainerRestored
)
"""The tagged union every decoder uses; the tag is the class name, under ``"type"``."""

EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__
EVENT_TYPES_BY_NAME: dict[str, type[Event]] = {t.__name__: t for t in EVENT_TYPES}


# --- the plan a run announces ------------------------------------------------------------

PLAN_FIELDS: tuple[str, ...] = tuple(
    name for name in RunStarted.__struct_fields__ if name in RunPlan.__struct_fields__
)
"""The fields of the run plan that ``RunStarted`` records, under the same names."""


def run_started(plan: RunPlan) -> RunStarted:
    """The ``RunStarted`` that announces ``plan``."""
    return msgspec.convert({name: getattr(plan, name) for name in PLAN_FIELDS}, RunStarted)


def plan_of(event: RunStarted) -> RunPlan:
    """The plan a recorded ``RunStarted`` announced (what re-driving an actor needs)."""
    return msgspec.convert({name: getattr(event, name) for name in PLAN_FIELDS}, RunPlan)


def kept_steps(events: Iterable[Event]) -> list[TrainStepFinished]:
    """The training steps a run kept, in order: a trainer that went back to a checkpoint
    (``TrainerRestoreRequested``), or a run resumed from one (``RunStarted``), drops the steps
    trained after it, and trains them again."""
    kept: list[TrainStepFinished] = []
    for event in events:
        if isinstance(event, TrainStepFinished):
            kept.append(event)
        elif isinstance(event, TrainerRestoreRequested):
            kept = [e for e in kept if e.rollout_id <= event.rollout_id]
        elif isinstance(event, RunStarted):
            kept = [e for e in kept if e.rollout_id < event.start_rollout_id]
    return kept
