"""Each replica's own state in a checkpoint of a partial-synchronization run.

Under `sync.mode: partial` (dp > 1) the data-parallel replicas hold different parameters and
AdamW moments between averages, so one shard per stage cannot hold the run's state. Such a
checkpoint holds, beside the model shards of the manifest's `files` (which then hold the
replicas' mean: the model `eval`, `generate`, `export` and a run under full sync load),
every replica's own state:

    shard-s000-r002.h5     replica 2 of stage 0: its own master, m and v (that rank writes it)

listed in the manifest's `replicas` (entries as `files`' with the `replica`), each hashed,
checked and verified like a shard. A run of the same dp under partial sync resumes each replica
from its own files (`resume_replica`), bitwise; any other run from the mean.
"""

from __future__ import annotations

import re

from ratrain.config import Config

REPLICA_RE = re.compile(r"^shard-s\d{3,}-r\d{3,}\.h5$")


def replica_shard_name(stage: int, replica: int) -> str:
    return f"shard-s{stage:03d}-r{replica:03d}.h5"


def holds_replicas(cfg: Config) -> bool:
    """Whether a checkpoint of `cfg` holds each replica's state (partial sync, dp > 1)."""
    return cfg.sync.partial and cfg.parallel.dp > 1


def replica_entries(manifest: dict, replica: int | None = None) -> list[dict]:
    """The manifest's replica entries (those of `replica`, when given)."""
    return [e for e in manifest.get("replicas", [])
            if replica is None or e.get("replica") == replica]


def replica_problems(manifest: dict, cfg: Config | None) -> list[str]:
    """What is wrong with a manifest's replica entries: present exactly when the saved config
    holds replicas, one per (stage, replica) of the grid, each named by them and covering its
    stage's parameters as the model shard of that stage does."""
    entries = manifest.get("replicas", [])
    topo = manifest["topology"]
    want = cfg is not None and holds_replicas(cfg)
    if not entries:
        return ([f"its config is partial sync at dp={topo['dp']} but it holds no replica's "
                 "state"] if want else [])
    if not want:
        return ["it lists replicas' states, but its config is not partial sync at dp > 1"]
    out, seen = [], set()
    stage_params = {e["stage"]: e["params"] for e in manifest["files"]}
    for e in entries:  # typed already (`audit.schema_problem`)
        place = (e["stage"], e["replica"])
        if e["file"] != replica_shard_name(*place):
            out.append(f"{e['file']} is listed for stage {place[0]} replica {place[1]}, whose "
                       f"shard is {replica_shard_name(*place)}")
        elif place in seen:
            out.append(f"{e['file']} is listed twice")
        elif e["params"] != stage_params.get(e["stage"]):
            out.append(f"{e['file']} holds other parameters than its stage's shard")
        seen.add(place)
    grid = {(s, r) for s in range(topo["pp"]) for r in range(topo["dp"])}
    if seen != grid and not out:
        out.append(f"its replica list holds {len(seen)} of the {len(grid)} (stage, replica) "
                   "states")
    return out


def resume_replica(manifest: dict, cfg: Config, replica: int) -> int | None:
    """Which replica's own state a run of `cfg` resumes from on data-parallel replica
    `replica`: its own, when the checkpoint holds replicas and the run is partial sync at the
    saved dp; None (the model shards, the replicas' mean) otherwise."""
    if replica_entries(manifest) and holds_replicas(cfg) and \
            cfg.parallel.dp == manifest["topology"]["dp"]:
        return replica
    return None


__all__ = ["REPLICA_RE", "holds_replicas", "replica_entries", "replica_problems",
           "replica_shard_name", "resume_replica"]
