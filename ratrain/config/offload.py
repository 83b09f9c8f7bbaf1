"""The offload section: what leaves the DDR for the tier below it (`platform.tier`), and where its
files go; typed, documented and checked as the other sections are (`sections`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ratrain.config.sections import _choice
from ratrain.config.typedyaml import ConfigError


@dataclass(frozen=True)
class OffloadConfig:
    """What leaves the DDR for the memory tier below it (platform.tier), and where its files go.
    Offloading changes when bytes move, never what is computed: a run with and without it is
    bitwise the same.

    activations: off | all | auto | prefer: whether a layer's saved activations are written to
        the tier after its forward and fetched back before its backward (double-buffered).
        All: every layer (schedule.recompute must be none). With schedule.recompute=auto, the
        layers that must leave the DDR to fit its cap are offloaded as far as the tier hides
        their transfers behind compute and the rest recomputed (auto), or all offloaded while
        the tier has room (prefer). Off: recomputation alone
    optimizer: off | moments | masters: AdamW's moments (masters: and the fp32 masters, which
        needs separate working views: fp16, or a sharded optimizer state) live in the tier,
        fetched before each block's update and written back after it
    path: directory of the tier's files (memory-mapped, one per rank and kind, removed at the
        end); "" = <run.dir>/tier
    """
    activations: str | bool = "off"  # YAML reads a bare off as false: the word it was
    optimizer: str | bool = "off"
    path: str = ""

    def __post_init__(self) -> None:
        for key in ("activations", "optimizer"):
            if getattr(self, key) is False:
                object.__setattr__(self, key, "off")

    ACTIVATIONS = ("off", "all", "auto", "prefer")
    OPTIMIZER = ("off", "moments", "masters")

    @property
    def enabled(self) -> bool:
        """Whether anything may go to the tier."""
        return self.activations != "off" or self.optimizer != "off"

    def check(self) -> None:
        _choice(self, "offload", "activations", self.ACTIVATIONS)
        _choice(self, "offload", "optimizer", self.OPTIMIZER)


def check_offload(cfg) -> None:
    """The offload section against the schedule's recomputation (cross-section rules)."""
    act, rec = cfg.offload.activations, cfg.schedule.recompute
    if act in ("auto", "prefer") and rec != "auto":
        raise ConfigError(f"offload.activations={act} chooses, per layer, between offload and "
                          f"recomputation, which schedule.recompute=auto does (it is {rec!r}): "
                          "set schedule.recompute=auto, or offload.activations=all | off")
    if act == "all" and rec != "none":
        raise ConfigError(f"offload.activations=all offloads every layer, which then recomputes "
                          f"nothing, but schedule.recompute={rec!r}: set schedule.recompute=none, "
                          "or offload.activations=auto with schedule.recompute=auto")


def tier_dir(cfg) -> str:
    """Where the tier's files go: `offload.path`, else `<run.dir>/tier`."""
    return cfg.offload.path or os.path.join(cfg.run.dir, "tier")


__all__ = ["OffloadConfig", "check_offload", "tier_dir"]
