"""Timelines in and out: what an executor ran, kept compact and bounded (`Timeline`), and Chrome
trace JSON (one row per rank, viewable in Perfetto) and a PNG Gantt.

Each executor records (name, group, t0, t1, tid, step) per action, named as the schedule names
it (`F mb3`, `sync L5`; `lifecycle.schedule`): tid 0 is the main thread (compute and lifecycle
actions, hooks nested inside the compute that ran them), tid 1 the communication engine
(messages and collectives, from post to completion). Without `run.trace` only the current
step is kept (a fixed few KiB whatever the run's length); with it, every step up to
`run.trace_bytes` per rank (26 bytes an event, counted by the DDR ledger as `trace.timeline`;
the oldest steps are dropped beyond, and trace.json says how many events). `write` gathers every
rank's events on rank 0 through the comm engine (collective: every rank calls it) and writes
`trace.json`; with matplotlib installed it also draws the last step as a Gantt chart (`.png`
beside it). Times are `time.perf_counter()`, one clock for all ranks of a host.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from ratrain.fileio import atomic_path, atomic_write

# -- recording ---------------------------------------------------------------------------------

# One event, packed: 26 bytes (a tuple and a dict per event cost about 500)
EVENT = np.dtype([("t0", "f8"), ("t1", "f8"), ("name", "u4"), ("step", "i4"), ("group", "u1"),
                  ("tid", "u1")])
CHUNK = 1024  # events per block of storage (26 KiB)
TAG = "trace.timeline"  # the ledger's tag for the kept timeline


class Timeline:
    """What an executor ran, packed: per action or message its name, group, start, end,
    thread (0 main, 1 engine) and step.

    `keep_bytes=None` (`run.trace` off) keeps the current step only: `new_step` empties it and
    its blocks are reused, so it holds the largest step's events and never grows with steps
    (the last action of a step stays there to be asked for: `last`). With `keep_bytes` every
    step is kept, block by block, up to that many bytes; beyond, the oldest block is dropped
    and counted (`dropped`). Names and groups are stored as ids into tables of the distinct
    ones (a plan has a fixed set). With a ledger, every block is accounted under `TAG`.
    Thread-safe: the communication engine records the messages it completes."""

    def __init__(self, keep_bytes: int | None = None, ledger=None):
        self.keep_bytes = keep_bytes
        self.ledger = ledger
        self.dropped = 0
        self._lock = threading.Lock()
        self._names: dict[str, int] = {}  # name -> id (u4), in order of first use
        self._groups: dict[str, int] = {}  # group -> id (u1: a plan has a handful)
        self._blocks: list[np.ndarray] = []
        self._n = CHUNK  # events in the last block (full: the next add opens one)
        self._spare: list[np.ndarray] = []  # emptied blocks, reused (current-step mode)

    @classmethod
    def for_run(cls, run, ledger=None) -> Timeline:
        """`run.trace`: every step up to `run.trace_bytes`, accounted by `ledger`; else the
        current step only."""
        return cls(run.trace_bytes, ledger) if run.trace else cls()

    @staticmethod
    def _id(table: dict[str, int], s: str) -> int:
        i = table.get(s)
        if i is None:
            i = table[s] = len(table)
        return i

    def _open_block(self) -> None:
        block = self._spare.pop() if self._spare else (
            self.ledger.alloc(TAG, (CHUNK,), EVENT, zero=False) if self.ledger is not None
            else np.empty(CHUNK, EVENT))
        self._blocks.append(block)
        self._n = 0
        if self.keep_bytes is not None and len(self._blocks) * CHUNK * EVENT.itemsize > max(
                self.keep_bytes, CHUNK * EVENT.itemsize):
            old = self._blocks.pop(0)
            self.dropped += CHUNK
            if self.ledger is not None:
                self.ledger.free(old)

    def add(self, name: str, group: str, t0: float, t1: float, tid: int, step: int) -> None:
        with self._lock:
            if self._n == CHUNK:
                self._open_block()
            self._blocks[-1][self._n] = (t0, t1, self._id(self._names, name), step,
                                         self._id(self._groups, group), tid)
            self._n += 1

    def new_step(self) -> None:
        """A step begins: in current-step mode the previous one's events are let go."""
        if self.keep_bytes is not None:
            return
        with self._lock:
            self._spare.extend(reversed(self._blocks))
            self._blocks, self._n = [], CHUNK

    def __len__(self) -> int:
        return len(self._blocks) * CHUNK - (CHUNK - self._n) if self._blocks else 0

    @property
    def nbytes(self) -> int:
        """Bytes the timeline holds (its blocks, kept and spare)."""
        return (len(self._blocks) + len(self._spare)) * CHUNK * EVENT.itemsize

    def events(self) -> list[tuple]:
        """The kept events as (name, group, t0, t1, tid, {"step": step}), oldest first."""
        with self._lock:
            rows = [b[: self._n] if i == len(self._blocks) - 1 else b
                    for i, b in enumerate(self._blocks)]
            rows = np.concatenate(rows) if rows else np.empty(0, EVENT)
            names, groups = list(self._names), list(self._groups)
        return [(names[r["name"]], groups[r["group"]], float(r["t0"]), float(r["t1"]),
                 int(r["tid"]), {"step": int(r["step"])}) for r in rows]

    def last(self) -> str | None:
        """The name of the last event recorded, or None."""
        with self._lock:
            if not self._blocks or self._n == 0:
                return None
            return list(self._names)[int(self._blocks[-1][self._n - 1]["name"])]


# -- writing -----------------------------------------------------------------------------------

TRACE_TAG = 7001
COLORS = {"F": "#4c72b0", "B": "#55a868", "lifecycle": "#dd8452", "comm": "#8172b2",
          "p2p": "#937860"}  # compute actions by their first word (F / B), the rest by group


def chrome_events(per_rank: dict[int, dict]) -> list[dict]:
    """Chrome trace events from {rank: {"events": [...], "stage": s, "replica": r}}."""
    t0 = min((e[2] for r in per_rank.values() for e in r["events"]), default=0.0)
    out = []
    for rank, info in sorted(per_rank.items()):
        dropped = f"; its {info['dropped']} oldest events dropped" if info.get("dropped") else ""
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {
            "name": f"rank {rank} (stage {info['stage']}, replica {info['replica']}{dropped})"}})
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
    mine = {"events": executor.events, "stage": executor.stage, "replica": executor.replica,
            "dropped": executor.timeline.dropped}
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


__all__ = ["EVENT", "TAG", "Timeline", "chrome_events", "gantt", "gather", "write"]
