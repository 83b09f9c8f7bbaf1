"""The platform section: the profile each rank plays, and the rank classes of a mixed cluster
(`platform.classes`), typed, documented and checked as the other sections are (`sections`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ratrain.config.sections import _positive
from ratrain.config.typedyaml import ConfigError

CLASS_VALUES = ("compute_flops", "ddr_bytes", "ddr_bandwidth", "link_bandwidth", "link_latency",
                "intra_bandwidth", "intra_latency")


def rank_ranges(text: str, name: str = "") -> tuple[int, ...]:
    """"0-3,8" -> (0, 1, 2, 3, 8): a class's ranks written as ranges."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if not (lo.strip().isdigit() and (not dash or hi.strip().isdigit())):
            raise ConfigError(f"platform.classes ({name or 'a class'}): ranks={text!r} is not a "
                              "list of ranks or of ranges: write e.g. [0, 1] or \"0-511\"")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ConfigError(f"platform.classes ({name or 'a class'}): ranks={text!r}: the "
                              f"range {part} runs backwards: write {last}-{first}")
        out += range(first, last + 1)
    return tuple(out)


@dataclass(frozen=True)
class RankClass:
    """One class of ranks of a heterogeneous cluster: which ranks belong to it and the platform
    values in which they differ from the profile (null keeps the profile's).

    name: the class's name (unique), e.g. fast
    ranks: world ranks of this class, e.g. [0, 1, 2, 3], or ranges as a string, e.g. "0-511"
        or "0-3,8"
    hosts: the nodes of this class, matched on the Slurm node name (else the host name): Slurm
        node lists or shell patterns, e.g. ["cn[001-016]", "gpu*", "*-n2"]; ranks takes
        precedence
    compute_flops: compute rate per rank in flop/s
    ddr_bytes: DDR cap per rank in bytes
    ddr_bandwidth: DDR bandwidth in bytes/s per rank
    link_bandwidth: bandwidth in bytes/s of the node's network interface
    link_latency: latency in s of a message between nodes
    intra_bandwidth: bandwidth in bytes/s between two ranks of one node
    intra_latency: latency in s of a message inside a node
    calibrate: measure compute_flops at start-up instead (each rank's sgemm rate, the class
        taking the slowest of its ranks, agreed on every rank)
    """
    name: str = ""
    ranks: tuple[int, ...] | str = ()
    hosts: tuple[str, ...] = ()
    compute_flops: float | None = None
    ddr_bytes: int | None = None
    ddr_bandwidth: float | None = None
    link_bandwidth: float | None = None
    link_latency: float | None = None
    intra_bandwidth: float | None = None
    intra_latency: float | None = None
    calibrate: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ranks, str):  # "0-511" or "0-3,8": the ranks it spans
            object.__setattr__(self, "ranks", rank_ranges(self.ranks, self.name))

    def check(self, i: int) -> None:
        where = f"platform.classes[{i}]"
        if not self.name:
            raise ConfigError(f"{where}.name is empty: give every class a name")
        if not self.ranks and not self.hosts:
            raise ConfigError(f"{where} ({self.name}) has neither ranks nor hosts: say which "
                              "ranks belong to it")
        if any(r < 0 for r in self.ranks):
            raise ConfigError(f"{where}.ranks={list(self.ranks)}: ranks are >= 0")
        for key in CLASS_VALUES:
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ConfigError(f"{where}.{key}={v} must be >= 0")


@dataclass(frozen=True)
class PlatformConfig:
    """The platform each rank plays (ratrain/shim/profiles); null values keep the profile's.

    profile: host (this machine, no cap, no pacing) | mt3000 | a profile YAML path
    ddr_bytes: DDR cap per rank in bytes (the ledger refuses to go over it)
    link_bandwidth: bandwidth in bytes/s of a node's network interface, shared by its ranks
    link_latency: latency in s of a message between nodes
    compute_flops: compute rate per rank in flop/s (pacing, and the peak MFU is taken against)
    time_scale: emulated time = platform time x time_scale
    emulate: throttle links and pace compute to the profile (and cut one host's ranks into nodes
        of ranks_per_node)
    intra_bandwidth: bandwidth in bytes/s between two ranks of one node (each rank its own link)
    intra_latency: latency in s of a message inside a node
    ranks_per_node: ranks (clusters) a node holds, sharing its interface
    ddr_bandwidth: DDR bandwidth in bytes/s per rank, which paces and prices the memory-bound
        AdamW update and view casts (the profile's `ddr_bandwidth` fact)
    classes: rank classes of a heterogeneous cluster (see platform.classes[] below): each
        names its ranks or hosts and the values in which they differ; every rank must belong
        to exactly one class; empty = every rank is the profile
    tier: the memory tier below the DDR that offloaded state goes to (offload.*): a tier the
        profile states (mt3000: host, nvme); "" = none stated (offload then runs unthrottled
        and uncapped, unless tier_bytes / tier_bandwidth / tier_latency state one)
    tier_bytes: the tier's capacity in bytes per node, shared evenly by its ranks
    tier_bandwidth: the tier's bandwidth in bytes/s per node, shared by its ranks (throttled
        under emulate, as the interface is)
    tier_latency: the tier's latency in s per transfer
    """
    profile: str = "host"
    # Each of these overrides the profile's value when set (None keeps the profile's).
    ddr_bytes: int | None = None
    link_bandwidth: float | None = None  # bytes/s
    link_latency: float | None = None  # s
    compute_flops: float | None = None  # flop/s per rank
    time_scale: float = 1.0  # emulated time = platform time x time_scale
    emulate: bool = False  # throttle links and pace compute to the profile
    intra_bandwidth: float | None = None  # bytes/s between two ranks of one node
    intra_latency: float | None = None  # s
    ranks_per_node: int | None = None  # ranks sharing a node and its network interface
    ddr_bandwidth: float | None = None  # bytes/s; overrides the profile's fact
    classes: tuple[RankClass, ...] = ()
    tier: str = ""  # a tier of the profile (mt3000: host | nvme); "" = none
    tier_bytes: int | None = None  # bytes per node; overrides the tier's
    tier_bandwidth: float | None = None  # bytes/s per node; overrides the tier's
    tier_latency: float | None = None  # s per transfer; overrides the tier's

    def check(self) -> None:
        names = [c.name for c in self.classes]
        for i, c in enumerate(self.classes):
            c.check(i)
            if names.index(c.name) != i:
                raise ConfigError(f"platform.classes: the name {c.name!r} is given twice: "
                                  "class names are unique")
        for i, c in enumerate(self.classes):
            for r in c.ranks:
                j = next((j for j, d in enumerate(self.classes) if r in d.ranks), i)
                if j != i:
                    raise ConfigError(f"platform.classes: rank {r} is in both {self.classes[j].name} "
                                      f"and {c.name}: give each rank one class")
        for key in ("ddr_bytes", "link_bandwidth", "link_latency", "compute_flops",
                    "intra_bandwidth", "intra_latency", "ddr_bandwidth", "tier_bytes",
                    "tier_bandwidth", "tier_latency"):
            v = getattr(self, key)
            if v is not None and v < 0:
                raise ConfigError(f"platform.{key}={v} must be >= 0")
        _positive(self, "platform", "time_scale")
        if self.ranks_per_node is not None:
            _positive(self, "platform", "ranks_per_node")


__all__ = ["CLASS_VALUES", "PlatformConfig", "RankClass", "rank_ranges"]
