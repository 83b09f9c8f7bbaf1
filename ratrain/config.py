"""Run configuration: frozen dataclasses loaded strictly from YAML.

Every key of the design's contract lives here, with its type and default. Loading is strict:
an unknown section or key, a value of the wrong type, or an impossible combination raises
`ConfigError` naming the key, the value, the file and what to do instead, before any work.

    cfg = load_config("jobs/tiny.yaml", overrides=["parallel.pp=2", "optim.lr=1e-3"])
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and the fix."""


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


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are laid out: pp pipeline stages x dp data-parallel replicas (world size =
    pp x dp); global batch = micro_batch x num_micro_batches x dp sequences.

    pp: pipeline stages (each holds a contiguous slice of layers)
    dp: data-parallel replicas
    micro_batch: sequences per micro-batch
    num_micro_batches: micro-batches per step on each replica (gradient accumulation; the
        pipeline's m)
    layers_per_stage: layers of each stage, e.g. [3, 5]; null = as even as possible
    """
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
    """When things happen (never what is computed: every policy gives bitwise the same losses).

    policy: baseline-1f1b | megatron-1f1b | ratrain | gpipe: where gradient sync, update and view
        materialisation are placed
    recompute: none | selective | full | auto: what a layer's backward re-runs (auto: the fewest
        layers full that fit the DDR cap)
    shard_optimizer: under ratrain with dp > 1, shard each block's fp32 master and AdamW moments
        over the replicas
    """
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
    loss_scale_init: fp16 dynamic loss scaling: initial scale (torch.amp.GradScaler's default)
    loss_scale_window: fp16: steps without overflow before the scale doubles
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


@dataclass(frozen=True)
class DataConfig:
    """Token files (a flat uint16/uint32 array, nanoGPT's .bin layout) and the held-out eval.

    tokens: training token file; "" = the embedded default corpus (prepared on first use)
    order: sequential | shuffled windows of seq_len + 1 tokens
    seed: shuffle seed (order: shuffled)
    eval_tokens: held-out token file; "" = the val split beside tokens, if any
    eval_interval: steps between eval losses (written to eval.jsonl); 0 = never
    eval_batches: batches of the held-out file each eval reads (the same ones every time)
    tokenizer: the tokenizer of the token files: "byte" or a tokenizer.json path; "" = what the
        token file's sidecar records (filled in at start-up, carried to checkpoints and exports)
    tokenizer_sha256: SHA-256 of the tokenizer.json; "" = filled in at start-up; set: the file must
        match it
    """
    tokens: str = ""  # token file; "" = the embedded default corpus (prepared on first use)
    order: str = "sequential"
    seed: int = 0
    eval_tokens: str = ""  # held-out token file; "" = the `.val` split beside `tokens`, if any
    eval_interval: int = 0  # steps between eval losses; 0 = never
    eval_batches: int = 4
    tokenizer: str = ""
    tokenizer_sha256: str = ""

    def check(self) -> None:
        _choice(self, "data", "order", ("sequential", "shuffled"))
        for key in ("seed", "eval_interval"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key}={getattr(self, key)} must be >= 0")
        _positive(self, "data", "eval_batches")


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
class PlatformConfig:
    """The platform each rank plays (ratrain/shim/profiles); null values keep the profile's.

    profile: host (this machine, no cap, no pacing) | mt3000 | a profile YAML path
    ddr_bytes: DDR cap per rank in bytes (the ledger refuses to go over it)
    link_bandwidth: link bandwidth in bytes/s
    link_latency: link latency in s
    compute_flops: compute rate per rank in flop/s (pacing, and the peak MFU is taken against)
    time_scale: emulated time = platform time x time_scale
    emulate: throttle links and pace compute to the profile
    """
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
    """HDF5 checkpoints: written every interval steps and at the last step, resumed from.

    dir: checkpoints directory; "" = <run.dir>/checkpoints
    interval: steps between checkpoints (and one at the last step); 0 = none
    keep: committed checkpoints kept (older ones are deleted)
    resume: auto (the newest committed checkpoint, if any) | never | a checkpoint path
    """
    dir: str = ""  # "" = <run.dir>/checkpoints
    interval: int = 0  # steps between checkpoints; 0 = only none
    keep: int = 2
    resume: str = "auto"  # auto | never | PATH

    def check(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"checkpoint.interval={self.interval} must be >= 0")
        _positive(self, "checkpoint", "keep")
        if not self.resume:
            raise ConfigError("checkpoint.resume is empty: use auto, never or a checkpoint path")


@dataclass(frozen=True)
class RunConfig:
    """The run: where it writes and how long it goes.

    dir: run directory (config.yaml, metrics.jsonl, eval.jsonl, trace.json, checkpoints)
    steps: total optimizer steps (a resumed run continues up to this step)
    log_interval: steps between progress lines
    trace: write trace.json (Chrome trace events; Perfetto) at the end
    threads: compute threads per rank; 0 = the cores the launcher gives this rank (its CPU
        affinity, shared by the node's ranks that have the same cores)
    tensorboard: also log scalars to <run.dir>/tensorboard (needs the tensorboard extra:
        tensorboardX)
    """
    dir: str = "runs/default"
    steps: int = 10
    log_interval: int = 1
    trace: bool = False
    threads: int = 0  # compute threads per rank (micro-batch split); 0 = auto
    tensorboard: bool = False

    def check(self) -> None:
        _positive(self, "run", "steps")
        _positive(self, "run", "log_interval")
        if self.threads < 0:
            raise ConfigError(f"run.threads={self.threads} must be >= 0 (0 = auto)")


@dataclass(frozen=True)
class Config:
    """A run's configuration: sections of keys, and precision.

    precision: fp32 | fp16 (fp16 views and activations, fp32 masters, dynamic loss scaling)
    """
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
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def check_world(self, world_size: int) -> None:
        """The layout must match the launched world, before any work."""
        if world_size != self.parallel.world_size:
            raise ConfigError(
                f"world size {world_size} != parallel.pp x parallel.dp = {self.parallel.pp} x "
                f"{self.parallel.dp} = {self.parallel.world_size}: launch "
                f"{self.parallel.world_size} ranks (mpirun -n {self.parallel.world_size}) or set "
                "parallel.pp / parallel.dp to match"
            )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


JOBS = Path(__file__).resolve().parent / "jobs"  # the example jobs shipped in the package


def shipped_jobs() -> list[str]:
    """Names of the example jobs shipped with ratrain (`tiny`, `llama2-7b`, ...)."""
    return sorted(p.stem for p in JOBS.glob("*.yaml")) if JOBS.is_dir() else []


def job_path(path: str | os.PathLike) -> str:
    """`path` itself, or, when no such file exists and it is a bare name, the shipped job of
    that name (`tiny` -> ratrain/jobs/tiny.yaml)."""
    p = str(path)
    if os.path.exists(p) or os.sep in p:
        return p
    shipped = JOBS / (p if p.endswith(".yaml") else p + ".yaml")
    return str(shipped) if shipped.is_file() else p


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Read `path` (YAML, or the name of a shipped job), apply `section.key=value` overrides,
    validate; raise ConfigError."""
    path = job_path(path) if path is not None else None
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            jobs = ", ".join(shipped_jobs())
            raise ConfigError(
                f"config file {source!r} does not exist (shipped jobs: {jobs})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    data = _deepcopy(data)
    for ov in overrides:
        _apply_override(data, ov)
    return config_from_dict(data, source)


def with_overrides(cfg: Config, overrides, source: str = "<config>") -> Config:
    """`cfg` with `section.key=value` overrides applied as `--set` applies them; validated."""
    data = cfg.to_dict()
    for ov in overrides:
        _apply_override(data, ov)
    return config_from_dict(data, source)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return _build(Config, data, "", source)
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
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw.strip()  # not YAML (a glob such as *norm*): the text as given
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {ov!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'the top level'} must be a mapping, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the top level"
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]!s} in {where}; valid keys are: {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        kwargs[name] = _coerce(hints[name], data[name], f"{prefix}{name}", source)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - guarded above
        raise ConfigError(str(e)) from None


def _coerce(tp, value, key: str, source: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key, source)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, key, source) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key}={list(value)!r} must have {len(args)} entries")
        return tuple(_coerce(a, v, key, source) for a, v in zip(args, value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}={value!r} must be an integer")
        try:
            f = float(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be an integer") from None
        if not f.is_integer():
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be a number") from None
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover


def _positive(obj, section: str, key: str) -> None:
    v = getattr(obj, key)
    if not v > 0:
        raise ConfigError(f"{section}.{key}={v} must be > 0")


def _choice(obj, section: str, key: str, choices) -> None:
    v = getattr(obj, key)
    if v not in choices:
        name = f"{section}.{key}" if section else key
        raise ConfigError(f"{name}={v!r} is not one of: {', '.join(choices)}")


def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _deepcopy(d):
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "InitConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "PlatformConfig", "RunConfig", "ScheduleConfig",
    "config_from_dict", "job_path", "load_config", "replace", "shipped_jobs",
    "with_overrides",
]
