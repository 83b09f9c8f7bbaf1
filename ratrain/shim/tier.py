"""The memory tier below the DDR: what it holds and how fast it moves, accounted and throttled.

A profile may state tiers (`tiers:` in its YAML: a node's host memory, its local NVMe, ...),
each with its capacity, bandwidth and latency and a source for every figure. A tier belongs to a
node, like its network interface: its capacity and its bandwidth are the node's, shared by the
node's ranks. The config picks one (`platform.tier`) and may override its figures
(`platform.tier_bytes`, `tier_bandwidth`, `tier_latency`); `Profile.tier` is the one picked.

    spec = profile.tier                        # TierSpec or None (no tier stated)
    spec.bandwidth, spec.source("bandwidth")   # 4.1e9, 'assumed: one PCIe 4.0 NVMe ...'
    ledger = TierLedger(spec.rank_share(4), rank, path="/nvme/run/tier", key="offload.path")
    link = tier_link(spec, time_scale, shared)  # the throttle, None when not modelled

The shim accounts a rank's bytes in the tier against its share of the node's capacity
(`TierLedger`: a `Ledger` whose refusal is `TierFull`, naming the path and the key) and throttles
its transfers like a link (`tier_link`: a `shim.link.Link` whose slots the node's ranks share,
so that an emulated run feels the tier's bandwidth as it feels the interface's). `None` figures
are not modelled: no cap, no throttle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ratrain.shim.ledger import Ledger, _fmt
from ratrain.shim.link import Link

TIER_FIGURES = ("bytes", "bandwidth", "latency")  # per node: capacity, B/s, s per transfer


class TierFull(OSError):
    """The tier has no room for a transfer (its cap, or the storage under it)."""


@dataclass(frozen=True)
class TierSpec:
    """One tier of a node: `bytes` of capacity and `bandwidth` B/s shared by the node's ranks,
    `latency` s per transfer; None: not modelled. `sources[figure]` says where each comes from."""

    name: str
    bytes: float | None = None
    bandwidth: float | None = None
    latency: float | None = None
    sources: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def source(self, figure: str) -> str:
        return self.sources.get(figure, "")

    def with_figure(self, figure: str, value: float, source: str) -> TierSpec:
        if figure not in TIER_FIGURES:
            raise ValueError(f"a tier has no figure {figure!r}; figures are {TIER_FIGURES}")
        return replace(self, **{figure: value}, sources={**self.sources, figure: source})

    def rank_share(self, ranks_per_node: int | None) -> int | None:
        """Bytes of the node's capacity one of its `ranks_per_node` ranks may hold (an even
        split; None: not capped)."""
        if self.bytes is None:
            return None
        return int(self.bytes // max(1, int(ranks_per_node or 1)))

    def describe(self) -> list[str]:
        """One line per figure: `tier NAME: figure = value  (source)`."""
        head = f"tier {self.name}" + (f": {self.description}" if self.description else "")
        return [head] + [f"  {k} = {getattr(self, k)}  ({self.source(k)})" for k in TIER_FIGURES]


def parse_tiers(data, where: str) -> dict[str, TierSpec]:
    """A profile's `tiers:` mapping: name -> {description, bytes, bandwidth, latency}, each
    figure `{value, source}` (value may be null: not modelled)."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: tiers must be a mapping of tier names")
    out = {}
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: tiers.{name} must be a mapping")
        unknown = set(entry) - {*TIER_FIGURES, "description"}
        if unknown:
            raise ValueError(f"{where}: tiers.{name} has unknown keys {sorted(unknown)}; "
                             f"known: description, {', '.join(TIER_FIGURES)}")
        values, sources = {}, {}
        for k in TIER_FIGURES:
            fig = entry.get(k)
            if not isinstance(fig, dict) or "value" not in fig or not fig.get("source"):
                raise ValueError(f"{where}: tiers.{name}.{k} needs `value` (may be null) and "
                                 "`source`")
            v = fig["value"]
            if v is not None:
                try:
                    v = float(v)
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: tiers.{name}.{k}: {v!r} is not a number") from None
                if v < 0 or not math.isfinite(v):
                    raise ValueError(f"{where}: tiers.{name}.{k}={v} must be a finite number >= 0")
            values[k], sources[k] = v, str(fig["source"])
        out[str(name)] = TierSpec(str(name), sources=sources,
                                  description=str(entry.get("description", "")), **values)
    return out


class TierLedger(Ledger):
    """A rank's bytes in the tier against its share of the node's capacity (`cap`); going over
    raises `TierFull` naming the rank, the tag, the tier's `path` and the config `key`."""

    def __init__(self, cap: int | None, rank: int = 0, path: str = "", key: str = "offload.path",
                 name: str = "tier"):
        super().__init__(cap, rank)
        self.path, self.key, self.name = path, key, name

    def reserve(self, tag: str, nbytes: int) -> None:
        with self._lock:
            over = self.cap is not None and self.current + int(nbytes) > self.cap
        if over:
            raise TierFull(
                f"rank {self.rank}: tier {self.name} full: {tag!r} needs {_fmt(nbytes)} with "
                f"{_fmt(self.current)} held of its {_fmt(self.cap)} share "
                f"(platform.tier_bytes) at {self.path or '?'} ({self.key}): offload fewer "
                "layers, raise platform.tier_bytes, or move it to a larger tier")
        super().reserve(tag, nbytes)


def tier_link(spec: TierSpec | None, time_scale: float = 1.0, shared=None) -> Link | None:
    """The throttle of `spec` (its slots `shared` by the node's ranks: their tier), or None when
    its bandwidth is not modelled. Transfers are one message each (`Link.reserve` per chunk)."""
    if spec is None or not spec.bandwidth:
        return None
    return Link(spec.bandwidth, spec.latency or 0.0, time_scale, shared=shared)


__all__ = ["TIER_FIGURES", "TierFull", "TierLedger", "TierSpec", "parse_tiers", "tier_link"]
