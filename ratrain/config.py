"""Run configuration: frozen dataclasses loaded strictly from YAML.

Every key of the design's contract lives here, with its type and default. Loading is strict:
an unknown section or key, a value of the wrong type, or an impossible combination raises
`ConfigError` naming the key, the value, the file and what to do instead, before any work.

    cfg = load_config("jobs/tiny.yaml", overrides=["parallel.pp=2", "optim.lr=1e-3"])
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

import yaml

from ratrain.typedyaml import ConfigError, StrictLoader, build, deepcopy, to_plain

# --------------------------------------------------------------------------------------------
# Sections (deliberately plain: each a frozen dataclass of typed fields with their defaults, so
# that the sections repeat one shape; the fields are the config contract)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
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


@dataclass(frozen=True)
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    num_micro_batches: int = 1
    layers_per_stage: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.num_micro_batches * self.dp

    def check(self) -> None:
        for key in ("pp", "dp", "micro_batch", "num_micro_batches"):
            _positive(self, "parallel", key)
        if self.layers_per_stage is not None:
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
    policy: str = "ratrain"
    recompute: str = "none"
    # ratrain with dp > 1: shard each block's fp32 master and AdamW moments over the replicas
    # (ZeRO-1 per block; reduce-scatter + all-gather). The other policies never shard.
    shard_optimizer: bool = True

    POLICIES = ("baseline-1f1b", "megatron-1f1b", "ratrain", "gpipe")
    RECOMPUTE = ("none", "full", "selective", "auto")

    def check(self) -> None:
        _choice(self, "schedule", "policy", self.POLICIES)
        _choice(self, "schedule", "recompute", self.RECOMPUTE)


@dataclass(frozen=True)
class OptimConfig:
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
class DataConfig:
    tokens: str = ""  # token file; "" = the embedded default corpus (prepared on first use)
    order: str = "sequential"
    seed: int = 0
    eval_tokens: str = ""  # held-out token file; "" = the `.val` split beside `tokens`, if any
    eval_interval: int = 0  # steps between eval losses; 0 = never
    eval_batches: int = 4

    def check(self) -> None:
        _choice(self, "data", "order", ("sequential", "shuffled"))
        for key in ("seed", "eval_interval"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be >= 0")
        _positive(self, "data", "eval_batches")


@dataclass(frozen=True)
class InitConfig:
    seed: int = 1234
    from_hf: str = ""  # directory with config.json + model.safetensors; "" = random init

    def check(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"init.seed={self.seed} must be >= 0")


@dataclass(frozen=True)
class PlatformConfig:
    profile: str = "host"
    # Each of these overrides the profile's value when set (None keeps the profile's).
    ddr_bytes: int | None = None
    link_bandwidth: float | None = None  # bytes/s
    link_latency: float | None = None  # s
    compute_flops: float | None = None  # flop/s per rank
    time_scale: float = 1.0  # emulated time = platform time x time_scale
    emulate: bool = False  # throttle links and pace compute to the profile

    def check(self) -> None:
        for key in ("ddr_bytes", "link_bandwidth", "link_latency", "compute_flops"):
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ConfigError(f"platform.{key}={v} must be >= 0")
        _positive(self, "platform", "time_scale")


@dataclass(frozen=True)
class CheckpointConfig:
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
class RunConfig:
    name: str = ""  # the run's name (Slurm: the job name); run.dir defaults to runs/<name>
    dir: str = ""  # where the run writes; "" = runs/<run.name>, or runs/default without a name
    steps: int = 10
    log_interval: int = 1
    trace: bool = False
    threads: int = 0  # compute threads per rank (micro-batch split); 0 = auto
    # seconds of wall clock from start-up the run may use (0 = no limit): it stops at a step
    # boundary early enough to write a checkpoint, then exits 75 (run again to continue)
    time_limit: float = 0.0
    # signals that ask for a graceful stop (checkpoint at the next step boundary, exit 75); a
    # second one exits at once with what is committed; [] = the default actions
    stop_signals: tuple[str, ...] = ("TERM", "USR1")
    stop_grace: float = 300.0  # seconds a graceful stop may take before exiting at once; 0 = no limit

    SIGNALS = ("TERM", "INT", "USR1", "USR2", "HUP", "XCPU")

    def __post_init__(self) -> None:
        if not self.dir:  # resolved once, so that every reader sees the same path
            object.__setattr__(self, "dir", os.path.join("runs", self.name or "default"))

    def check(self) -> None:
        _positive(self, "run", "steps")
        _positive(self, "run", "log_interval")
        if self.threads < 0:
            raise ConfigError(f"run.threads={self.threads} must be >= 0 (0 = auto)")
        if os.sep in self.name or self.name in (".", ".."):
            raise ConfigError(f"run.name={self.name!r} must be a plain name (no {os.sep!r})")
        for key in ("time_limit", "stop_grace"):
            if getattr(self, key) < 0:
                raise ConfigError(f"run.{key}={getattr(self, key)} must be >= 0 (0 = no limit)")
        bad = [s for s in self.stop_signals if s.upper().removeprefix("SIG") not in self.SIGNALS]
        if bad:
            raise ConfigError(f"run.stop_signals: {bad[0]!r} is not one of {', '.join(self.SIGNALS)}")


@dataclass(frozen=True)
class CommConfig:
    # seconds: a rank that gives no sign of life this long (stopped, hung, node lost) ends the
    # job on every rank, named; also the longest a message or collective of a step may wait;
    # 0 = no watchdog
    timeout: float = 300.0

    def check(self) -> None:
        if self.timeout < 0 or 0 < self.timeout < 1:
            raise ConfigError(f"comm.timeout={self.timeout} must be 0 (off) or >= 1 second")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: str = "fp32"
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    init: InitConfig = field(default_factory=InitConfig)
    platform: PlatformConfig = field(default_factory=PlatformConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    comm: CommConfig = field(default_factory=CommConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "check"):
                sub.check()
        _choice(self, "", "precision", ("fp32", "fp16"))
        m, p = self.model, self.parallel
        if p.pp > m.layers:
            raise ConfigError(
                f"parallel.pp={p.pp} is more pipeline stages than model.layers={m.layers}: "
                "every stage needs at least one layer; lower parallel.pp"
            )
        if p.layers_per_stage is not None and sum(p.layers_per_stage) != m.layers:
            raise ConfigError(
                f"parallel.layers_per_stage={list(p.layers_per_stage)} sums to "
                f"{sum(p.layers_per_stage)} but model.layers={m.layers}"
            )
        if m.tie_embeddings and p.pp > 1:
            raise ConfigError(
                "model.tie_embeddings=true with parallel.pp>1 is not supported: the embedding "
                "and the LM head live on different stages; untie them or use parallel.pp=1"
            )

    # -- conversions ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def check_world(self, world_size: int) -> None:
        """The layout must match the launched world, before any work. Under srun, a world of
        one in a step of several tasks means srun started singletons: the error says why."""
        if world_size == self.parallel.world_size:
            return
        msg = (f"world size {world_size} != parallel.pp x parallel.dp = {self.parallel.pp} x "
               f"{self.parallel.dp} = {self.parallel.world_size}: launch "
               f"{self.parallel.world_size} ranks (mpirun -n {self.parallel.world_size}) or set "
               "parallel.pp / parallel.dp to match")
        tasks = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS", "")
        if world_size == 1 and tasks.isdigit() and int(tasks) > 1:
            msg = (f"world size 1 but srun started {tasks} tasks: each task is an MPI world of "
                   "its own, so srun's MPI plugin is not one this MPI uses; with Open MPI use "
                   "srun --mpi=pmix (RATRAIN_SRUN_MPI=pmix for slurm/train.sbatch; srun "
                   "--mpi=list shows the plugins), or RATRAIN_LAUNCHER=mpirun")
        raise ConfigError(msg)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Read `path` (YAML), apply `section.key=value` overrides, validate; raise ConfigError."""
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.load(f, Loader=StrictLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {source!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"{source}:{e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    data = deepcopy(data)
    for ov in overrides:
        _apply_override(data, ov)
    return config_from_dict(data, source)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return build(Config, data, "", source)
    except ConfigError as e:
        msg = str(e)
        if not msg.startswith(source):
            msg = f"{source}: {msg}"
        raise ConfigError(msg) from None


def _apply_override(data: dict, ov: str) -> None:
    if "=" not in ov:
        raise ConfigError(f"--set {ov!r}: expected section.key=value, e.g. --set optim.lr=1e-3")
    key, raw = ov.split("=", 1)
    parts = key.strip().split(".")
    hints = typing.get_type_hints(Config)
    if parts[0] not in hints:
        raise ConfigError(
            f"--set {ov!r}: unknown section {parts[0]!r}; sections are {', '.join(hints)}"
        )
    value = yaml.safe_load(raw) if raw.strip() else ""
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {ov!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _positive(obj, section: str, key: str) -> None:
    v = getattr(obj, key)
    if not v > 0:
        raise ConfigError(f"{section}.{key}={v} must be > 0")


def _choice(obj, section: str, key: str, choices) -> None:
    v = getattr(obj, key)
    if v not in choices:
        name = f"{section}.{key}" if section else key
        raise ConfigError(f"{name}={v!r} is not one of: {', '.join(choices)}")


__all__ = [
    "CheckpointConfig",
    "CommConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "InitConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PlatformConfig",
    "RunConfig",
    "ScheduleConfig",
    "StrictLoader",
    "config_from_dict",
    "load_config",
    "replace",
]
