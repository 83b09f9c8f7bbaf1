"""Platform profiles: what one rank's cluster has (DDR, links, compute), each value with its source.

Links come in two levels: `link_bandwidth` / `link_latency` are the network between nodes (the
bandwidth of one node's interface, which the node's ranks share; the latency of a message
across nodes), `intra_bandwidth` / `intra_latency` the path between two ranks of one node (each
rank its own), and `ranks_per_node` how many ranks (clusters) a node holds.

Profiles are YAML files shipped in `ratrain/shim/profiles/` (`mt3000`, `host`); a path to another
YAML file of the same shape works too. The config's `platform` section selects one and
overrides single values:

    prof = resolve_platform(cfg.platform)      # mt3000 + platform.link_bandwidth=2e9 ...
    prof.ddr_bytes, prof.source("ddr_bytes")   # 21474836480, 'RATrain paper: ...'

`time_scale` and `emulate` always come from the config (a profile describes hardware, not a run).
A profile may also state the memory tiers below the DDR (`tiers:`, `shim.tier`); the config picks
one (`platform.tier`, with `tier_bytes`, `tier_bandwidth`, `tier_latency` overriding its figures)
and `Profile.tier` holds it.
"""

from __future__ import annotations

import fnmatch
import os
import re
import socket
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import yaml

from ratrain.shim.tier import TIER_FIGURES, TierSpec, parse_tiers

VALUE_KEYS = ("ddr_bytes", "compute_flops", "link_bandwidth", "link_latency", "intra_bandwidth",
              "intra_latency", "ranks_per_node")
# values a profile may leave out (older profiles, test profiles): not modelled
OPTIONAL_KEYS = ("intra_bandwidth", "intra_latency", "ranks_per_node")
RUN_KEYS = ("time_scale", "emulate")
FACT_KEYS = ("ddr_bandwidth",)  # facts the config may override (platform.ddr_bandwidth)


class ProfileError(ValueError):
    """A missing or malformed platform profile."""


@dataclass(frozen=True)
class Sourced:
    """One profile value and where it comes from (a paper, a datasheet, an assumption, the config)."""

    value: Any
    source: str


@dataclass(frozen=True)
class Profile:
    """The platform one rank plays. `None` values are not modelled (no cap, no throttle, no pacing)."""

    name: str
    values: dict[str, Sourced]
    facts: dict[str, Sourced] = field(default_factory=dict)
    description: str = ""
    tiers: dict[str, TierSpec] = field(default_factory=dict)  # the tiers the profile states
    tier: TierSpec | None = None  # the one the config picks (`platform.tier`), or None

    def __getattr__(self, key: str):
        values = self.__dict__.get("values", {})
        if key in values:
            return values[key].value
        raise AttributeError(f"profile has no value {key!r}; values are {', '.join(values)}")

    def source(self, key: str) -> str:
        return self.values[key].source

    def fact(self, key: str) -> Sourced | None:
        """A descriptive fact of the profile (`ddr_bandwidth`, `clusters_per_chip`, ...), or
        None when the profile does not state it."""
        return self.facts.get(key)

    def with_values(self, **kv: tuple[Any, str]) -> Profile:
        """A copy with `key=(value, source)` replaced."""
        values = dict(self.values)
        for k, (v, src) in kv.items():
            if k not in values:
                raise ProfileError(f"unknown platform value {k!r}; known: {', '.join(values)}")
            values[k] = Sourced(v, src)
        return replace(self, values=values)

    def describe(self) -> str:
        """One line per value: `name = value  (source)`, for logs and the README."""
        lines = [f"platform {self.name}: {self.description}".rstrip(": ")]
        for k, v in {**self.values, **self.facts}.items():
            lines.append(f"  {k} = {v.value}  ({v.source})")
        if self.tier is not None:
            lines += ["  " + line for line in self.tier.describe()]
        return "\n".join(lines)


def available_profiles() -> list[str]:
    root = resources.files("ratrain.shim").joinpath("profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(name: str) -> Profile:
    """A shipped profile by name (`mt3000`, `host`) or a YAML file by path."""
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        try:
            with open(name) as f:
                text, where = f.read(), name
        except FileNotFoundError:
            raise ProfileError(f"platform profile file {name!r} does not exist") from None
    else:
        res = resources.files("ratrain.shim").joinpath("profiles", f"{name}.yaml")
        if not res.is_file():
            raise ProfileError(
                f"unknown platform profile {name!r}; shipped profiles are "
                f"{', '.join(available_profiles())}, or give a path to a YAML file"
            )
        text, where = res.read_text(), str(res)
    return _parse(yaml.safe_load(text), where)


def resolve_platform(platform_cfg) -> Profile:
    """The profile named by `platform_cfg.profile`, with the config's overrides applied.

    `platform_cfg` is a `ratrain.config.PlatformConfig` (or anything with the same attributes).
    """
    prof = load_profile(platform_cfg.profile)
    over = {
        k: (getattr(platform_cfg, k), f"config: platform.{k}")
        for k in VALUE_KEYS
        if getattr(platform_cfg, k, None) is not None
    }
    for k in RUN_KEYS:
        over[k] = (getattr(platform_cfg, k), f"config: platform.{k}")
    prof = prof.with_values(**over)
    for k in FACT_KEYS:  # facts the config may override
        if getattr(platform_cfg, k, None) is not None:
            prof = replace(prof, facts={**prof.facts, k: Sourced(getattr(platform_cfg, k),
                                                                 f"config: platform.{k}")})
    return replace(prof, tier=pick_tier(prof, platform_cfg))


def pick_tier(prof: Profile, platform_cfg) -> TierSpec | None:
    """The tier `platform.tier` names among the profile's (with `platform.tier_*` figures
    overriding its own); a tier of the config's figures alone when it names none but sets one;
    None when neither."""
    name = getattr(platform_cfg, "tier", "") or ""
    over = {k: getattr(platform_cfg, f"tier_{k}", None) for k in TIER_FIGURES}
    if name:
        if name not in prof.tiers:
            raise ProfileError(f"platform.tier={name!r} is not a tier of profile {prof.name!r}; "
                               f"its tiers are {', '.join(prof.tiers) or 'none'}: name one, or "
                               "leave platform.tier empty and set platform.tier_bytes / "
                               "tier_bandwidth / tier_latency")
        spec = prof.tiers[name]
    elif any(v is not None for v in over.values()):
        spec = TierSpec("config", sources={k: "config: not stated (not modelled)"
                                           for k in TIER_FIGURES})
    else:
        return None
    for k, v in over.items():
        if v is not None:
            spec = spec.with_figure(k, float(v), f"config: platform.tier_{k}")
    return spec


# -- rank classes (`platform.classes`): a heterogeneous cluster ---------------------------------

CLASS_KEYS = ("compute_flops", "ddr_bytes", "link_bandwidth", "link_latency", "intra_bandwidth",
              "intra_latency")  # profile values a class may set; `ddr_bandwidth` is a fact


def node_name() -> str:
    """This process's node as the class patterns see it: Slurm's node name, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


_HOSTLIST = re.compile(r"\[(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)\]")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's node list notation as names: `node[01-03,07]` -> node01, node02, node03, node07
    (ranges keep their zero padding; several bracket groups multiply)."""
    m = _HOSTLIST.search(text)
    if m is None:
        return [text]
    names = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            names.append(f"{i:0{len(lo)}d}")
    head, tail = text[:m.start()], text[m.end():]
    return [head + n + rest for n in names for rest in expand_hostlist(tail)]


def host_matches(host: str, pattern: str) -> bool:
    """Whether node `host` is one of `pattern`: a Slurm node list (`node[01-04]`, as `scontrol
    show hostnames` expands it) or else a shell pattern (`gpu*`, `*-n2`)."""
    if _HOSTLIST.search(pattern) and not any(c in pattern for c in "*?"):
        return host in expand_hostlist(pattern)
    return fnmatch.fnmatchcase(host, pattern)


def class_of(platform_cfg, rank: int, host: str | None = None):
    """The class (`platform.classes` entry) of world rank `rank` on node `host`: the class that
    lists the rank, else the one whose `hosts` pattern matches the node; None when the config
    has no classes. A rank in no class, or a node two classes match, is a ProfileError."""
    classes = tuple(getattr(platform_cfg, "classes", ()) or ())
    if not classes:
        return None
    for c in classes:
        if rank in c.ranks:
            return c
    host = node_name() if host is None else host
    hits = [c for c in classes if any(host_matches(host, pat) for pat in c.hosts)]
    if len(hits) > 1:
        raise ProfileError(f"platform.classes: node {host!r} of rank {rank} matches the hosts "
                           f"of {hits[0].name} and {hits[1].name}: make the patterns disjoint")
    if not hits:
        raise ProfileError(
            f"platform.classes: rank {rank} (node {host!r}) is in no class: add it to a "
            f"class's ranks or a hosts pattern ({', '.join(c.name for c in classes)})")
    return hits[0]


def class_map(platform_cfg, hosts) -> tuple[str, ...] | None:
    """The class name of every world rank, `hosts[r]` being rank r's node (None: no classes)."""
    if not getattr(platform_cfg, "classes", ()):
        return None
    world = len(hosts)
    for c in platform_cfg.classes:
        over = [r for r in c.ranks if r >= world]
        if over:
            raise ProfileError(f"platform.classes: class {c.name} lists rank {over[0]} but the "
                               f"world has {world} ranks (0-{world - 1}): remove it")
    return tuple(class_of(platform_cfg, r, h).name for r, h in enumerate(hosts))


def class_profile(platform_cfg, name: str | None) -> Profile:
    """The profile of a rank of class `name` (None: the config's profile)."""
    prof = resolve_platform(platform_cfg)
    if name is None:
        return prof
    c = next((c for c in platform_cfg.classes if c.name == name), None)
    if c is None:
        raise ProfileError(f"platform.classes has no class {name!r}; classes are "
                           f"{', '.join(x.name for x in platform_cfg.classes)}")
    where = f"config: platform.classes.{name}"
    prof = prof.with_values(**{k: (getattr(c, k), f"{where}.{k}") for k in CLASS_KEYS
                               if getattr(c, k) is not None})
    if c.ddr_bandwidth is not None:
        prof = replace(prof, facts={**prof.facts,
                                    "ddr_bandwidth": Sourced(c.ddr_bandwidth, f"{where}.ddr_bandwidth")})
    return replace(prof, name=f"{prof.name}/{name}")


def rank_profile(platform_cfg, rank: int, host: str | None = None) -> Profile:
    """The profile world rank `rank` plays: its class's, or the config's without classes."""
    c = class_of(platform_cfg, rank, host)
    return class_profile(platform_cfg, c.name if c is not None else None)


def _number(v, where: str):
    """YAML 1.1 reads `4.5e12` as a string: accept it as the number it means."""
    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {v!r} is not a number (or null)") from None


def _parse(data: Any, where: str) -> Profile:
    if not isinstance(data, dict) or "values" not in data:
        raise ProfileError(f"{where}: a profile is a mapping with `name` and `values`")
    values: dict[str, Sourced] = {}
    for k in VALUE_KEYS:
        entry = data["values"].get(k)
        if entry is None and k in OPTIONAL_KEYS:
            values[k] = Sourced(None, f"{where}: not stated (not modelled)")
            continue
        if not isinstance(entry, dict) or "value" not in entry or not entry.get("source"):
            raise ProfileError(f"{where}: values.{k} needs `value` (may be null) and `source`")
        values[k] = Sourced(_number(entry["value"], f"{where}: values.{k}"), str(entry["source"]))
    unknown = set(data["values"]) - set(VALUE_KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown values {sorted(unknown)}; known: {VALUE_KEYS}")
    rpn = values["ranks_per_node"].value
    if rpn is not None and (rpn != int(rpn) or rpn < 1):
        raise ProfileError(f"{where}: values.ranks_per_node={rpn!r} must be a positive integer")
    if rpn is not None:
        values["ranks_per_node"] = Sourced(int(rpn), values["ranks_per_node"].source)
    values["time_scale"] = Sourced(1.0, "default: platform time")
    values["emulate"] = Sourced(False, "default: run at host speed")
    facts = {
        k: Sourced(v["value"], str(v.get("source", "")))
        for k, v in (data.get("facts") or {}).items()
    }
    try:
        tiers = parse_tiers(data.get("tiers"), where)
    except ValueError as e:
        raise ProfileError(str(e)) from None
    return Profile(str(data.get("name", where)), values, facts, str(data.get("description", "")),
                   tiers)


__all__ = [
    "CLASS_KEYS",
    "OPTIONAL_KEYS",
    "Profile",
    "ProfileError",
    "Sourced",
    "available_profiles",
    "class_map",
    "class_of",
    "class_profile",
    "expand_hostlist",
    "host_matches",
    "load_profile",
    "node_name",
    "pick_tier",
    "rank_profile",
    "resolve_platform",
]
