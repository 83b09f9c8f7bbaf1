"""The sections of a run's configuration: one frozen dataclass each, its keys typed, defaulted,
documented in its docstring (`key: meaning`, which docs/CONFIG.md is generated from) and checked
in `check()`. `ratrain.config` assembles them into `Config` and loads them from YAML.
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.config.typedyaml import ConfigError

# --------------------------------------------------------------------------------------------
# Sections (deliberately plain: each a frozen dataclass of typed fields with their defaults, so
# that the sections repeat one shape; the fields are the config contract)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The model: a LLaMA-family decoder. With init.from_hf every key but seq_len comes from
    the imported config.json.

    vocab_size: tokens in the vocabulary (embedding rows and LM-head outputs); every id in the data
        must be below it
    hidden: width of the residual stream (model dimension)
    layers: decoder layers
    heads: attention heads (must divide hidden; hidden / heads is the head size, even for RoPE)
    kv_heads: key/value heads for grouped-query attention (must divide heads; = heads: plain
        multi-head)
    ffn_hidden: inner width of the SwiGLU MLP
    seq_len: tokens per training sequence (the context the model is trained on)
    rope_theta: RoPE base frequency
    norm_eps: RMSNorm epsilon
    tie_embeddings: share the embedding matrix with the LM head (needs parallel.pp=1)
    max_positions: longest sequence the model is meant for, exported as max_position_embeddings; 0
        = seq_len (init.from_hf: config.json's)
    """
    vocab_size: int = 256
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    ffn_hidden: int = 344
    seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_positions: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        for key in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "seq_len"):
            _positive(self, "model", key)
        if self.hidden % self.heads:
            raise ConfigError(
                f"model.heads={self.heads} does not divide model.hidden={self.hidden}: "
                "choose heads so that hidden / heads is a whole head size"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}: "
                "grouped-query attention needs heads to be a multiple of kv_heads"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model.hidden / model.heads = {self.head_dim} is odd: rotary embeddings need "
                "an even head size"
            )
        _positive(self, "model", "rope_theta")
        _positive(self, "model", "norm_eps")
        if self.max_positions and self.max_positions < self.seq_len:
            raise ConfigError(
                f"model.max_positions={self.max_positions} is below model.seq_len={self.seq_len}: "
                "raise it, or set 0 (= seq_len)"
            )

    def num_params(self) -> int:
        """Parameters of the whole model (embedding, layers, final norm, LM head)."""
        h, f, v = self.hidden, self.ffn_hidden, self.vocab_size
        kv = self.kv_heads * self.head_dim
        layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
        head = h + (0 if self.tie_embeddings else v * h)
        return v * h + self.layers * layer + head

    def flops_per_token(self) -> float:
        """Training flops per token: 6 x matmul parameters + causal attention (fwd+bwd)."""
        h, f, v = self.hidden, self.ffn_hidden, self.vocab_size
        kv = self.kv_heads * self.head_dim
        matmul = self.layers * (2 * h * h + 2 * h * kv + 3 * h * f) + v * h
        attn = self.layers * 2 * self.seq_len * h  # QK^T and PV, causal half, x2 flops/MAC
        return 6.0 * matmul + 3.0 * attn


def global_batch(micro_batch: int, num_micro_batches: int, dp: int) -> int:
    """Windows (sequences) a step trains on: every replica's micro-batches (the one definition:
    `ParallelConfig`, the planner's `Layout` and the dataset's `BatchLayout` all ask it)."""
    return micro_batch * num_micro_batches * dp


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are laid out: pp pipeline stages x dp data-parallel replicas (world size =
    pp x dp); global batch = micro_batch x num_micro_batches x dp sequences.

    pp: pipeline stages (each holds a contiguous slice of layers)
    dp: data-parallel replicas
    micro_batch: sequences per micro-batch
    num_micro_batches: micro-batches per step on each replica (gradient accumulation; the
        pipeline's m)
    layers_per_stage: layers of each stage, e.g. [3, 5]; null = as even as possible; auto = the
        planner's split for the ranks' classes (`platform.classes`): layers in proportion to
        each stage's speed, within its DDR cap, the embedding and head weighed as they cost
    replica_shares: micro-batches of each replica, e.g. [6, 6, 3, 3] (they add up to
        num_micro_batches x dp, so the global batch stays the same); null = num_micro_batches
        each; auto = the planner's shares for the replicas' speeds. The loss and the gradient
        stay the mean over every token of the global batch
    placement: pp | dp: which grid axis is laid on neighbouring ranks, hence stays inside a node
        (pp: a replica's stages, so pipeline messages stay in a node; dp: a stage's replicas, so
        the gradient all-reduce does); results are bitwise the same either way
    """
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    num_micro_batches: int = 1
    layers_per_stage: tuple[int, ...] | str | None = None
    placement: str = "pp"  # the default's case: docs/history/nodes.md, "The planner with nodes"
    replica_shares: tuple[int, ...] | str | None = None

    PLACEMENTS = ("pp", "dp")
    AUTO = "auto"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return global_batch(self.micro_batch, self.num_micro_batches, self.dp)

    @property
    def auto(self) -> tuple[str, ...]:
        """The keys left to the planner (`auto`): resolved by `ratrain.plan.hetero.resolve`."""
        return tuple(k for k in ("layers_per_stage", "replica_shares")
                     if getattr(self, k) == self.AUTO)

    @property
    def shares(self) -> tuple[int, ...]:
        """Micro-batches of each replica (`replica_shares`, or `num_micro_batches` each)."""
        if self.replica_shares == self.AUTO:
            raise ConfigError("parallel.replica_shares=auto is not resolved yet: the planner "
                              "resolves it at start-up (ratrain.plan.hetero.resolve)")
        return self.replica_shares or (self.num_micro_batches,) * self.dp

    def micro_batches_of(self, replica: int) -> int:
        return self.shares[replica]

    def share_offset(self, replica: int) -> int:
        """Micro-batches of the step before replica `replica`'s (replica r takes the global
        micro-batches [offset, offset + share))."""
        return sum(self.shares[:replica])

    def stage_layers(self):
        """`layers_per_stage` as given (None: even), refusing an unresolved `auto`."""
        if self.layers_per_stage == self.AUTO:
            raise ConfigError("parallel.layers_per_stage=auto is not resolved yet: the planner "
                              "resolves it at start-up (ratrain.plan.hetero.resolve)")
        return self.layers_per_stage

    def check(self) -> None:
        for key in ("pp", "dp", "micro_batch", "num_micro_batches"):
            _positive(self, "parallel", key)
        _choice(self, "parallel", "placement", self.PLACEMENTS)
        for key in ("layers_per_stage", "replica_shares"):
            v = getattr(self, key)
            if isinstance(v, str) and v != self.AUTO:
                raise ConfigError(f"parallel.{key}={v!r} is not a list of counts or auto: give "
                                  f"one count per {'stage' if key[0] == 'l' else 'replica'}, "
                                  "null, or auto")
        shares = self.replica_shares
        if isinstance(shares, tuple):
            if len(shares) != self.dp:
                raise ConfigError(
                    f"parallel.replica_shares={list(shares)} has {len(shares)} entries but "
                    f"parallel.dp={self.dp}: give one micro-batch count per replica")
            if any(n < 1 for n in shares):
                raise ConfigError(f"parallel.replica_shares={list(shares)}: every replica "
                                  "needs at least one micro-batch")
            if sum(shares) != self.num_micro_batches * self.dp:
                raise ConfigError(
                    f"parallel.replica_shares={list(shares)} adds up to {sum(shares)} "
                    f"micro-batches but the global batch is parallel.num_micro_batches x "
                    f"parallel.dp = {self.num_micro_batches * self.dp}: make them add up to "
                    f"{self.num_micro_batches * self.dp}")
        if isinstance(self.layers_per_stage, tuple):
            if len(self.layers_per_stage) != self.pp:
                raise ConfigError(
                    f"parallel.layers_per_stage={list(self.layers_per_stage)} has "
                    f"{len(self.layers_per_stage)} entries but parallel.pp={self.pp}: give one "
                    "layer count per stage"
                )
            if any(n < 1 for n in self.layers_per_stage):
                raise ConfigError(
                    f"parallel.layers_per_stage={list(self.layers_per_stage)}: every stage "
                    "needs at least one layer"
                )


@dataclass(frozen=True)
class ScheduleConfig:
    """When things happen (never what is computed: every policy, and every combination of its
    components, gives bitwise the same losses).

    policy: baseline-1f1b | megatron-1f1b | ratrain | gpipe: a preset of the components below
    recompute: none | selective | full | auto: what a layer's backward re-runs (auto: the fewest
        layers full that fit the DDR cap)
    sync: when each block's gradient sync starts: end (all after the stage's last backward) |
        bucket (Megatron's buckets) | layer (each block after its own last backward); unset: the
        policy's
    update: end (after the step's global facts) | next-step (deferred into the next step's
        warm-up bubble); unset: the policy's
    buffers: resident (views and gradients held all step) | per-block (a gradient from the
        block's first backward, a separate view dropped after its last); unset: the policy's
    shard_optimizer: with dp > 1, shard each block's fp32 master and AdamW moments over the
        replicas (ZeRO-1 per block; reduce-scatter + all-gather); unset: the policy's (ratrain),
        but false under sync.mode partial (which cannot shard it)
    prefetch: sharded: wait for each view's gather just before the block's first forward
        (overlapping the earlier blocks) instead of all at step start; unset: the policy's
    recovery: recompute auto: per-layer (the fewest layers that fit) | uniform (all or none);
        unset: the policy's
    """
    policy: str = "ratrain"
    recompute: str = "none"
    sync: str | None = None
    update: str | None = None
    buffers: str | None = None
    shard_optimizer: bool | None = None
    prefetch: bool | None = None
    recovery: str | None = None

    POLICIES = ("baseline-1f1b", "megatron-1f1b", "ratrain", "gpipe")
    RECOMPUTE = ("none", "full", "selective", "auto")
    SYNCS = ("end", "bucket", "layer")
    UPDATES = ("end", "next-step")
    BUFFER_MODES = ("resident", "per-block")
    RECOVERIES = ("per-layer", "uniform")

    def check(self) -> None:
        _choice(self, "schedule", "policy", self.POLICIES)
        _choice(self, "schedule", "recompute", self.RECOMPUTE)
        for key, ok in (("sync", self.SYNCS), ("update", self.UPDATES),
                        ("buffers", self.BUFFER_MODES), ("recovery", self.RECOVERIES)):
            if getattr(self, key) is not None:
                _choice(self, "schedule", key, ok)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW (torch.optim.AdamW's arithmetic) with fp32 masters, warm-up and cosine decay.

    lr: peak learning rate
    betas: AdamW (beta1, beta2)
    eps: AdamW epsilon
    weight_decay: decoupled weight decay
    grad_clip: clip the global gradient norm to this; 0 disables clipping
    warmup_steps: linear warm-up steps from 0 to lr
    lr_schedule: constant | cosine (after warm-up)
    min_lr: cosine floor
    decay_steps: cosine length after warm-up; 0 = run.steps - warmup_steps
    no_decay: parameter-name globs exempt from weight decay, e.g. "*norm*" or [embed.*, "*norm*"]
    loss_scale_init: fp16 dynamic loss scaling: initial scale (torch.amp.GradScaler's default;
        fp32 and bf16 run unscaled)
    loss_scale_window: fp16: steps without overflow before the scale doubles
    max_nonfinite_steps: consecutive steps with a non-finite loss or gradient norm (each skipped)
        after which the run stops (exit 4); 0 = auto: 1 in fp32 and bf16 (the first), 20 in
        fp16
    """
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # constant | cosine
    min_lr: float = 0.0  # cosine floor
    decay_steps: int = 0  # cosine length after warm-up; 0 = run.steps - warmup_steps
    no_decay: tuple[str, ...] = ()  # parameter-name globs exempt from weight decay
    loss_scale_init: float = 65536.0  # fp16 dynamic loss scaling (torch.amp.GradScaler defaults)
    loss_scale_window: int = 2000
    # consecutive steps with a non-finite loss or gradient norm (each one skipped) after which
    # the run stops (exit 4); 0 = auto: 1 in fp32 (the first), 20 in fp16 (overflows are normal)
    max_nonfinite_steps: int = 0

    def check(self) -> None:
        _positive(self, "optim", "lr")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(
                f"optim.betas={list(self.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.95]"
            )
        _positive(self, "optim", "eps")
        for key in ("weight_decay", "grad_clip", "warmup_steps", "min_lr", "decay_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be >= 0")
        _choice(self, "optim", "lr_schedule", ("constant", "cosine"))
        _positive(self, "optim", "loss_scale_init")
        _positive(self, "optim", "loss_scale_window")
        if self.max_nonfinite_steps < 0:
            raise ConfigError(f"optim.max_nonfinite_steps={self.max_nonfinite_steps} must be >= 0 "
                              "(0 = auto)")

    def nonfinite_limit(self, precision: str) -> int:
        """Consecutive non-finite steps that stop the run (`max_nonfinite_steps`, 0 = auto)."""
        return self.max_nonfinite_steps or (20 if precision == "fp16" else 1)


@dataclass(frozen=True)
class InitConfig:
    """Where the starting weights come from (a resumed checkpoint takes precedence).

    seed: seed of the random initialisation (each parameter a function of the seed and its name
        alone)
    from_hf: a Hugging Face LLaMA directory (config.json + safetensors) to start from; the model
        section then comes from its config.json
    """
    seed: int = 1234
    from_hf: str = ""  # directory with config.json + model.safetensors; "" = random init

    def check(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"init.seed={self.seed} must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """HDF5 checkpoints: written every interval steps and at the last step, resumed from.

    dir: checkpoints directory; "" = <run.dir>/checkpoints
    interval: steps between checkpoints (and one at the last step); 0 = none
    keep: committed checkpoints kept (older ones are deleted; before a save when the disk is
        short: a save needs room for keep + 1)
    resume: auto (the newest committed checkpoint that verifies; none at all: start fresh; some
        but none usable: an error naming each) | never (start over; checkpoints stay, metrics are
        appended to) | a checkpoint path
    on_error: a save that fails (disk full, I/O error): stop (exit 5; the last committed
        checkpoint is intact) | continue (warn and try again at the next interval)
    """
    dir: str = ""  # "" = <run.dir>/checkpoints
    interval: int = 0  # steps between checkpoints; 0 = only none
    keep: int = 2  # committed checkpoints kept (older ones pruned; before a save if space is short)
    # auto: the newest usable checkpoint (an error when there are some but none is usable) |
    # never: start over (checkpoints stay; metrics.jsonl is appended to) | PATH: that checkpoint
    resume: str = "auto"
    # a save that fails (disk full, I/O error): stop (exit 5; the last committed checkpoint is
    # intact) | continue (warn and try again at the next interval)
    on_error: str = "stop"

    def check(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"checkpoint.interval={self.interval} must be >= 0")
        _positive(self, "checkpoint", "keep")
        if not self.resume:
            raise ConfigError("checkpoint.resume is empty: use auto, never or a checkpoint path")
        _choice(self, "checkpoint", "on_error", ("stop", "continue"))


@dataclass(frozen=True)
class CommConfig:
    """Communication between ranks: the job's watchdog, and how collectives run.

    timeout: seconds a rank may give no sign of life (stopped, hung, its node lost) before the
        job ends on every rank naming it (exit 3); also the longest a message or collective of a
        step may wait; 0 = no watchdog
    allreduce: the algorithm of the runtime's all-reduces (gradients, the step's global facts):
        auto (the registry's rule, `comm.algos.choose`: hier, the rank-order fold whose bits do
        not depend on how ranks are packed into nodes) or a registered name (ring, tree, hier,
        or one registered by the program); the planner prices the same
    log_messages: debug only: print every message (rank, verb, peer, tag, bytes) to stderr;
        never changes which algorithm runs; RATRAIN_LOG_MESSAGES overrides it
    """
    timeout: float = 300.0  # seconds; 0 = no watchdog
    allreduce: str = "auto"  # auto | a name registered in ratrain.comm.algos
    log_messages: bool = False  # debug only (RATRAIN_LOG_MESSAGES)

    def check(self) -> None:
        if self.timeout < 0 or 0 < self.timeout < 1:
            raise ConfigError(f"comm.timeout={self.timeout} must be 0 (off) or >= 1 second")
        if not self.allreduce:
            raise ConfigError("comm.allreduce='' is empty: give auto or an algorithm's name")


@dataclass(frozen=True)
class SyncConfig:
    """How the data-parallel replicas stay together (schedule.sync says when a gradient sync
    starts; this section says what is synchronised).

    mode: full | partial. Full, the default, sums every gradient across the replicas at every
        step: exact. Partial is DreamDDP's layer-wise partial synchronization for slow links,
        with no gradient sync. Each replica steps on its own gradients, and each step averages
        the parameters of 1/period of the blocks across the replicas, overlapped with the
        backward. So every block is averaged once every `period` steps, and AdamW's moments
        stay local. Partial is not equivalent to full: judge it with `ratrain.compare`
    period: partial: H, the steps over which every block is averaged once (H = 1: every block
        every step)
    assign: partial: which blocks a step averages: round-robin (block i of the model, embed
        first, in step i mod period)
    average: partial: where a block's average sits in its step, after-update or before-update.
        After-update starts it after the block's update and waits for it before the block's
        next forward, so every replica goes on from the same point. With plain SGD at period 1
        that is full sync exactly, and it ends nearer full sync than before-update at the same
        speed (docs/BENCHMARKS.md, "Partial synchronization"). Before-update, DreamDDP's own,
        starts it after the block's last backward and waits before the block's update, which
        applies each replica's own update to the mean
    """
    mode: str = "full"
    period: int = 4
    assign: str = "round-robin"
    average: str = "after-update"

    MODES = ("full", "partial")
    ASSIGNS = ("round-robin",)
    AVERAGES = ("after-update", "before-update")

    def check(self) -> None:
        _choice(self, "sync", "mode", self.MODES)
        _choice(self, "sync", "assign", self.ASSIGNS)
        _choice(self, "sync", "average", self.AVERAGES)
        if self.period < 1:
            raise ConfigError(f"sync.period={self.period} must be >= 1 (the steps over which "
                              "every block is averaged once)")

    @property
    def partial(self) -> bool:
        return self.mode == "partial"

    @property
    def after_update(self) -> bool:
        """Partial sync's averages sit after the update (`average: after-update`)."""
        return self.average == "after-update"


def _positive(obj, section: str, key: str) -> None:
    v = getattr(obj, key)
    if not v > 0:
        raise ConfigError(f"{section}.{key}={v} must be > 0")


PRECISIONS = ("fp32", "fp16", "bf16")  # the values of `precision`

HALF_PRECISIONS = ("fp16", "bf16")  # 16-bit activations and working views, fp32 masters


def is_half(precision: str) -> bool:
    """Whether `precision` keeps activations and working views in 16 bits (fp16, bf16; the
    masters and optimizer state are fp32 either way): the one test of it that the kernels, the
    memory model and the planner share."""
    return precision in HALF_PRECISIONS


def act_itemsize(precision: str) -> int:
    """Bytes of one activation or working-view element: 2 in fp16 and bf16, else 4."""
    return 2 if is_half(precision) else 4


def _choice(obj, section: str, key: str, choices) -> None:
    v = getattr(obj, key)
    if v not in choices:
        name = f"{section}.{key}" if section else key
        raise ConfigError(f"{name}={v!r} is not one of: {', '.join(choices)}")


__all__ = ["HALF_PRECISIONS", "PRECISIONS", "CheckpointConfig", "CommConfig",
           "InitConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
           "ScheduleConfig", "SyncConfig", "act_itemsize", "global_batch", "is_half"]
