"""Typed schemas for every config node.

Each node of the composed Hydra config is validated against one of these
frozen, keyword-only dataclasses (see :mod:`miles.config.validate`) and the
driver hands the resulting objects to actors: actors never see OmegaConf.

A field named ``target`` maps to the YAML key ``_target_`` (and ``partial``
to ``_partial_``); :class:`TargetConfig` nodes carry free keyword arguments
that :func:`miles.config.build` checks against the target's signature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

_frozen = dict(frozen=True, kw_only=True)

# YAML key -> dataclass field name, for the two Hydra special keys.
SPECIAL_KEYS = {"_target_": "target", "_partial_": "partial"}

HOOK_OPTIONAL_KEY = "_optional_"
"""Reserved key of a ``hooks`` entry: ``true`` makes the hook optional (its errors are counted, not
fatal). It stays in the entry's ``kwargs`` (so the YAML round-trips) and is never passed to the
hook's constructor."""


@dataclass(**_frozen)
class TargetConfig:
    """A callable named by a dotted path, plus the keyword arguments to call it with."""

    target: str
    """Dotted path of the callable (YAML key ``_target_``); must match ``plugins.allow``."""
    partial: bool = False
    """Return ``functools.partial`` instead of calling (YAML key ``_partial_``)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Every other key of the node: keyword arguments of the callable."""


@dataclass(**_frozen)
class ModelConfig:
    """Which model: a spec function, its size flavor, and an optional HF checkpoint."""

    target: str = "miles.models.qwen3.qwen3_spec"
    """Spec function returning a :class:`miles.models.spec.ModelSpec`."""
    flavor: str = "tiny"
    """Named size of the spec (``tiny`` builds offline on CPU)."""
    path: str | None = None
    """HF checkpoint directory; when set its ``config.json`` wins over the flavor."""
    freeze_vision: bool = False
    """A vision-language model's vision tower and merger stay as built (not trained); text models refuse true."""


@dataclass(**_frozen)
class WarmStartConfig:
    """Supervised warm start that gives a freshly built tiny model partial skill on the task."""

    steps: int = 200
    """SFT optimizer steps (0 disables the warm start)."""
    batch_size: int = 128
    """Examples per SFT step."""
    lr: float = 5e-3
    """AdamW learning rate for the warm start."""
    max_tokens_per_microbatch: int = 8192
    """Padded tokens (rows x longest row) per forward/backward: a batch over it is sorted by length and
    split, gradients accumulated (same loss; less padding on answers of varied length). 0: one pass."""
    cache_dir: str = "~/.cache/miles/checkpoints"
    """Where built checkpoints are cached, keyed by a hash of everything that shapes them."""


@dataclass(**_frozen)
class AlgoConfig:
    """The RL algorithm: advantage estimator, policy loss and its knobs."""

    name: str = "grpo"
    """Name shown in logs and MLflow."""
    num_prompts_per_step: int = 32
    """Prompts drawn from the task per step."""
    num_samples_per_prompt: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    advantage: TargetConfig = field(
        default_factory=lambda: TargetConfig(
            target="miles.algos.advantages.group_normalized", partial=True, kwargs={"normalize_std": True}
        )
    )
    """Advantage estimator: ``(rewards [G, n]) -> advantages [G, n]``."""
    policy_loss: TargetConfig = field(
        default_factory=lambda: TargetConfig(target="miles.algos.losses.ppo_clip_loss", partial=True)
    )
    """Per-token policy loss (see :mod:`miles.algos.losses`)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (ratio <= 1 + clip_high)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term in the loss (0 keeps no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """Per-token KL estimator (Schulman's k1/k2/k3; low_var_kl is k3 clamped to [-10, 10] as in verl)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "token_mean"
    )
    """How per-token losses become one number (*_norm divides by rollout.max_new_tokens, Dr. GRPO)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout: the batch is split into this many mini-batches."""
    estimator: Literal["group", "gae"] = "group"
    """Advantage source: ``group`` calls ``advantage`` on the [G, n] rewards; ``gae`` uses the critic + GAE per token."""
    gamma: float = 1.0
    """GAE discount in [0, 1] (``estimator: gae``)."""
    lam: float = 0.95
    """GAE lambda in [0, 1] (``estimator: gae``)."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the batch's valid tokens (``estimator: gae``)."""
    critic: CriticConfig = field(default_factory=lambda: CriticConfig())
    """The learned value function (``estimator: gae`` only)."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment: ramp to -1 over the last this many tokens before rollout.max_new_tokens (0: off)."""
    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong punishment (0: off)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: groups whose rewards are all equal are dropped and replaced by fresh prompts
    (:func:`miles.rollout.filters.nonzero_reward_std` ahead of ``rollout.filters``; over-sampling up to
    ``rollout.max_oversample_rounds``)."""
    distill_coef: float = 0.0
    """On-policy distillation (``algo=opd``, docs/distillation.md): each response token's advantage gets
    ``distill_coef * (log q - log p)``, the teacher's (``teacher.model``) log-prob of the token minus the
    policy's sampling log-prob: minus the per-token estimate of the reverse KL ``KL(p || q)``; 0: off."""
    task_reward_weight: float = 1.0
    """With ``distill_coef`` > 0: the weight of the task's own advantage (from ``advantage`` on the rewards)
    in every token's advantage; 0: the teacher's signal alone."""
    routing_replay: Literal["rollout", "off"] = "off"
    """MoE rollout routing replay (R3): ``rollout`` makes the trainer's forward send every token to the
    experts the engine chose (gate weights still from the trainer's router; :mod:`miles.train.routing_replay`)
    and has the engines record them (``capture_routing``); torch engine, FSDP or Megatron trainer, MoE
    models only; turns off ``trainer.shared_prompt_forward``. ``off``: the trainer routes by itself."""


@dataclass(**_frozen)
class CriticConfig:
    """The value model of PPO (``algo.estimator: gae``): same checkpoint as the policy plus a value head."""

    target: str = "miles.train.critic.FSDPCritic"
    """Critic backend (YAML key ``_target_``): a class meeting :class:`miles.backends.Critic`, one Ray actor
    per rank of ``placement.trainer_world_size``, a process group of its own."""
    lr: float = 1.0e-3
    """AdamW learning rate of the critic."""
    lr_warmup_steps: int = 0
    """Critic optimizer steps over which its learning rate rises linearly to ``lr`` (0: none)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip of the critic (0 disables)."""
    value_clip: float | None = 0.5
    """New values stay within this of the rollout-time values in the loss (PPO2 value clip); null disables."""


@dataclass(**_frozen)
class PrecisionConfig:
    """Numerics of training and rollout, and the mismatch correction they need."""

    name: str = "fp32"
    """Recipe name shown in logs."""
    train_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the trainer (master weights and optimizer stay fp32)."""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the rollout engine."""
    rollout_quant: Literal["none", "fp8_block", "mxfp8", "nvfp4", "int4"] = "none"
    """Format the engine's weights are fake-quantized to each time weights reach it
    (:mod:`miles.precision.recipe`); only the torch engine supports formats other than ``none``."""
    train_quant: Literal["none", "fp8_block", "mxfp8", "nvfp4", "int4"] = "none"
    """Format the trainer's forward computes with, gradients straight through to the fp32 master
    weights (quantization-aware training); ``none`` or the same as ``rollout_quant``; the Megatron trainer
    runs the 1-D block formats (``int4``, ``mxfp8``: :mod:`miles.train.megatron.quant`)."""
    quant_block_size: int = 128
    """Block of the weight format: tile edge of ``fp8_block`` (128 x 128 tiles), group size of ``int4``;
    must be 32 for ``mxfp8`` and 16 for ``nvfp4`` (fixed by those formats)."""
    tis_clip: float | None = None
    """Mismatch correction threshold C on exp(train_logp - rollout_logp), for both modes; null: 2.0
    when correction is on (see ``mismatch_correction``)."""
    mismatch_correction: Literal["auto", "on", "off"] = "auto"
    """``auto``: correct (TIS / MIS with ``tis_clip``) when rollout and training dtypes or weight formats
    differ, and whenever ``tis_clip`` is set; ``on``: always; ``off``: never (``tis_clip`` is ignored, and a run
    whose numerics differ logs a warning)."""
    true_on_policy: bool = False
    """Engine and trainer compute every sequence with one forward at a fixed padded length (prompt +
    ``rollout.max_new_tokens``), so rollout and recomputed log-probs are bitwise equal
    (:mod:`miles.precision.on_policy`); torch engine (no KV cache: one forward per generated token) and
    FSDP trainer (one forward per sequence) only, same dtype and weight format on both sides, dense models."""
    mismatch_mode: Literal["tis", "mis"] = "tis"
    """Ratios above tis_clip are truncated to it (tis) or their tokens / sequences dropped (mis)."""
    mismatch_level: Literal["token", "sequence"] = "token"
    """Ratio per token, or one per sequence (product of its token ratios)."""


@dataclass(**_frozen)
class PlacementConfig:
    """Where actors live: Ray placement groups shared by engines and trainers (colocate) or one per pool."""

    name: Literal["colocate", "disaggregated"] = "colocate"
    """``colocate``: engines and trainer ranks share bundles and take turns; ``disaggregated``: separate pools
    (engines and trainer ranks in their own processes and CPUs; with the synchronous loop they still take
    turns: rollout, then train, then sync)."""
    device: Literal["cpu", "cuda", "auto"] = "auto"
    """Where engines and trainer ranks compute. ``cuda``: one GPU per bundle (NCCL groups; untested on a GPU
    so far); ``auto``: ``cuda`` when the Ray cluster has GPUs, else ``cpu``."""
    num_engines: int = 1
    """Rollout engine actors."""
    trainer_world_size: int = 1
    """Trainer rank actors (one torch.distributed group)."""
    cpus_per_bundle: float = 1.0
    """colocate: CPUs per shared bundle (max(num_engines, trainer_world_size) bundles)."""
    cpus_per_engine: float = 1.0
    """disaggregated: CPUs per engine bundle (engine pool: num_engines bundles)."""
    cpus_per_trainer_rank: float = 1.0
    """disaggregated: CPUs per trainer-rank bundle (trainer pool: trainer_world_size bundles)."""
    engine_resources: Mapping[str, float] | None = None
    """Custom Ray resources per engine bundle, e.g. ``{node2: 1}`` (colocate: added to each shared bundle)."""
    trainer_resources: Mapping[str, float] | None = None
    """Custom Ray resources per trainer-rank bundle (colocate: added to each shared bundle)."""
    offload_engines: bool | None = None
    """colocate: engines release memory (KV cache, weights) while the trainer trains; ignored by disaggregated.
    ``None``: when the engine class can (``release_memory`` / ``resume_memory``; the torch engine can, SGLang's
    CPU engine cannot); ``true`` with an engine that cannot is a config error."""
    torch_threads_per_actor: int = 0
    """torch threads in each engine and trainer actor; 0: the cores the driver and reward workers leave, shared
    among engines and trainer ranks, at most a disaggregated actor's bundle CPUs, at least 1 (miles.core.plan)."""
    huge_pages: bool = True
    """Engine and trainer actors put CPU tensors of 2 MiB or more on transparent huge pages (torch's
    ``THP_MEM_ALLOC_ENABLE=1``): fewer page faults when a released engine regrows its KV cache and fewer
    TLB misses in memory-bound decode steps (CPU only; GPU memory is unaffected)."""
    ready_timeout_s: float = 60.0
    """How long to wait for the placement group(s) before failing with the numbers."""


@dataclass(**_frozen)
class RolloutConfig:
    """The rollout engine and sampling parameters."""

    engine: TargetConfig = field(
        default_factory=lambda: TargetConfig(target="miles.rollout.torch_engine.TorchEngine",
                                             kwargs={"max_batch_size": 256, "max_prefill_tokens": 8192,
                                                     "prefix_cache_tokens": 65536})
    )
    """Engine backend: a class meeting :class:`miles.backends.RolloutEngine` (one Ray actor per engine);
    the node's other keys are its constructor arguments besides those the driver passes
    (:data:`miles.backends.ENGINE_INIT_ARGS`)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are of the temperature-scaled distribution)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 8
    """Cap on generated tokens per response."""
    eval_temperature: float = 1.0
    """Sampling temperature of ``eval/accuracy`` (0: greedy, one sample per prompt)."""
    eval_samples_per_prompt: int = 4
    """Samples per held-out prompt; ``eval/accuracy`` is their mean reward (pass@1 estimated from k samples)."""
    generate_fn: TargetConfig = field(
        default_factory=lambda: TargetConfig(target="miles.rollout.generate.single_turn", partial=True)
    )
    """Per-prompt ``async (ctx, problem, sampling) -> list[Sample]`` (see :mod:`miles.rollout.protocols`)."""
    filters: tuple[TargetConfig, ...] = ()
    """Group filters ``(group) -> (keep, reason)`` on training rollouts, e.g. ``miles.rollout.filters.nonzero_reward_std``."""
    max_oversample_rounds: int = 3
    """Extra rollout rounds that refill a batch whose groups the filters dropped (0: never refill)."""
    request_timeout_s: float = 600.0
    """Deadline of one engine call; past it the call is aborted and its requests retried elsewhere."""
    request_timeout_per_1k_tokens_s: float = 0.0
    """Added to ``request_timeout_s`` per 1000 tokens of the longest prompt in the call (0: a fixed deadline)."""
    session_affinity: bool = True
    """Send a request continuing a session (``GenerateRequest.session_id``) to the engine that served it."""
    max_retries: int = 2
    """Retries of a request after a timeout, an engine error or a dead engine; then its group fails."""
    max_inflight_samples_per_engine: int = 256
    """Samples in flight per engine; more wait in the manager's queue for the first engine with room."""
    max_requests_per_call: int = 32
    """Queued requests sent together in one engine call (1: every request its own call)."""
    max_engine_restarts: int = 3
    """Engines that died or hung replaced by new actors over the run, in their placement bundles, at weight
    pushes (:mod:`miles.core.recovery`; with ``placement=disaggregated`` and other engines in rotation the
    push starts a replacement without waiting for it, and a later push puts it in rotation); 0: a dead
    engine leaves the rotation for good."""
    engine_timeout_s: float = 30.0
    """Calls to an engine other than generation (the health check at each weight push, the memory offload
    of ``placement.offload_engines``): an engine that does not answer within it is taken out as hung (and
    replaced, within ``max_engine_restarts``)."""
    max_outage_s: float = 300.0
    """With no engine in rotation, how long the run waits for replacements to come up before it ends
    with an error; also how long a replacement may take to start before it is killed and started again."""
    health_interval_s: float = 10.0
    """While a rollout has calls in flight on an engine, the engine is asked for its health this often;
    one that does not answer within ``engine_timeout_s`` (hung) is taken out of rotation at once and its
    calls are retried on the others, without waiting out ``request_timeout_s``. The engines without
    calls in flight (between rollouts) are asked as often by the idle watch, and one found hung or dead
    is taken out at the next call to the engines (:mod:`miles.rollout.dispatch`). 0: no health checks
    on an interval (the weight push still checks every engine)."""


@dataclass(**_frozen)
class TrainerConfig:
    """The trainer backend, optimizer and the length of the run."""

    target: str = "miles.train.fsdp.FSDPTrainer"
    """Trainer backend (YAML key ``_target_``): a class meeting :class:`miles.backends.Trainer`, one Ray
    actor per rank of ``placement.trainer_world_size``."""
    tensor_parallel: int = 1
    """Tensor-parallel size (a backend that supports it: ``trainer=megatron``)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel stages, 1F1B schedule (a backend that supports it: ``trainer=megatron``)."""
    expert_parallel: int = 1
    """Expert-parallel size for MoE models (a backend that supports it: ``trainer=megatron``)."""
    num_steps: int = 300
    """RL steps (rollout -> train -> sync) in the run."""
    lr: float = 5e-4
    """AdamW learning rate."""
    lr_warmup_steps: int = 20
    """Optimizer steps over which the learning rate rises linearly to ``lr`` (0: none)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup: constant, or linear/cosine decay to ``min_lr_ratio * lr`` at step num_steps x num_minibatches."""
    min_lr_ratio: float = 0.0
    """Final learning rate of a decaying ``lr_schedule``, as a fraction of ``lr`` (0 to 1)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0 disables)."""
    max_nonfinite_steps: int = 5
    """Stop the run when this many steps in a row skipped an update because the loss or gradient norm was
    not finite (each such update is skipped and counted in ``train/nonfinite_skipped``); 0: never stop."""
    max_failures: int = 3
    """How many times over the run a trainer (or critic) rank that dies is recovered, under every schedule:
    the rank group is restarted in its placement bundles, restored from the run's last checkpoint (which
    ``save_every`` must have written) and the step retried (:mod:`miles.core.recovery`); 0: a dead rank
    ends the run. Runs with ``tenants`` do not recover: a dead rank ends them."""
    hang_timeout_s: float = 30.0
    """While the driver waits on the trainer (and critic) ranks (a train step, the weight push, a
    checkpoint's save or load), each is probed every 10 s at most, in a thread of its own that answers
    while the rank computes or waits on a peer; a rank that does not answer within this many seconds is
    hung (stopped, or stuck holding the interpreter): it is killed, and handled as a dead rank (see
    ``max_failures``). 0: no probes; a hung rank blocks the step until its process group's own timeout."""
    max_tokens_per_microbatch: int = 8192
    """Padded tokens (rows x longest row) per forward/backward, rows sorted by length so each pass pads
    only to its own longest (the responses alone when the prompts are shared); gradients accumulate over
    passes, the loss is the same (0: one pass)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of storing them."""
    shared_prompt_forward: bool = True
    """Compute each distinct prompt of a rank's mini-batch once and attend its n responses to it (same
    log-probs and gradients; :mod:`miles.train.shared_prompt`), where it saves 5% of the tokens on
    every rank. Off with activation checkpointing."""
    skip_zero_advantage: bool = True
    """Leave the samples with advantage 0 on every loss token out of the forward and backward passes
    when they add nothing to the update: a built-in PPO-family policy loss
    (:func:`miles.algos.losses.vanishes_at_zero_advantage`), ``algo.kl_coef: 0`` and
    ``algo.entropy_coef: 0``. The loss keeps their tokens in its normalization, so the update is the
    same; the per-token metrics (entropy, clip fractions, ...) are then means over the samples computed.
    ``train/skipped_samples`` counts the others."""
    eval_every: int = 50
    """Evaluate every this many steps (and always at step 0 and at the end); 0: only ends."""
    save_every: int = 0
    """Write a run checkpoint (trainer state, loop state, config, and last a SHA-256 manifest:
    :mod:`miles.core.resume`) after every this many steps and after the last one; 0: never. A save is
    refused when a parameter is not finite."""
    save_dir: str | None = None
    """Where run checkpoints go, one ``step_<k>`` directory each; null: ``checkpoints`` in the job's
    output directory under ``python -m miles`` (required when the run is started otherwise)."""
    keep_checkpoints: int = 2
    """How many of the newest run checkpoints to keep in ``save_dir`` (older ones are deleted)."""
    resume_from: str | None = None
    """Continue a run from a checkpoint: a ``step_<k>`` directory, a ``save_dir`` (its newest complete one),
    or ``auto``: the newest complete checkpoint in ``save_dir`` (required then), or a fresh start, logged,
    when there is none, so that re-running a killed run's command continues it. Steps ``k + 1`` to
    ``num_steps`` then run as they would have without the stop (same prompts, sampling noise and updates);
    the step-0 evaluation is not repeated. A path that is missing, incomplete (no manifest), damaged
    (a file that does not match its manifest) or written for another model shape or tokenizer is an error."""


@dataclass(**_frozen)
class TaskConfig:
    """Where prompts come from and how responses are scored."""

    name: str = "largest"
    """Task name shown in logs."""
    source: TargetConfig = field(
        default_factory=lambda: TargetConfig(
            target="miles.tasks.largest.LargestNumberTask", kwargs={"list_len": 5, "max_value": 99}
        )
    )
    """Task object (prompts, references, tokenizer corpus)."""
    reward: TargetConfig = field(
        default_factory=lambda: TargetConfig(target="miles.tasks.procedural.exact_answer_reward", partial=True)
    )
    """Reward function ``(response_text, label) -> float`` (``reward_kind: group``: ``(responses, label) -> list``)."""
    eval_reward: TargetConfig | None = None
    """Reward of the held-out evaluation (``eval/accuracy`` is its mean), called as ``reward`` is; null:
    ``reward``. Set it when the training reward is shaped (e.g. :func:`miles.agent.rewards.tool_answer_reward`'s
    bonus for working tool calls), so that held-out accuracy stays the task's own score."""
    reward_kind: Literal["sample", "group"] = "sample"
    """``sample``: one reward call per response; ``group``: one call per prompt's group of responses."""
    reward_timeout_s: float = 10.0
    """Deadline of one reward call, run in a worker process (miles.rewards.runner); 0: in-process, no deadline."""
    reward_num_workers: int = 1
    """Reward worker processes (each call's items are split among them)."""
    num_eval_prompts: int = 128
    """Size of the held-out evaluation set."""


@dataclass(**_frozen)
class TrackingConfig:
    """Experiment tracking."""

    backend: Literal["mlflow", "none"] = "mlflow"
    """``mlflow`` logs params, metrics and the config; ``none`` logs to the console only."""
    uri: str | None = None
    """Tracking URI; default ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlruns.db`` in the working directory."""
    experiment: str = "miles"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name (default: algo-model-precision-seed)."""
    plots: bool = True
    """At the end of the run, PNG plots (reward, eval accuracy, response length, phase times) as artifacts."""
    system_metrics: bool = False
    """Log MLflow's system metrics (CPU, memory, disk, network; GPU with nvidia-ml-py) as ``system/*``."""
    system_metrics_interval_s: float = 10.0
    """Seconds between system-metric samples."""
    request_timeout_s: float = 10.0
    """Timeout of one request to the tracking server (sets ``MLFLOW_HTTP_REQUEST_TIMEOUT`` unless set)."""
    flush_timeout_s: float = 30.0
    """At the end of the run, wait at most this long for buffered data to reach the server."""
    prometheus_port: int | None = None
    """Serve live metrics for Prometheus at ``http://127.0.0.1:<port>/metrics`` while the run goes on
    (docs/observability.md); 0 takes a free port (printed at start); None: no exporter."""
    timeline_steps: tuple[int, ...] = ()
    """Steps whose timeline is recorded: every actor's busy spans as a Chrome trace
    (``timeline/step_<N>.json``) and a Gantt chart (``plots/timeline_step_<N>.png``), MLflow artifacts
    (:mod:`miles.tracking.timeline`, docs/observability.md); empty: none, and no actor is wrapped."""
    timeline_dir: str | None = None
    """Also write the timelines of ``timeline_steps`` into this directory (with ``tracking=none`` the
    only place they go); None: MLflow artifacts only."""


@dataclass(**_frozen)
class ProfileConfig:
    """Torch profiler traces of chosen steps (:mod:`miles.core.profiling`)."""

    steps: tuple[int, ...] = ()
    """Record the trainer ranks and torch engines during these steps (rollout, train and weight sync);
    empty: never."""
    dir: str = "profiles"
    """Where the traces go: ``<dir>/<run name>/step_<n>/<actor>.json.gz``; also MLflow artifacts under
    ``profile/step_<n>/``."""


@dataclass(**_frozen)
class ClusterConfig:
    """The Ray cluster."""

    address: str | None = None
    """Join this Ray cluster; None starts a local one."""
    num_cpus: int | None = None
    """CPUs of a locally started cluster (None: all of the machine)."""
    dashboard_port: int | None = None
    """Start the locally started cluster with Ray's dashboard at ``http://127.0.0.1:<port>`` (actors, logs,
    CPU and memory per process); None: no dashboard."""
    reuse_actors: bool = True
    """Keep a finished job's actors for the next job of the same shape in this driver, while Ray stays up
    (a sweep's jobs, jobs run from Python): each actor is constructed anew in its process, which skips
    the process start and its imports. Disaggregated, a job that differs only on the trainer side keeps
    the engines alone. Parked actors that cannot be rebuilt (one died) are replaced by new ones, with a
    warning. False: every job starts and stops its own actors."""


@dataclass(**_frozen)
class PluginsConfig:
    """User code that configs may name."""

    allow: tuple[str, ...] = ()
    """Extra ``_target_`` prefixes allowed besides ``miles.`` and ``torch.optim.``."""


@dataclass(**_frozen)
class WeightSyncConfig:
    """How each new version of the weights travels from trainer rank 0 to the engines (miles.weights)."""

    transport: Literal["auto", "object_store", "broadcast", "disk", "shm", "ipc"] = "auto"
    """``auto`` (``object_store``, then ``shm`` where it works: miles.weights.auto), ``object_store`` (Ray),
    ``broadcast`` (gloo/NCCL group), ``disk`` (safetensors), ``shm`` (/dev/shm, one node), ``ipc`` (CUDA IPC
    handles; colocated on a GPU, untested so far)."""
    bucket_mb: float = 128.0
    """broadcast: MiB per flattened bucket (bounds the sender's staging memory)."""
    broadcast_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """broadcast: collective backend; ``auto`` is NCCL when the process sees CUDA, else gloo."""
    timeout_s: float = 120.0
    """broadcast: seconds a rank waits for the others (rendezvous and each bucket) before the sync fails."""
    disk_dir: str | None = None
    """disk: directory of the version directories (null: a fresh temp dir; several nodes need a shared one)."""
    shm_dir: str = "/dev/shm"
    """shm (and auto): tmpfs directory of the shared-memory segment (engines must be on trainer rank 0's node)."""


@dataclass(**_frozen)
class ScheduleConfig:
    """When rollouts run relative to train steps, and how old a trained sample may be (miles.core.schedules)."""

    name: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """``sync``: rollout, train, sync in turn; ``one_step_off``: the next batch's rollout overlaps the train
    step; ``fully_async``: groups generated continuously into a buffer. The last two need disaggregated placement."""
    max_staleness: int = 0
    """Async: a group whose oldest token is more than this many weight versions behind the trainer is dropped."""
    update_interval: int = 1
    """Async: train steps between weight pushes to the engines."""
    buffer_batches: int = 1
    """Async: how far the engines may work ahead of the trainer, in batches of ``algo.num_prompts_per_step`` groups."""
    behaviour_is_clip: float = 2.0
    """Async: cap of the truncated importance weight exp(proximal - behaviour log-prob) (decoupled PPO); >= 1."""


@dataclass(**_frozen)
class AdapterConfig:
    """Parameter-efficient training (``adapter=``): ``none`` trains every weight, ``lora`` trains LoRA
    adapters with ``peft`` while the base weights stay frozen (:mod:`miles.adapters.lora`)."""

    kind: Literal["none", "lora"] = "none"
    """``none``: full fine-tuning; ``lora``: low-rank adapters on ``target_modules``."""
    rank: int = 4
    """LoRA rank r."""
    alpha: float = 8.0
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """LoRA dropout; must be 0 (the trainer's passes run without dropout, like the engine's)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                       "lm_head")
    """Names of the linear layers that get an adapter (on the tiny model, ``lm_head`` among them took the
    default run from +0.12 to +0.27 ``eval/accuracy``)."""
    lr: float | None = None
    """Learning rate of the adapter parameters; null: ``trainer.lr``."""
    export_dir: str | None = None
    """Where the adapters are written in PEFT format at every run checkpoint and at the end; null: the
    run's output directory (``<hydra output dir>/adapters``)."""


@dataclass(**_frozen)
class TenantConfig:
    """One tenant of a multi-LoRA run (``tenants:``): its own adapter, task, reward, prompt template and
    sampling, trained on the shared base model (:mod:`miles.core.tenants`)."""

    name: str
    """The tenant's name: its adapter's name, its metrics' prefix (``tenant/<name>/``), its export directory."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Its task and reward, as under ``task:``; a task group option's name (``task: count``) reads
    ``conf/task/<name>.yaml``."""
    prompt_template: str = "{prompt}"
    """Text around each of its prompts before the chat template; must contain ``{prompt}``."""
    temperature: float | None = None
    """Sampling of its rollouts; null: ``rollout.temperature`` (and likewise below)."""
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    teacher: ModelConfig | None = None
    """On-policy distillation: this tenant's own teacher, a model spec like ``teacher.model``, served by
    ``teacher.num_engines`` engines of its own; null: ``teacher.model`` (each tenant still gets engines of its own)."""


@dataclass(**_frozen)
class DraftConfig:
    """Speculative rollout (``draft:``, docs/speculative.md): a small draft model proposes ``k`` tokens per
    row that the policy verifies in one forward (exact speculative sampling in the torch engine)."""

    model: ModelConfig | None = None
    """The draft's model spec, built like ``model`` (``_target_``, ``flavor``, ``path``; a built flavor is
    warm-started on the run's task like the policy); null (and ``heads`` false): speculation off. Its tokenizer must
    be the policy's."""
    heads: bool = False
    """The draft is the policy's own ``k`` extra heads (:mod:`miles.models.draft_heads`): each reads the policy's
    last hidden state and proposes one of the next ``k`` tokens through the policy's LM head, so proposing costs
    no forward of a second model. Warm-started on the run's task with the policy frozen; excludes ``model``."""
    k: int = 4
    """Tokens the draft proposes per row and step (the policy verifies all ``k + 1`` positions at once)."""
    online: bool = False
    """Train the draft on the policy's samples of every step (the forward KL from the policy at their response
    tokens, at the rollout temperature) in an actor of its own, and push its weights to the engines with the
    policy's; a draft trainer that dies is replaced up to ``trainer.max_failures`` times. false: the draft stays
    as loaded, and its acceptance rate falls as the policy moves away from it."""
    wait: bool = True
    """``draft.online`` (no effect without it): every weight push waits for the draft's training on that step's
    samples. false: a push whose draft training still runs keeps the engines' draft (``draft/lag_steps``: how old
    its newest batch is) and the draft trainer takes a batch only when free, so a slow draft no longer sets the
    step time (the default run with online heads: 0.13 s a step instead of 0.29 s), but which batches it learns
    then depends on timing (docs/speculative.md)."""
    lr: float | None = None
    """The draft's AdamW learning rate (``draft.online``; draft heads also in their warm start); null: 3e-3 for a draft
    model, 1e-2 for draft heads. With a tiny draft of the 20m policy, 3e-3 kept the acceptance through 100 GRPO
    steps on two seeds, 1e-3 on one of them; heads of that policy accepted more and kept it at 1e-2 than at 3e-3
    (docs/speculative.md)."""
    lr_warmup_steps: int = 20
    """The online draft's learning rate rises linearly to ``lr`` over its first this many steps (0: none). Adam's
    first updates move every weight by about ``lr``: without it a tiny draft of a 20m policy fell from 0.72 to
    0.15 acceptance in its first step (docs/speculative.md)."""


@dataclass(**_frozen)
class TeacherConfig:
    """On-policy distillation's teacher (``teacher:``, docs/distillation.md): a second model, served by
    engines of its own, that scores each of the policy's samples token by token (``algo.distill_coef``)."""

    model: ModelConfig | None = None
    """The teacher's model spec, built like ``model`` (``_target_``, ``flavor``, ``path``; a built flavor is
    warm-started on the run's task like the policy); null: no teacher. Its tokenizer must be the policy's."""
    num_engines: int = 1
    """Teacher engines (actors of ``rollout.engine``'s class, from the teacher's checkpoint)."""
    placement: Literal["colocate", "own"] = "colocate"
    """``colocate``: teacher engine ``i`` sits on the rollout engines' bundle ``i % n`` and holds no CPUs of its
    own (it scores between rollouts); ``own``: a pool of its own, ``cpus_per_engine`` per bundle."""
    cpus_per_engine: float = 1.0
    """CPUs of each bundle of the teacher's own pool (``placement: own`` only)."""
    top_k: int = 0
    """Also keep the teacher's ``top_k`` most likely tokens per response token
    (``Sample.metadata["teacher_top_logprobs"]``); 0: off."""
    timeout_s: float = 600.0
    """How long one scoring call may take before its engine counts as lost."""


@dataclass(**_frozen)
class MilesConfig:
    """The whole run."""

    seed: int = 0
    """Seeds data, sampling and model init."""
    preset: str = "tiny"
    """The experiment preset the run was composed from (``experiment=``, ``conf/experiment/``); ``tiny`` (the
    default) holds the tiny model's settings and refuses a real checkpoint, ``none`` is no preset."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model spec axis (``model=``)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm axis (``algo=``)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Precision recipe axis (``precision=``)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Placement axis (``placement=``)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine (``rollout=``)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer (``trainer=``)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Task (``task=``)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Tracking (``tracking=``)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start of freshly built tiny models."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray cluster."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Torch profiler traces of chosen steps."""
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    """User code allowed in ``_target_``."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight-sync transport axis (``weight_sync=``)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Schedule axis (``schedule=``): synchronous, one step off-policy or fully asynchronous."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """Adapter axis (``adapter=``): full fine-tuning or LoRA."""
    tenants: tuple[TenantConfig, ...] = ()
    """Multi-LoRA tenants (needs ``adapter=lora``): each trains its own adapter on its own task every
    step; empty: one policy on ``task``."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """Speculative rollout's draft model (``draft.model``; null: off)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation's teacher (``teacher.model``; null: none)."""
    hooks: tuple[TargetConfig, ...] = ()
    """Hook chain (:mod:`miles.hooks`): objects called in list order at named points of the loop
    (``on_run_start``, ``after_rollout``, ``after_reward``, ``before_train``, ``after_train``,
    ``after_weight_sync``, ``after_eval``, ``on_checkpoint``, ``on_run_end``), each a method of the
    point's name; a hook implements any of them. Every other key of an entry is a constructor argument,
    except the reserved ``_optional_: true`` (:data:`HOOK_OPTIONAL_KEY`): an exception from that hook is
    logged and counted in ``hooks/errors`` instead of failing the run. Checked before Ray starts."""


# The config groups selectable from the command line, and their schema.
GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "algo": AlgoConfig,
    "precision": PrecisionConfig,
    "placement": PlacementConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "task": TaskConfig,
    "tracking": TrackingConfig,
    "weight_sync": WeightSyncConfig,
    "schedule": ScheduleConfig,
    "adapter": AdapterConfig,
}


def to_yaml_dict(d: Any) -> Any:
    """Rename dataclass field names back to YAML keys (``target`` -> ``_target_``), recursively."""
    inverse = {v: k for k, v in SPECIAL_KEYS.items()}
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            if k == "kwargs" and isinstance(v, Mapping) and "target" in d:
                out.update({kk: to_yaml_dict(vv) for kk, vv in v.items()})
            else:
                out[inverse.get(k, k)] = to_yaml_dict(v)
        return out
    if isinstance(d, tuple | list):
        return [to_yaml_dict(x) for x in d]
    return d
