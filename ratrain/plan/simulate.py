"""A discrete-event simulator of training steps at scales no machine here can run.

Input: the per-rank action lists `ratrain.lifecycle` builds (one pipeline = one replica; the
data-parallel replicas run the same lists in lockstep, so one replica stands for all) and a cost
model (`ratrain.plan.cost.CostModel`, or anything with the same methods). Output: the step time,
tokens/s, and per rank the busy time (compute, recompute, update, view), the exposed
communication, the bubble, and the peak memory.

What is modelled, per rank:

- the main thread runs its list in order: compute (`Forward` / `Backward`, block by block, hooks
  in between), the memory-bound lifecycle work (`Update`, `MaterializeView`), and it blocks on
  receives, on `WaitGrad` and on `GradNorm`;
- point-to-point messages between neighbouring stages: `send_mode="eager"` (default; the send is
  handed to the engine and the main thread goes on, as the runtime's engine does) or
  `"rendezvous"` (MPI_Send of a large message: the transfer starts when both sides have posted,
  and both wait for it). A message costs latency + bytes / bandwidth on the sender's link;
- the communication engine, a separate resource: `SyncGrad` queues one all-reduce per block
  (across the `dp` replicas, ring / tree per the cost model); the engine runs one collective at a
  time, in submission order; each takes its latency part then puts its wire bytes on the link;
- the rank's outgoing link is shared (processor sharing) by its concurrent flows: a pipeline
  message sent during a gradient all-reduce slows both down;
- `GradNorm` is a barrier of every rank (the global gradient norm and overflow flag need every
  stage), followed by one small all-reduce over the world.

Memory does not depend on timing (a rank's allocations follow its own list order), so the peak is
a walk over each rank's lists by `ratrain.plan.memory.simulate_peak` (the lifecycle package's
model, the same one the executor's `recompute: auto` uses) with sizes from shapes
(`stage_sizes`).

    res = simulate_config(cfg)                      # the config's layout, policy and recompute
    res.step_s, res.tokens_per_s, res.ranks[0].bubble_s, res.peak_bytes
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ratrain.config import Config, ModelConfig
from ratrain.lifecycle.policies import POLICIES, Policy, StageInfo
from ratrain.lifecycle.schedule import (
    Backward,
    Forward,
    GradNorm,
    MaterializeView,
    RecvBackward,
    RecvForward,
    SendBackward,
    SendForward,
    SyncGrad,
    Update,
    WaitGrad,
    WaitView,
    expand,
    gpipe,
    one_f_one_b,
)
from ratrain.plan.cost import CostModel, block_kind, block_params

SEND_MODES = ("eager", "rendezvous")
NORM_BYTES = 16  # GradNorm's payload: sum of squares (fp64) + overflow flag + loss


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class RankStats:
    """One rank's share of the measured step (seconds), and its peak memory."""

    stage: int
    compute_s: float = 0.0  # forward + backward, recomputation included
    recompute_s: float = 0.0  # the recomputation part of compute_s
    update_s: float = 0.0  # AdamW
    view_s: float = 0.0  # fp16 view materialisation
    comm_exposed_s: float = 0.0  # main thread blocked while its communication was in flight
    bubble_s: float = 0.0  # the rest: waiting for other stages
    peak_bytes: int = 0
    comm_total_s: float = 0.0  # engine busy time (hidden or not)

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.update_s + self.view_s


@dataclass
class SimResult:
    step_s: float
    tokens_per_step: int
    ranks: list[RankStats]
    timeline: list[tuple[int, float, float, str]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else math.inf

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def comm_exposed_s(self) -> float:
        """The largest exposed communication of any rank."""
        return max(r.comm_exposed_s for r in self.ranks)

    @property
    def bubble_s(self) -> float:
        return max(r.bubble_s for r in self.ranks)

    @property
    def recompute_s(self) -> float:
        return max(r.recompute_s for r in self.ranks)


# --------------------------------------------------------------------------------------------
# Memory (timing-independent walk)
# --------------------------------------------------------------------------------------------


def stage_sizes(model: ModelConfig, micro_batch: int, precision: str, blocks,
                keep: dict[str, str] | None = None, shards: int = 1):
    """`ratrain.plan.memory.StageSizes` of one stage on the platform, from shapes.

    Layers keep `memory.layer_activation_bytes` per micro-batch (and hold their full activations
    while a recomputation runs); the head keeps its input and fp32 statistics; the embedding
    keeps the token ids. Kernel workspaces are not counted (the platform's fp16 GEMMs need no
    fp32 weight copies, unlike the CPU emulation, whose executor measures its own).
    """
    from ratrain.plan.memory import StageSizes, act_itemsize, layer_activation_bytes

    tokens = micro_batch * model.seq_len
    x = tokens * model.hidden * act_itemsize(precision)
    layer = {k: layer_activation_bytes(model, micro_batch, precision, k)
             for k in ("all", "selective", "input")}
    params, act, full = {}, {}, {}
    for b in blocks:
        kind = block_kind(b)
        params[b] = block_params(model, kind)
        if kind == "layer":
            act[b], full[b] = dict(layer), layer["all"]
        elif kind == "head":
            act[b] = {"all": x + 3 * 8 * tokens}  # input, fp32 rstd and logsumexp, int64 targets
        else:
            act[b] = {"all": 8 * tokens}  # int64 token ids
    return StageSizes(precision=precision, params=params, act=act, full_act=full,
                      message_bytes=x, keep=dict(keep or {}), shards=shards)


def peak_memory(step_lists, stage: int, blocks, sizes) -> int:
    """Peak bytes of stage `stage` over consecutive steps (`step_lists[k][stage]`), by
    `ratrain.plan.memory.simulate_peak`."""
    from ratrain.plan.memory import simulate_peak

    return simulate_peak([lists[stage] for lists in step_lists], blocks, sizes)


def fit_recompute(step_lists, blocks, model: ModelConfig, micro_batch: int, precision: str,
                  cap: int | None, shards: int = 1):
    """Per stage, the fewest layers fully recomputed whose peak fits `cap`
    (`ratrain.plan.memory.choose_recompute`). Returns (counts, peaks, fits)."""
    from ratrain.plan.memory import choose_recompute

    counts, peaks, fits = [], [], True
    for s, names in enumerate(blocks):
        sizes = stage_sizes(model, micro_batch, precision, names, shards=shards)
        keep, peak = choose_recompute(cap, sizes, [lists[s] for lists in step_lists], names)
        counts.append(sum(1 for k in keep.values() if k == "input"))
        peaks.append(peak)
        fits = fits and (cap is None or peak <= cap)
    return counts, peaks, fits


# --------------------------------------------------------------------------------------------
# Flattening one rank's actions into timed items
# --------------------------------------------------------------------------------------------


@dataclass
class _Item:
    kind: str  # busy | send | recv | sync | wait | gather | waitview | norm | end
    dur: float = 0.0
    parts: dict | None = None  # busy: {"compute"|"recompute"|"update"|"view": seconds}
    key: tuple = ()  # send / recv: the message's channel key
    peer: int = -1  # send: destination stage
    blocks: tuple = ()  # sync / wait / gather / waitview
    step: int = 0
    label: str = ""
    op: str = "allreduce"  # sync: allreduce | scatter (sharded optimizer state)


def _items(actions, stage: int, pp: int, blocks, keep, cost, step: int,
           shards: int = 1) -> list[_Item]:
    out: list[_Item] = []

    def busy(cat: str, dur: float, label: str, extra: float = 0.0):
        if out and out[-1].kind == "busy":
            it = out[-1]
        else:
            it = _Item("busy", parts={}, step=step, label=label)
            out.append(it)
        it.dur += dur
        it.parts[cat] = it.parts.get(cat, 0.0) + dur - extra
        if extra:
            it.parts["recompute"] = it.parts.get("recompute", 0.0) + extra

    def lifecycle(ev):
        if isinstance(ev, Update):
            busy("update", cost.update_time(block_kind(ev.block), shards), ev.label(stage))
        elif isinstance(ev, MaterializeView):
            busy("view", cost.view_time(block_kind(ev.block), shards), ev.label(stage))
            if ev.gather:  # sharded: the rest of the view comes by ring all-gather
                out.append(_Item("gather", blocks=(ev.block,), step=step, label=ev.label(stage)))
        elif isinstance(ev, WaitView):
            out.append(_Item("waitview", blocks=(ev.block,), step=step, label=ev.label(stage)))
        elif isinstance(ev, SyncGrad):
            out.append(_Item("sync", blocks=ev.blocks, step=step, label=ev.label(stage),
                             op="scatter" if ev.scatter else "allreduce"))
        elif isinstance(ev, WaitGrad):
            out.append(_Item("wait", blocks=ev.blocks, step=step, label=ev.label(stage)))
        elif isinstance(ev, GradNorm):
            out.append(_Item("norm", step=step, label="N"))
        # DropView / AllocGrad / FreeGrad: memory only

    for a in actions:
        if isinstance(a, (Forward, Backward)):
            for blk, ev in expand(a, blocks):
                if blk is None:
                    lifecycle(ev)
                    continue
                kind = block_kind(blk)
                if isinstance(ev, Forward):
                    busy("compute", cost.forward_time(kind), a.label(stage))
                else:
                    k = keep.get(blk, "all")
                    t = cost.backward_time(kind, k)
                    busy("compute", t, a.label(stage), t - cost.backward_time(kind, "all"))
        elif isinstance(a, SendForward):
            out.append(_Item("send", key=(step, "f", a.mb, stage), peer=stage + 1, step=step,
                             label=a.label(stage)))
        elif isinstance(a, SendBackward):
            out.append(_Item("send", key=(step, "b", a.mb, stage), peer=stage - 1, step=step,
                             label=a.label(stage)))
        elif isinstance(a, RecvForward):
            out.append(_Item("recv", key=(step, "f", a.mb, stage - 1), step=step,
                             label=a.label(stage)))
        elif isinstance(a, RecvBackward):
            out.append(_Item("recv", key=(step, "b", a.mb, stage + 1), step=step,
                             label=a.label(stage)))
        else:
            lifecycle(a)
    out.append(_Item("end", step=step))
    return out


# --------------------------------------------------------------------------------------------
# The event loop
# --------------------------------------------------------------------------------------------


class _Link:
    """A rank's outgoing link: flows share the bandwidth equally (processor sharing)."""

    def __init__(self, sim: _Sim, bandwidth: float):
        self.sim, self.bw = sim, bandwidth
        self.flows: dict[int, list] = {}  # id -> [remaining bytes, callback]
        self.last = 0.0
        self.version = 0
        self.next_id = 0

    def _settle(self, t: float) -> None:
        if self.flows and t > self.last:
            dec = (t - self.last) * self.bw / len(self.flows)
            for f in self.flows.values():
                f[0] -= dec
        self.last = t

    def add(self, t: float, nbytes: float, cb) -> None:
        if nbytes <= 0 or math.isinf(self.bw):
            self.sim.at(t, cb)
            return
        self._settle(t)
        self.flows[self.next_id] = [float(nbytes), cb]
        self.next_id += 1
        self._reschedule(t)

    def _reschedule(self, t: float) -> None:
        self.version += 1
        if self.flows:
            rem = min(f[0] for f in self.flows.values())
            self.sim.at(t + max(rem, 0.0) * len(self.flows) / self.bw, self._fire, self.version)

    def _fire(self, t: float, version: int) -> None:
        if version != self.version:
            return
        self._settle(t)
        done = [k for k, f in self.flows.items() if f[0] <= 1e-3]  # bytes
        if not done:  # rounding: finish the smallest
            done = [min(self.flows, key=lambda k: self.flows[k][0])]
        cbs = [self.flows.pop(k)[1] for k in done]
        self._reschedule(t)
        for cb in cbs:
            cb(t)


class _Rank:
    def __init__(self, stage: int, items: list[_Item]):
        self.stage, self.items, self.pc = stage, items, 0
        self.blocked_since: float | None = None
        self.busy: dict[int, dict[str, float]] = {}  # step -> category -> s
        self.comm: dict[int, float] = {}  # step -> exposed comm s
        self.end: dict[int, float] = {}  # step -> time its items finished
        self.engine_q: list[tuple[int, str, str]] = []  # (step, block, allreduce|scatter|gather)
        self.engine_busy = False
        self.engine_s = 0.0
        self.synced: set[tuple[int, str]] = set()
        self.gathered: dict[str, int] = {}  # block -> view all-gathers finished
        self.views_used: dict[str, int] = {}  # block -> WaitViews passed
        self.norm_done: dict[int, float] = {}


class _Sim:
    def __init__(self, ranks, cost, dp: int, send_mode: str, timeline: bool):
        self.ranks, self.cost, self.dp, self.send_mode = ranks, cost, dp, send_mode
        bw = cost.rates.link_bandwidth
        self.links = [_Link(self, bw) for _ in ranks]
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.sent: dict[tuple, float] = {}  # key -> time the transfer started
        self.posted_send: set[tuple] = set()
        self.posted_recv: set[tuple] = set()
        self.delivered: dict[tuple, float] = {}
        self.waiting: dict[tuple, list[int]] = {}
        self.norm_arrived: dict[int, list[tuple[int, float]]] = {}
        self.timeline: list | None = [] if timeline else None

    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def wake(self, key) -> None:
        for r in self.waiting.pop(key, ()):
            self.at(self.now, self.advance, r)

    def run(self) -> None:
        for r in range(len(self.ranks)):
            self.at(0.0, self.advance, r)
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            self.now = t
            fn(t, *args)
        stuck = [rk for rk in self.ranks if rk.pc < len(rk.items)]
        if stuck:
            what = "; ".join(
                f"stage {rk.stage} at {rk.items[rk.pc].kind} {rk.items[rk.pc].label}"
                for rk in stuck
            )
            raise RuntimeError(f"simulated schedule deadlocks: {what}")

    # -- messages ---------------------------------------------------------------------------

    def _transfer(self, t: float, key: tuple, src: int) -> None:
        self.sent[key] = t
        lat = self.cost.rates.link_latency
        nbytes = self.cost.activation_bytes

        def on_wire(t2):
            self.links[src].add(t2, nbytes, on_done)

        def on_done(t3):
            self.delivered[key] = t3
            self.wake(key)

        self.at(t + lat, on_wire)

    # -- the engine ---------------------------------------------------------------------------

    def _engine_next(self, t: float, r: int) -> None:
        rk = self.ranks[r]
        if rk.engine_busy or not rk.engine_q:
            return
        step, block, op = rk.engine_q.pop(0)
        rk.engine_busy = True
        kind = block_kind(block)
        if op == "allreduce":
            lat, wire = self.cost.allreduce_terms(self.cost.grad_bytes(kind), self.dp)
        elif op == "scatter":
            lat, wire = self.cost.ring_half_terms(self.cost.grad_bytes(kind), self.dp)
        else:  # gather: the block's view
            lat, wire = self.cost.ring_half_terms(self.cost.view_bytes(kind), self.dp)
        start = t

        def on_wire(t2):
            self.links[r].add(t2, wire, on_done)

        def on_done(t3):
            rk.engine_busy = False
            rk.engine_s += t3 - start
            if op == "gather":
                n = rk.gathered.get(block, 0)
                rk.gathered[block] = n + 1
                self.wake(("view", r, block, n))
            else:
                rk.synced.add((step, block))
                self.wake(("sync", r, step, block))
            self._engine_next(t3, r)

        self.at(t + lat, on_wire)

    # -- the main thread ----------------------------------------------------------------------

    def _unblock(self, rk: _Rank, t: float, step: int, comm_from: float | None) -> None:
        """Account a finished wait: the part after `comm_from` is exposed communication."""
        t0 = rk.blocked_since if rk.blocked_since is not None else t
        if comm_from is not None:
            rk.comm[step] = rk.comm.get(step, 0.0) + max(0.0, t - max(t0, comm_from))
        rk.blocked_since = None

    def _block(self, rk: _Rank, t: float, key, r: int) -> None:
        if rk.blocked_since is None:
            rk.blocked_since = t
        self.waiting.setdefault(key, []).append(r)

    def advance(self, t: float, r: int) -> None:
        rk = self.ranks[r]
        while rk.pc < len(rk.items):
            it = rk.items[rk.pc]
            if it.kind == "busy":
                rk.pc += 1
                acc = rk.busy.setdefault(it.step, {})
                for c, s in it.parts.items():
                    acc[c] = acc.get(c, 0.0) + s
                if self.timeline is not None:
                    self.timeline.append((rk.stage, t, t + it.dur, it.label))
                self.at(t + it.dur, self.advance, r)
                return
            if it.kind == "send":
                if self.send_mode == "eager":
                    self._transfer(t, it.key, r)
                    rk.pc += 1
                    continue
                if it.key not in self.posted_send:
                    self.posted_send.add(it.key)
                    if it.key in self.posted_recv:
                        self._transfer(t, it.key, r)
                if it.key not in self.delivered:
                    self._block(rk, t, it.key, r)
                    return
                self._unblock(rk, t, it.step, self.sent[it.key])
                rk.pc += 1
                continue
            if it.kind == "recv":
                if self.send_mode == "rendezvous" and it.key not in self.posted_recv:
                    self.posted_recv.add(it.key)
                    if it.key in self.posted_send:
                        self._transfer(t, it.key, it.key[3])
                if it.key not in self.delivered:
                    self._block(rk, t, it.key, r)
                    return
                self._unblock(rk, t, it.step, self.sent.get(it.key))
                rk.pc += 1
                continue
            if it.kind in ("sync", "gather"):
                op = it.op if it.kind == "sync" else "gather"
                rk.engine_q.extend((it.step, b, op) for b in it.blocks)
                self._engine_next(t, r)
                rk.pc += 1
                continue
            if it.kind == "waitview":
                b = it.blocks[0]
                n = rk.views_used.get(b, 0)
                if rk.gathered.get(b, 0) <= n:
                    self._block(rk, t, ("view", r, b, n), r)
                    return
                rk.views_used[b] = n + 1
                self._unblock(rk, t, it.step, -math.inf)
                rk.pc += 1
                continue
            if it.kind == "wait":
                missing = [b for b in it.blocks if (it.step, b) not in rk.synced]
                if missing:
                    self._block(rk, t, ("sync", r, it.step, missing[0]), r)
                    return
                self._unblock(rk, t, it.step, -math.inf)
                rk.pc += 1
                continue
            if it.kind == "norm":
                done = rk.norm_done.get(it.step)
                if done is None:
                    self._arrive_norm(t, r, it.step)
                    return
                if t < done:
                    return  # woken at `done`
                # waiting for the other stages is bubble, the collective is communication
                self._unblock(rk, t, it.step, done - self._norm_cost())
                rk.pc += 1
                continue
            if it.kind == "end":
                rk.end[it.step] = t
                rk.pc += 1
                continue
            raise AssertionError(it.kind)  # pragma: no cover

    def _norm_cost(self) -> float:
        world = len(self.ranks) * self.dp
        return self.cost.allreduce_time(NORM_BYTES, world, "tree") if world > 1 else 0.0

    def _arrive_norm(self, t: float, r: int, step: int) -> None:
        rk = self.ranks[r]
        if rk.blocked_since is None:
            rk.blocked_since = t
        arrived = self.norm_arrived.setdefault(step, [])
        arrived.append((r, t))
        if len(arrived) == len(self.ranks):
            done = t + self._norm_cost()
            for r2, _ in arrived:
                self.ranks[r2].norm_done[step] = done
                self.at(done, self.advance, r2)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def simulate(
    step_lists,
    blocks,
    cost,
    dp: int = 1,
    keep: list[dict[str, str]] | None = None,
    tokens_per_step: int = 0,
    send_mode: str = "eager",
    mem=None,
    timeline: bool = False,
    shards: int = 1,
) -> SimResult:
    """Simulate consecutive steps of one replica's pipeline.

    `step_lists[k][s]`: the actions of stage `s` in step `k` (one step or several, run back to
    back); `blocks[s]`: stage s's block names; `keep[s]`: block -> "all" | "selective" | "input";
    `cost`: a `CostModel` (or the same methods); `mem`: (model, micro_batch, precision) for
    peak memory figures (`stage_sizes`), or None; `shards`: the dp segments of the optimizer
    state the lists were built for (updates, casts and view all-gathers of a segment). The step time is that of the last step, measured between the
    moments the last rank finished the step before and this one (the whole run for one step).
    """
    if send_mode not in SEND_MODES:
        raise ValueError(f"send_mode={send_mode!r} is not one of {', '.join(SEND_MODES)}")
    pp = len(blocks)
    keep = keep or [{} for _ in range(pp)]
    ranks = []
    for s in range(pp):
        items: list[_Item] = []
        for k, lists in enumerate(step_lists):
            items += _items(lists[s], s, pp, blocks[s], keep[s], cost, k, shards)
        ranks.append(_Rank(s, items))
    sim = _Sim(ranks, cost, dp, send_mode, timeline)
    sim.run()

    last = len(step_lists) - 1
    end = max(rk.end[last] for rk in ranks)
    begin = max(rk.end[last - 1] for rk in ranks) if last > 0 else 0.0
    step_s = end - begin
    stats = []
    for s, rk in enumerate(ranks):
        busy = rk.busy.get(last, {})
        st = RankStats(
            stage=s,
            compute_s=busy.get("compute", 0.0) + busy.get("recompute", 0.0),
            recompute_s=busy.get("recompute", 0.0),
            update_s=busy.get("update", 0.0),
            view_s=busy.get("view", 0.0),
            comm_exposed_s=rk.comm.get(last, 0.0),
            comm_total_s=rk.engine_s / len(step_lists),
        )
        st.bubble_s = max(0.0, step_s - st.busy_s - st.comm_exposed_s)
        if mem is not None:
            sizes = stage_sizes(*mem, blocks[s], keep[s], shards=shards)
            st.peak_bytes = peak_memory(step_lists, s, blocks[s], sizes)
        stats.append(st)
    return SimResult(step_s, tokens_per_step, stats, sim.timeline or [])


def stage_block_names(model: ModelConfig, pp: int, layers_per_stage=None) -> list[tuple[str, ...]]:
    """Block names of every stage (embed on the first, head on the last)."""
    from ratrain.exec.spec import stage_layers

    out = []
    for s, layers in enumerate(stage_layers(model, pp, layers_per_stage)):
        names = ["embed"] if s == 0 else []
        names += [f"layers.{i}" for i in layers]
        if s == pp - 1:
            names.append("head")
        out.append(tuple(names))
    return out


def policy_steps(policy: str, blocks, m: int, precision: str, model: ModelConfig | None = None,
                 steps: int = 2, shards: int = 1):
    """`steps` consecutive steps of every stage under `policy` (a policy name or "1f1b-bare" /
    "gpipe-bare": the pipeline order alone, no lifecycle actions)."""
    pp = len(blocks)
    if policy in ("1f1b-bare", "gpipe-bare"):
        order = one_f_one_b if policy == "1f1b-bare" else gpipe
        one = [order(pp, s, m) for s in range(pp)]
        return [one] * steps
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    pol = Policy(policy)
    infos = []
    for s in range(pp):
        sizes = tuple(4 * block_params(model, block_kind(b)) if model else 0 for b in blocks[s])
        infos.append(StageInfo(pp, s, m, tuple(blocks[s]), sizes, precision, shards))
    out = []
    for k in range(steps):
        carry = k > 0 and pol.carries(infos[0])
        out.append([pol.build_step(info, carry=carry) for info in infos])
    return out


def keep_for(blocks, recompute: str, recompute_layers: list[int] | None = None):
    """Per stage, block -> keep. `recompute`: none | selective | full, or per-stage counts of
    fully recomputed layers (`recompute_layers[s]`: the first n layers of stage s)."""
    out = []
    for s, names in enumerate(blocks):
        layers = [b for b in names if b.startswith("layers.")]
        if recompute_layers is not None:
            n = recompute_layers[s]
            out.append({b: ("input" if i < n else "all") for i, b in enumerate(layers)})
        elif recompute in ("none", "auto"):
            out.append({b: "all" for b in layers})
        elif recompute == "full":
            out.append({b: "input" for b in layers})
        elif recompute == "selective":
            out.append({b: "selective" for b in layers})
        else:
            raise ValueError(f"recompute={recompute!r} is not one of none, selective, full, auto")
    return out


def simulate_config(
    cfg: Config,
    cost: CostModel | None = None,
    policy: str | None = None,
    recompute_layers: list[int] | None = None,
    steps: int = 2,
    send_mode: str = "eager",
    with_memory: bool = True,
) -> SimResult:
    """Simulate `cfg`'s layout under `policy` (default: the config's) with its recompute setting
    (`auto` = none unless `recompute_layers` gives per-stage counts)."""
    cost = cost or CostModel.from_config(cfg)
    m, p = cfg.model, cfg.parallel
    policy = policy or cfg.schedule.policy
    blocks = stage_block_names(m, p.pp, p.layers_per_stage)
    shards = plan_shards(cfg, policy, p.dp)
    lists = policy_steps(policy, blocks, p.num_micro_batches, cfg.precision, m, steps, shards)
    keep = keep_for(blocks, cfg.schedule.recompute, recompute_layers)
    mem = (m, p.micro_batch, cfg.precision) if with_memory else None
    tokens = p.global_batch * m.seq_len
    return simulate(lists, blocks, cost, p.dp, keep, tokens, send_mode, mem, shards=shards)


def plan_shards(cfg: Config, policy: str, dp: int) -> int:
    """The dp segments of the optimizer state `policy` uses at `dp` replicas, as the runtime
    does (`ratrain` with `schedule.shard_optimizer`: dp; otherwise 1)."""
    if policy in ("1f1b-bare", "gpipe-bare"):
        return 1
    return Policy(policy).shards(dp, cfg.schedule.shard_optimizer)


__all__ = [
    "RankStats",
    "SEND_MODES",
    "SimResult",
    "keep_for",
    "fit_recompute",
    "plan_shards",
    "peak_memory",
    "policy_steps",
    "simulate",
    "simulate_config",
    "stage_block_names",
    "stage_sizes",
]
