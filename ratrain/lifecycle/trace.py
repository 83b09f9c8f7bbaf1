"""Timelines out: Chrome trace JSON (one row per rank, viewable in Perfetto) and a PNG Gantt.

Each executor records (name, group, t0, t1, tid, args) per action, named as the schedule names
it (`F mb3`, `sync L5`; `lifecycle.schedule`): tid 0 is the main thread (compute and lifecycle
actions, hooks nested inside the compute that ran them), tid 1 the communication engine
(messages and collectives, from post to completion). `write` gathers every
rank's events on rank 0 through the comm engine (collective: every rank calls it) and writes
`trace.json`; with matplotlib installed it also draws the last step as a Gantt chart (`.png`
beside it). Times are `time.perf_counter()`, one clock for all ranks of a host.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ratrain.fileio import atomic_path, atomic_write

TRACE_TAG = 7001
COLORS = {"F": "#4c72b0", "B": "#55a868", "lifecycle": "#dd8452", "comm": "#8172b2",
          "p2p": "#937860"}  # compute actions by their first word (F / B), the rest by group


def chrome_events(per_rank: dict[int, dict]) -> list[dict]:
    """Chrome trace events from {rank: {"events": [...], "stage": s, "replica": r}}."""
    t0 = min((e[2] for r in per_rank.values() for e in r["events"]), default=0.0)
    out = []
    for rank, info in sorted(per_rank.items()):
        out.append({"name": "process_name", "ph": "M", "pid": rank,
                    "args": {"name": f"rank {rank} (stage {info['stage']}, replica {info['replica']})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for tid, name in ((0, "compute"), (1, "comm engine")):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": name}})
        for name, cat, a, b, tid, args in info["events"]:
            out.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
                        "ts": (a - t0) * 1e6, "dur": max(0.0, (b - a) * 1e6), "args": args})
    return out


def gather(executor) -> dict[int, dict] | None:
    """Every rank's events on rank 0 (None elsewhere), through the comm engine."""
    mine = {"events": executor.events, "stage": executor.stage, "replica": executor.replica}
    if executor.world == 1:
        return {0: mine}
    topo, engine = executor.topo, executor.engine
    payload = np.frombuffer(json.dumps(mine).encode(), np.uint8).copy()
    sizes = np.zeros(executor.world, np.int64)
    sizes[executor.rank] = payload.size
    engine.allreduce(sizes, topo.comm).result()
    if executor.rank != 0:
        engine.send(payload, 0, TRACE_TAG, topo.comm, verb="trace").result()
        return None
    out = {0: mine}
    for r in range(1, executor.world):
        buf = np.empty(int(sizes[r]), np.uint8)
        engine.recv(buf, r, TRACE_TAG, topo.comm, verb="trace").result()
        out[r] = json.loads(buf.tobytes().decode())
    return out


def write(executor, path: str, png: str | None = None) -> None:
    per_rank = gather(executor)
    if per_rank is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps({"traceEvents": chrome_events(per_rank),
                                   "displayTimeUnit": "ms"}))
    gantt(per_rank, png or os.path.splitext(path)[0] + ".png")


def gantt(per_rank: dict[int, dict], path: str, step: int | None = None) -> bool:
    """Draw one step (default: the last) as a Gantt chart; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [e[5].get("step", -1) for r in per_rank.values() for e in r["events"]]
    if not steps:
        return False
    step = max(steps) if step is None else step
    evs = {r: [e for e in info["events"] if e[5].get("step") == step]
           for r, info in per_rank.items()}
    t0 = min((e[2] for es in evs.values() for e in es), default=0.0)
    ranks = sorted(evs)
    fig, ax = plt.subplots(figsize=(14, 0.9 * len(ranks) + 2.0))
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        for name, cat, a, b, tid, _ in evs[r]:
            if cat == "compute":
                color, lane, h = COLORS[name.split()[0]], 0.1, 0.5
            elif cat == "comm" or tid == 1:
                color, lane, h = COLORS["comm"], -0.35, 0.3
            elif cat == "p2p":
                continue
            else:
                color, lane, h = COLORS["lifecycle"], 0.1, 0.5
            ax.barh(y + lane, (b - a) * 1e3, left=(a - t0) * 1e3, height=h, color=color,
                    edgecolor="black", linewidth=0.2)
            if cat == "compute" and (b - a) * 1e3 > 0:
                ax.text((a - t0 + (b - a) / 2) * 1e3, y + lane, name.replace(" mb", ""),
                        ha="center", va="center", fontsize=6, color="white")
    info0 = per_rank[ranks[0]]
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} (s{per_rank[r]['stage']} r{per_rank[r]['replica']})"
                        for r in reversed(ranks)])
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("F", "B", "lifecycle", "comm")]
    # below the axes: inside, it would cover the first rank's bars
    ax.legend(handles, ["forward", "backward", "lifecycle (update, views, grads)",
                        "comm engine (collectives, messages)"], loc="upper center",
              bbox_to_anchor=(0.5, -0.12 - 0.3 / len(ranks)), ncol=4, fontsize=7, frameon=False)
    # numbered from 1, as metrics.jsonl and the progress lines number steps
    ax.set_title(f"step {step + 1}" + f" ({len(info0['events'])} events on rank {ranks[0]})")
    fig.tight_layout()
    with atomic_path(path, durable=False) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return True


__all__ = ["chrome_events", "gantt", "gather", "write"]
