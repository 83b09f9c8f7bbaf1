"""Switches: the config keys that an environment variable may override, in one table.

A switch is an ordinary config key (typed, defaulted, documented in its section, written into the
run's `config.yaml`); what makes it a switch is that a `RATRAIN_*` variable, when set, overrides
the job file (a `--set` still overrides both). `load_config` applies them, once, before any work;
nothing in a step reads the environment. README's "Switches" table is generated from `SWITCHES`
(`table()`; a test keeps it current).

    cfg = load_config("jobs/tiny.yaml")        # RATRAIN_FUSED=0 in the environment: run.fused=off
    env_overrides({"RATRAIN_FUSED": "0"})      # ["run.fused=off"]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ratrain.config.typedyaml import ConfigError


@dataclass(frozen=True)
class Switch:
    """One overridable key: `key` (section.key), its variable `env`, the variable's values and the
    config value each stands for (`values`), and whether it is for debugging only."""

    key: str
    env: str
    values: Mapping[str, str]
    debug: bool = False

    def parse(self, raw: str) -> str:
        """The config value (YAML text) `raw` stands for; ConfigError naming the variable."""
        v = self.values.get(raw.strip().lower())
        if v is None:
            raise ConfigError(f"{self.env}={raw!r} is not one of "
                              f"{', '.join(sorted(self.values))}: it overrides {self.key}; "
                              f"unset it or give one of those")
        return v


_ON_OFF = {"0": "off", "off": "off", "false": "off", "no": "off", "1": "auto", "auto": "auto",
           "on": "on", "true": "on", "yes": "on"}
_BOOL = {"0": "false", "off": "false", "false": "false", "no": "false",
         "1": "true", "on": "true", "true": "true", "yes": "true"}

SWITCHES = (
    Switch("run.fused", "RATRAIN_FUSED", _ON_OFF),
    Switch("run.devkernels", "RATRAIN_DEVKERNELS", {**_ON_OFF, "sim": "sim", "count": "count"}),
    Switch("run.malloc", "RATRAIN_MALLOC", {"tuned": "tuned", "default": "default"}),
    Switch("comm.log_messages", "RATRAIN_LOG_MESSAGES", _BOOL, debug=True),
)


def env_overrides(environ: Mapping[str, str] = os.environ) -> list[str]:
    """`section.key=value` overrides for every switch whose variable is set (and not empty)."""
    return [f"{s.key}={s.parse(environ[s.env])}" for s in SWITCHES if environ.get(s.env, "")]


def table() -> str:
    """README's table of the switches (Markdown): key, variable, values, debug or not."""
    rows = ["| config key | variable | variable's values | |", "|---|---|---|---|"]
    for s in SWITCHES:
        vals = ", ".join(f"`{k}`" for k in s.values)
        rows.append(f"| `{s.key}` | `{s.env}` | {vals} | {'debug only' if s.debug else ''} |")
    return "\n".join(rows)


__all__ = ["SWITCHES", "Switch", "env_overrides", "table"]
