"""Run configuration: frozen dataclasses loaded strictly from YAML.

Every key of the design's contract lives here, with its type and default. Loading is strict:
an unknown section or key, a value of the wrong type, or an impossible combination raises
`ConfigError` naming the key, the value, the file and what to do instead, before any work.

    cfg = load_config("jobs/tiny.yaml", overrides=["parallel.pp=2", "optim.lr=1e-3"])

The package: the sections, one dataclass each with its keys documented (`sections`), and here
`Config`, which holds them, and the loading (YAML through `typedyaml`'s strict loader,
`--set` overrides, the shipped jobs). May import: PyYAML, `ratrain.device` (the
names of `run.device`); nothing else of ratrain (every package reads its config).
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from ratrain.config.data import DataConfig
from ratrain.config.elastic import ElasticConfig
from ratrain.config.offload import OffloadConfig, check_offload
from ratrain.config.sections import CheckpointConfig, CommConfig, InitConfig
from ratrain.config.platform import PlatformConfig
from ratrain.config.sections import ModelConfig, OptimConfig, ParallelConfig
from ratrain.config.run import RunConfig, head_once_refused
from ratrain.config.sections import PRECISIONS, ScheduleConfig, SyncConfig, _choice
from ratrain.config.sections import act_itemsize, global_batch, is_half
from ratrain.config.switches import SWITCHES, env_overrides
from ratrain.config.typedyaml import ConfigError, StrictLoader, build, deepcopy, to_plain


@dataclass(frozen=True)
class Config:
    """A run's configuration: sections of keys, and precision.

    precision: fp32 | fp16 | bf16 (fp16: fp16 views and activations, and GEMMs on a GPU, fp32
        masters and accumulation, dynamic loss scaling; bf16: the same in bfloat16 without loss
        scaling, as PyTorch's autocast runs it)
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
    comm: CommConfig = field(default_factory=CommConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "check"):
                sub.check()
        _choice(self, "", "precision", PRECISIONS)
        if self.sync.partial and self.schedule.shard_optimizer is None:
            # partial synchronization's replicas differ between averages, so no replica can own
            # a segment of the optimizer state for all: unset, it is whole on every replica
            object.__setattr__(self, "schedule", replace(self.schedule, shard_optimizer=False))
        check_offload(self)
        if self.run.head == "once" and (self.run.device == "cpu" or not is_half(self.precision)):
            raise ConfigError(head_once_refused(self.run.device, self.precision))
        m, p = self.model, self.parallel
        if p.pp > m.layers:
            raise ConfigError(
                f"parallel.pp={p.pp} is more pipeline stages than model.layers={m.layers}: "
                "every stage needs at least one layer; lower parallel.pp"
            )
        if isinstance(p.layers_per_stage, tuple) and sum(p.layers_per_stage) != m.layers:
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


JOBS = Path(__file__).resolve().parents[1] / "jobs"  # the example jobs shipped in the package


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


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = (), *,
                allow_empty: bool = True) -> Config:
    """Read `path` (YAML, or the name of a shipped job), apply `section.key=value` overrides,
    validate; raise ConfigError. The switches' variables (`switches`: RATRAIN_FUSED, ...) override
    the file and the overrides override both. `allow_empty=False` (the commands) refuses a file with no keys
    (an empty job would train a default model without a word)."""
    path = job_path(path) if path is not None else None
    source = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        text = _read_text(source)
        try:
            data = yaml.load(text, Loader=StrictLoader)
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(source, e)) from None
        except ConfigError as e:
            raise ConfigError(f"{source}:{e}") from None
        if data is None and not allow_empty:
            raise ConfigError(f"config file {source!r} is empty: give at least the model section "
                              "(see jobs/tiny.yaml), or --config tiny")
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
    data = deepcopy(data)
    for ov in env_overrides():  # the switches' variables override the file, --set both
        _apply_override(data, ov)
    for ov in overrides:
        _apply_override(data, ov)
    return config_from_dict(data, source)


def _read_text(source: str) -> str:
    """The config file's text, or ConfigError saying why it cannot be read."""
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        jobs = ", ".join(shipped_jobs())
        raise ConfigError(f"config file {source!r} does not exist (shipped jobs: {jobs})") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {source!r} is a directory: give a YAML file (e.g. "
                          f"{os.path.join(source, 'job.yaml')}) or a shipped job") from None
    except UnicodeDecodeError as e:
        with open(source, "rb") as f:
            line = f.read()[: e.start].count(b"\n") + 1
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.object[e.start]:#04x} on line "
                          f"{line}): save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {source!r} cannot be read ({e.strerror}): check its "
                          "permissions, or give another file") from None


YAML_FIXES = {  # words of PyYAML's problem -> what to do
    "'\\t'": "indent with spaces, not tabs",
    "mapping values are not allowed": "a value holding ': ' must be quoted, and a key must "
                                      "start its own line",
    "expected ',' or '}'": "close the {...} mapping, or put a comma between its entries",
    "expected ',' or ']'": "close the [...] list, or put a comma between its entries",
    "could not find expected ':'": "write each entry as `key: value`",
    "found duplicate anchor": "rename the anchor",
    "found unexpected end of stream": "close the quote or bracket opened before",
}


def _yaml_error(source: str, e: yaml.YAMLError) -> str:
    """One line: where the YAML is broken (line and column from 1), what, and the fix."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
    fix = next((f for k, f in YAML_FIXES.items() if k.strip("'") in problem
                or k in problem), "check the indentation (spaces), the colons and the brackets there")
    return f"{source}: not valid YAML at {where}: {problem}: {fix}"


def with_overrides(cfg: Config, overrides, source: str = "<config>") -> Config:
    """`cfg` with `section.key=value` overrides applied as `--set` applies them; validated."""
    data = cfg.to_dict()
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


__all__ = [
    "PRECISIONS", "CheckpointConfig", "CommConfig", "Config", "ConfigError", "DataConfig",
    "InitConfig", "act_itemsize", "is_half",
    "ElasticConfig", "ModelConfig", "OffloadConfig", "OptimConfig", "ParallelConfig", "PlatformConfig", "RunConfig",
    "SWITCHES", "ScheduleConfig", "StrictLoader", "SyncConfig", "env_overrides", "config_from_dict", "global_batch", "job_path", "load_config",
    "replace",
    "shipped_jobs", "with_overrides",
]
