"""The simulator's event loop: timed items per rank, links shared by their flows, the engine.

`items` turns one rank's actions of a step into timed items through one `dispatch_table`
(like every interpreter of the schedule): busy spans (compute, updates, view casts; consecutive
ones merged), messages, engine submissions, waits, the norm barrier and an end mark; each pass
over the step (`lifecycle.passes`) gives its own actions' items (`Pass.simulator`, through
`_Flatten.add` and `busy`). `Sim` plays every rank's items against each other (see
`plan.simulate` for what is modelled), the nodes' memory tiers among them (`plan.tiersim`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ratrain.exec.spec import block_role, kernel_recompute
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.schedule import dispatch_table, expand
from ratrain.plan.tiersim import TierSim

NORM_BYTES = 16  # GradNorm's payload: sum of squares (fp64) + overflow flag + loss


# --------------------------------------------------------------------------------------------
# Flattening one rank's actions into timed items
# --------------------------------------------------------------------------------------------


@dataclass
class _Item:
    op: str  # busy | send | recv | sync | wait | await | gather | waitview | norm | tier | tierwait | end
    dur: float = 0.0
    parts: dict | None = None  # busy: {"compute"|"recompute"|"update"|"view": seconds}
    key: tuple = ()  # send / recv: the message's channel key
    peer: int = -1  # send: destination stage
    blocks: tuple = ()  # sync / wait / gather / waitview
    step: int = 0
    act: object = None  # the action it comes from (its name is the item's label)
    coll: str = "allreduce"  # sync: allreduce | scatter (sharded optimizer state) | average
    nbytes: float = 0.0  # tier: bytes moved (`plan.tiersim`)

    @property
    def label(self) -> str:
        """The action's name, made when asked (the timeline, an error): most never are."""
        return self.act.name() if self.act is not None else ""


class _Flatten:
    """One rank's actions of one step as timed items (see `_items`)."""

    def __init__(self, stage, blocks, recompute, cost, step, shards, rank, passes=()):
        self.stage, self.rank, self.blocks, self.recompute = stage, rank, blocks, recompute
        self.cost, self.step, self.shards = cost, step, shards
        self.out: list[_Item] = []
        self.memo: dict = {}  # (cost method, arguments) -> its figure
        parts = [x for x in (p.simulator(self) for p in passes) if x is not None]
        self.table = dispatch_table("simulate", {
            sched.Forward: self._compute, sched.Backward: self._compute,
            sched.SendForward: self._send, sched.SendBackward: self._send,
            sched.RecvForward: self._recv, sched.RecvBackward: self._recv,
            sched.Update: self._update, sched.MaterializeView: self._view,
            sched.WaitView: lambda a: self.add("waitview", a, blocks=(a.block,)),
            sched.SyncGrad: lambda a: self.add("sync", a, blocks=a.blocks,
                                         coll="scatter" if a.scatter else "allreduce"),
            sched.WaitGrad: lambda a: self.add("wait", a, blocks=a.blocks),
            sched.GradNorm: lambda a: self.add("norm", a),
            **{t: f for x in parts for t, f in x.handlers().items()},
        }, ignore=(sched.DropView, sched.AllocGrad, sched.FreeGrad), passes=passes)  # memory only

    def add(self, op, a, **kw):
        """An item `op` of action `a` (its name the label, made when asked) in this step."""
        self.out.append(_Item(op, step=self.step, act=a, **kw))

    def figure(self, name: str, *args):
        """The cost model's `name(*args)`, asked once per item list (the same figure)."""
        key = (name, *args)
        if key not in self.memo:
            self.memo[key] = getattr(self.cost, name)(*args)
        return self.memo[key]

    def busy(self, cat: str, dur: float, act, extra: float = 0.0):
        if self.out and self.out[-1].op == "busy":
            it = self.out[-1]
        else:
            it = _Item("busy", parts={}, step=self.step, act=act)
            self.out.append(it)
        it.dur += dur
        it.parts[cat] = it.parts.get(cat, 0.0) + dur - extra
        if extra:
            it.parts["recompute"] = it.parts.get("recompute", 0.0) + extra

    def _compute(self, a):
        fig = self.figure
        events = (expand(a, self.blocks) if a.pre or a.post else  # no hooks: its blocks
                  ((b, a) for b in (self.blocks if isinstance(a, sched.Forward)
                                    else reversed(self.blocks))))
        for blk, ev in events:
            if blk is None:  # a lifecycle hook
                self.table[type(ev)](ev)
                continue
            role = block_role(blk)
            if isinstance(ev, sched.Forward):
                self.busy("compute", fig("forward_time", role), a)
            else:
                t = fig("backward_time", role,
                        kernel_recompute(self.recompute.get(blk, "none")))
                self.busy("compute", t, a, t - fig("backward_time", role))

    def _send(self, a):
        d = "f" if isinstance(a, sched.SendForward) else "b"
        peer = self.rank + (1 if d == "f" else -1)
        self.add("send", a, key=(self.step, d, a.mb, self.rank), peer=peer)

    def _recv(self, a):
        d = "f" if isinstance(a, sched.RecvForward) else "b"
        src = self.rank - (1 if d == "f" else -1)
        self.add("recv", a, key=(self.step, d, a.mb, src))

    def _update(self, a):
        self.busy("update", self.figure("update_time", block_role(a.block), self.shards), a)

    def _view(self, a):
        self.busy("view", self.figure("view_time", block_role(a.block), self.shards), a)
        if a.gather:  # sharded: the rest of the view comes by ring all-gather
            self.add("gather", a, blocks=(a.block,))


def items(actions, stage: int, blocks, recompute, cost, step: int, shards: int = 1,
          rank: int | None = None, passes=()) -> list[_Item]:
    """Timed items of one rank's step: busy spans (compute, updates, view casts; consecutive
    ones merged), messages, engine submissions, waits, the norm barrier, its `passes`' items
    (the tier's transfers and waits, the parameter averages), and an end mark.
    `rank`: the simulator's index of the rank (`group * pp + stage`; default `stage`), which
    names its messages' peers."""
    flat = _Flatten(stage, blocks, recompute, cost, step, shards,
                    stage if rank is None else rank, passes)
    for a in actions:
        flat.table[type(a)](a)
    flat.out.append(_Item("end", step=step))
    return flat.out


# --------------------------------------------------------------------------------------------
# The event loop
# --------------------------------------------------------------------------------------------


class _Link:
    """A rank's outgoing link: flows share the bandwidth equally (processor sharing)."""

    def __init__(self, sim: Sim, bandwidth: float):
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


class RankState:
    def __init__(self, stage: int, items: list[_Item], blocks=(), group: int = 0):
        self.stage, self.group, self.items, self.pc = stage, group, items, 0
        self.blocks = tuple(blocks)  # the stage's block names
        self.blocked_since: float | None = None
        self.busy: dict[int, dict[str, float]] = {}  # step -> category -> s
        self.comm: dict[int, float] = {}  # step -> exposed comm s
        self.end: dict[int, float] = {}  # step -> time its items finished
        self.engine_q: list[tuple[int, str, str]] = []  # (step, block, allreduce|scatter|gather)
        self.engine_busy = False
        self.engine_ready = False  # its head collective waits for the other groups
        self.ready_at = 0.0  # since when
        # (ready, start) of each collective that waited for the other replicas: a wait on the
        # engine in such a span is imbalance, not communication
        self.held: list[tuple[float, float]] = []
        self.engine_s = 0.0
        self.collectives = 0  # collectives started (they pair across groups in this order)
        self.synced: set[tuple[int, str]] = set()
        self.averaged: dict[str, int] = {}  # block -> step of its last parameter average
        self.gathered: dict[str, int] = {}  # block -> view all-gathers finished
        self.views_used: dict[str, int] = {}  # block -> WaitViews passed
        self.norm_done: dict[int, float] = {}
        self.tier_s: dict[int, float] = {}  # step -> seconds of its tier transfers
        self.tier_bytes: dict[int, float] = {}  # step -> bytes they moved
        self.tier_exposed: dict[int, float] = {}  # step -> main thread blocked on the tier


class Sim:
    """Every simulated rank's items against each other. Ranks are `group * pp + stage`: one
    group (the default) is one replica standing for all in lockstep; several are replicas
    unlike in speed or share (`groups`: the replicas each stands for, its first played), each
    rank with its own cost model (`costs`), a data-parallel collective starting when every
    group's rank of the stage has reached it."""

    def __init__(self, ranks, cost, dp: int, send_mode: str, timeline: bool, costs=None,
                 groups=None):
        self.ranks, self.cost, self.dp, self.send_mode = ranks, cost, dp, send_mode
        self.pp = len({rk.stage for rk in ranks})
        self.costs = list(costs) if costs is not None else [cost] * len(ranks)
        self.layout = cost.nodes(self.pp, dp)
        self.node, self.copies = self.layout.groups(groups or (tuple(range(dp)),))
        # each rank's own intra-node link; one interface per node its ranks occupy
        self.intra = [_Link(self, c.rates.intra_bandwidth) for c in self.costs]
        self.nics = {}
        for r, n in enumerate(self.node):
            self.nics.setdefault(n, _Link(self, self.costs[r].rates.link_bandwidth))
        # the chunk of each stage's data-parallel staging, as the runtime sizes it
        self.chunk = [cost.staging_chunk(rk.blocks, *self.layout.runs[rk.stage])
                      for rk in ranks]
        self.members = [[r for r, x in enumerate(ranks) if x.stage == s] for s in range(self.pp)]
        self.tier = TierSim(self, _Link)  # each node's memory tier (offload)
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
        self.steps = {"busy": self._busy, "send": self._send, "recv": self._recv,
                      "sync": self._submit, "gather": self._submit, "waitview": self._waitview,
                      "wait": self._wait, "await": self._await, "norm": self._norm,
                      "end": self._end, "tier": self.tier.start, "tierwait": self.tier.wait}

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
                f"stage {rk.stage} at {rk.items[rk.pc].op} {rk.items[rk.pc].label}"
                for rk in stuck
            )
            raise RuntimeError(f"simulated schedule deadlocks: {what}")

    # -- messages ---------------------------------------------------------------------------

    def _transfer(self, t: float, key: tuple, src: int) -> None:
        """A pipeline message from rank `src`: on its intra-node link when the neighbour is on
        the same node, else through its node's interface together with the same message of the
        other replicas of its group and stage on that node (`copies`)."""
        self.sent[key] = t
        rates = self.costs[src].rates
        dst = src + (1 if key[1] == "f" else -1)
        nbytes = self.cost.activation_bytes
        if self.node[src] == self.node[dst]:
            lat, link = rates.intra_latency, self.intra[src]
        else:
            lat, link = rates.link_latency, self.nics[self.node[src]]
            nbytes *= self.copies[src]

        def on_wire(t2):
            link.add(t2, nbytes, on_done)

        def on_done(t3):
            self.delivered[key] = t3
            self.wake(key)

        self.at(t + lat, on_wire)

    # -- the engine ---------------------------------------------------------------------------

    def _engine_next(self, t: float, r: int) -> None:
        """The next collective of rank r's engine, once every group's rank of its stage has
        reached it: its latency (the largest of theirs), then its bytes on each one's
        intra-node link and on each of their nodes' interfaces at once
        (`CostModel.collective_terms`); done for all when the last bytes are."""
        rk = self.ranks[r]
        if rk.engine_busy or rk.engine_ready or not rk.engine_q:
            return
        rk.engine_ready, rk.ready_at = True, t
        members = self.members[rk.stage]
        if not all(self.ranks[m].engine_ready for m in members):
            return  # the last to arrive starts it
        heads = {self.ranks[m].engine_q[0] + (self.ranks[m].collectives,) for m in members}
        if len(heads) > 1:
            raise RuntimeError(f"simulated collectives do not pair across replicas at stage "
                               f"{rk.stage}: {sorted(heads)}")
        step, block, op = rk.engine_q[0]
        role = block_role(block)
        nodes, local = self.layout.runs[rk.stage]
        if op == "gather":  # the block's view
            coll, nbytes = "allgather", self.cost.view_bytes(role)
        elif op == "average":  # partial synchronization: the block's fp32 master
            coll, nbytes = "allreduce", self.cost.grad_bytes(role)
        else:
            coll = "reduce_scatter" if op == "scatter" else "allreduce"
            nbytes = self.cost.grad_bytes(role)
        terms = {m: self.costs[m].collective_terms(coll, nbytes, nodes, local, self.chunk[m])
                 for m in members}
        nics = {self.node[m]: terms[m][2] for m in reversed(members)}  # once per node
        for m in members:
            x = self.ranks[m]
            if t > x.ready_at:
                x.held.append((x.ready_at, t))
            x.engine_q.pop(0)
            x.engine_busy, x.engine_ready = True, False
            x.collectives += 1
        start, left = t, [len(members) + len(nics)]

        def on_wire(t2):
            for m in members:
                self.intra[m].add(t2, terms[m][1], on_done)
            for n, nbytes in nics.items():
                self.nics[n].add(t2, nbytes, on_done)

        def on_done(t3):
            left[0] -= 1
            if left[0]:
                return
            for m in members:
                self._engine_done(t3, m, start, step, block, op)
            for m in members:
                self._engine_next(t3, m)

        self.at(t + max(x[0] for x in terms.values()), on_wire)

    def _engine_done(self, t: float, r: int, start: float, step: int, block: str, op: str):
        rk = self.ranks[r]
        rk.engine_busy = False
        rk.engine_s += t - start
        if op == "gather":
            n = rk.gathered.get(block, 0)
            rk.gathered[block] = n + 1
            self.wake(("view", r, block, n))
        else:
            rk.synced.add((step, block))
            self.wake(("sync", r, step, block))

    # -- the main thread ----------------------------------------------------------------------

    def _unblock(self, rk: RankState, t: float, step: int, comm_from: float | None,
                 held=()) -> None:
        """Account a finished wait: the part after `comm_from` is exposed communication, but
        for the spans in `held` (a collective waiting for the other replicas: imbalance)."""
        t0 = rk.blocked_since if rk.blocked_since is not None else t
        if comm_from is not None:
            idle = sum(max(0.0, min(t, b) - max(t0, a)) for a, b in held if b > t0)
            rk.comm[step] = rk.comm.get(step, 0.0) + max(0.0, t - max(t0, comm_from) - idle)
        rk.blocked_since = None

    def _block(self, rk: RankState, t: float, key, r: int) -> None:
        if rk.blocked_since is None:
            rk.blocked_since = t
        self.waiting.setdefault(key, []).append(r)

    def advance(self, t: float, r: int) -> None:
        """Run rank `r`'s items from its program counter until one blocks or takes time. Each
        item op has a step method returning True to go on with the next item, False to stop
        (the rank is blocked, or busy until an event wakes it)."""
        rk, steps = self.ranks[r], self.steps
        items = rk.items
        while rk.pc < len(items):
            it = items[rk.pc]
            if not steps[it.op](t, r, rk, it):
                return
            rk.pc += 1

    def _busy(self, t, r, rk, it) -> bool:
        rk.pc += 1  # done once its time has passed: resume after it
        acc = rk.busy.setdefault(it.step, {})
        for c, s in it.parts.items():
            acc[c] = acc.get(c, 0.0) + s
        if self.timeline is not None:
            self.timeline.append((rk.stage, t, t + it.dur, it.label))
        self.at(t + it.dur, self.advance, r)
        return False

    def _send(self, t, r, rk, it) -> bool:
        if self.send_mode == "eager":
            self._transfer(t, it.key, r)
            return True
        if it.key not in self.posted_send:
            self.posted_send.add(it.key)
            if it.key in self.posted_recv:
                self._transfer(t, it.key, r)
        if it.key not in self.delivered:
            self._block(rk, t, it.key, r)
            return False
        self._unblock(rk, t, it.step, self.sent[it.key])
        return True

    def _recv(self, t, r, rk, it) -> bool:
        if self.send_mode == "rendezvous" and it.key not in self.posted_recv:
            self.posted_recv.add(it.key)
            if it.key in self.posted_send:
                self._transfer(t, it.key, it.key[3])
        if it.key not in self.delivered:
            self._block(rk, t, it.key, r)
            return False
        self._unblock(rk, t, it.step, self.sent.get(it.key))
        return True

    def _submit(self, t, r, rk, it) -> bool:
        coll = it.coll if it.op == "sync" else "gather"
        rk.engine_q.extend((it.step, b, coll) for b in it.blocks)
        if coll == "average":
            rk.averaged.update(dict.fromkeys(it.blocks, it.step))
        self._engine_next(t, r)
        return True

    def _waitview(self, t, r, rk, it) -> bool:
        b = it.blocks[0]
        n = rk.views_used.get(b, 0)
        if rk.gathered.get(b, 0) <= n:
            self._block(rk, t, ("view", r, b, n), r)
            return False
        rk.views_used[b] = n + 1
        self._unblock(rk, t, it.step, -math.inf, rk.held)
        return True

    def _wait(self, t, r, rk, it) -> bool:
        missing = [b for b in it.blocks if (it.step, b) not in rk.synced]
        if missing:
            self._block(rk, t, ("sync", r, it.step, missing[0]), r)
            return False
        self._unblock(rk, t, it.step, -math.inf, rk.held)
        return True

    def _await(self, t, r, rk, it) -> bool:
        """A parameter average's wait: for the block's last average (its step's, or the step
        before under a deferred update)."""
        missing = [b for b in it.blocks if (rk.averaged[b], b) not in rk.synced]
        if missing:
            self._block(rk, t, ("sync", r, rk.averaged[missing[0]], missing[0]), r)
            return False
        self._unblock(rk, t, it.step, -math.inf, rk.held)
        return True

    def _norm(self, t, r, rk, it) -> bool:
        done = rk.norm_done.get(it.step)
        if done is None:
            self._arrive_norm(t, r, it.step)
            return False
        if t < done:
            return False  # woken at `done`
        # waiting for the other stages is bubble, the collective is communication
        self._unblock(rk, t, it.step, done - self._norm_cost())
        return True

    def _end(self, t, r, rk, it) -> bool:
        rk.end[it.step] = t
        return True

    def _norm_cost(self) -> float:
        nodes, local = self.layout.world_runs
        return max(c.collective_time("allreduce", NORM_BYTES, nodes, local)
                   for c in {id(c): c for c in self.costs}.values())

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


__all__ = ["NORM_BYTES", "RankState", "Sim", "items"]
