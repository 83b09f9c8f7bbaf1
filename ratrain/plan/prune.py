"""Pruning the search: a lower bound of the simulated step, and the plans a search keeps.

A search prints its fastest plans. A candidate that cannot be among them need not be
simulated, and `TopPlayed` says when one cannot: its most tokens/s (from `StepGraph`'s lower
bound of its step) is below what the search keeps of the plans simulated so far. The search
plays its candidates in its own order and prunes only once it keeps all it keeps. A candidate
is left out only when its bound is strictly below, so the plans it prints, and their order
among equals, stay the same.

The bound. `plan.simulate` measures the last step: from the moment the last rank ended the
step before, to the moment the last rank ends this one. A rank runs its items in order, a busy
item takes its seconds, a receive waits for its send, and the barrier of the global facts
(`GradNorm`) waits for every rank. Everything else (links, the engine's collectives, the
tier, the barrier's own collective) only adds time. So the last step holds chains of busy
seconds (compute, updates, view casts, by the simulator's own figures) along each rank's
list, from a send to its receive, and through the barrier.

- When each rank's step before ends with the barrier and then busy work that waits for
  nothing, rank r starts the last step its seconds of that work after the barrier. The step is
  then at least the longest chain from those starts, less the latest start.
- Otherwise, call r the rank that ended the step before last: the step is at least the
  longest chain from r's start. r is not known before the simulation, so the bound takes the
  least over the ranks. This `weak` bound also holds for lists that add waits to these: the
  same plan with its optimizer state in the tier.

    graph = StepGraph(plan, cost)                   # once per plan and cost
    low = graph.lower_bound(recompute)              # <= simulate(...).step_s, for any choice
"""

from __future__ import annotations

import heapq
import math

from ratrain.exec.spec import block_role
from ratrain.lifecycle import schedule as sched
from ratrain.exec.spec import kernel_recompute

SLACK = 1e-9  # the bound is lowered by this part: float sums in another order may round up

_SENDS = {sched.SendForward: "f", sched.SendBackward: "b"}
_RECVS = {sched.RecvForward: "f", sched.RecvBackward: "b"}
_BUSY = (sched.Forward, sched.Backward, sched.Update, sched.MaterializeView)
_AFTER_NORM = (sched.Update, sched.MaterializeView, sched.FreeGrad, sched.DropView,
               sched.AllocGrad)  # what may follow the barrier for `_restarts`: nothing waits


def _restarts(plan, cost, step: int) -> list[float] | None:
    """When every rank's list of step `step` ends with the barrier and then only busy work
    that waits for nothing: each rank's seconds after the barrier. Every rank then ends the
    step that many seconds after the barrier ends. None otherwise."""
    out = []
    for s in range(len(plan.blocks)):
        actions = plan.step_list(s, step > 0, step)
        norms = [i for i, a in enumerate(actions) if type(a) is sched.GradNorm]
        if len(norms) != 1:
            return None
        busy = 0.0
        for a in actions[norms[0] + 1:]:
            if type(a) not in _AFTER_NORM:
                return None
            if type(a) is sched.Update:
                busy += cost.update_time(block_role(a.block), plan.shards)
            elif type(a) is sched.MaterializeView:
                busy += cost.view_time(block_role(a.block), plan.shards)
        out.append(busy)
    return out


class StepGraph:
    """The last of `steps` steps of `plan` as chains of busy seconds (see the module), made
    once; `lower_bound(recompute)` for each recompute choice. A node is a run of busy actions
    of one stage between two waits: its fixed seconds and its forward and backward counts."""

    def __init__(self, plan, cost, steps: int = 2):
        self.plan, self.cost = plan, cost
        self.fixed: list[float] = []  # per node: seconds of updates and view casts
        self.runs: list[tuple[int, int, int]] = []  # per node: (stage, forwards, backwards)
        self.succ: list[list[int]] = []  # per node: the nodes that start after it ends
        self.firsts: list[int] = []  # per stage: the node its step starts with
        self.starts, self.order = None, None
        if plan.period != 1 or steps < 2:  # steps that differ: no bound
            return
        self.starts = _restarts(plan, cost, steps - 2)
        barrier = self._node(-1)
        sends, waits = {}, []  # message -> the node it leaves after; (node, message it waits)
        for s in range(len(plan.blocks)):
            last = self._node(s)
            self.firsts.append(last)
            grows, pending = False, []  # whether `last` takes the next busy action; messages

            def begin(last=None, s=s, pending=pending):  # a node after `last` and the messages
                u = self._node(s, last)
                waits.extend((u, key) for key in pending)
                pending.clear()
                return u

            for a in plan.step_list(s, True, steps - 1):
                kind = type(a)
                if kind in _BUSY:
                    if not grows:
                        last, grows = begin(last), True
                    self._add(last, a)
                elif kind in _SENDS or kind is sched.GradNorm:
                    if pending:  # it leaves once what it follows has arrived
                        last = begin(last)
                    grows = False
                    if kind is sched.GradNorm:  # it ends when every rank has reached it
                        self.succ[last].append(barrier)
                        last = self._node(s, barrier)
                    else:
                        sends[(_SENDS[kind], a.mb, s)] = last
                elif kind in _RECVS:
                    pending.append((_RECVS[kind], a.mb,
                                    s - 1 if kind is sched.RecvForward else s + 1))
                    grows = False
                # else: waits, frees, the tier: they only add time
            if pending:
                begin(last)
        for u, key in waits:  # a message never sent is not waited for: a lower bound still
            if key in sends:
                self.succ[sends[key]].append(u)
        self.order = self._order()

    def _node(self, stage: int, after: int | None = None) -> int:
        u = len(self.fixed)
        self.fixed.append(0.0)
        self.runs.append((stage, 0, 0))
        self.succ.append([])
        if after is not None:
            self.succ[after].append(u)
        return u

    def _add(self, u: int, a) -> None:
        stage, f, b = self.runs[u]
        if type(a) is sched.Forward:
            self.runs[u] = (stage, f + 1, b)
        elif type(a) is sched.Backward:
            self.runs[u] = (stage, f, b + 1)
        elif type(a) is sched.Update:
            self.fixed[u] += self.cost.update_time(block_role(a.block), self.plan.shards)
        else:
            self.fixed[u] += self.cost.view_time(block_role(a.block), self.plan.shards)

    def _order(self) -> list[int] | None:
        """The nodes in an order where each comes after those it waits for (None: a cycle)."""
        n = len(self.succ)
        left = [0] * n
        for vs in self.succ:
            for v in vs:
                left[v] += 1
        ready = [u for u in range(n) if not left[u]]
        order = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v in self.succ[u]:
                left[v] -= 1
                if not left[v]:
                    ready.append(v)
        return order if len(order) == n else None

    def lower_bound(self, recompute, weak: bool = False) -> float:
        """A lower bound of the simulated step with `recompute[s]` (layer -> choice) on every
        stage s (0 when none is known). `weak`: from the chains alone, not the starts after the
        barrier before (so it holds for any list that adds waits to these)."""
        if self.order is None:
            return 0.0
        cost, plan = self.cost, self.plan
        per = []  # per stage: (forward, backward) seconds of one micro-batch
        for s, blocks in enumerate(plan.blocks):
            choice = recompute[s] if recompute else {}
            per.append((sum(cost.forward_time(block_role(b)) for b in blocks),
                        sum(cost.backward_time(block_role(b),
                                               kernel_recompute(choice.get(b, "none")))
                            for b in blocks)))
        dur = [fixed + (f * per[s][0] + b * per[s][1] if f or b else 0.0)
               for fixed, (s, f, b) in zip(self.fixed, self.runs)]
        if self.starts is not None and not weak:  # each rank starts its seconds after the
            # barrier before
            begin = [-math.inf] * len(dur)
            for u, t in zip(self.firsts, self.starts):
                begin[u] = t
            latest = -math.inf
            for u in self.order:
                end = begin[u] + dur[u]
                latest = max(latest, end)
                for v in self.succ[u]:
                    if end > begin[v]:
                        begin[v] = end
            low = latest - max(self.starts)
        else:  # whichever rank ended the step before last: the longest chain from its start
            tail = [0.0] * len(dur)
            for u in reversed(self.order):
                tail[u] = dur[u] + max((tail[v] for v in self.succ[u]), default=0.0)
            low = min(tail[u] for u in self.firsts)
        return max(low, 0.0) * (1 - SLACK)


def step_lower_bound(plan, cost, recompute, steps: int = 2) -> float:
    """A lower bound of `simulate(plan, cost, recompute, steps=steps).step_s` for a plan whose
    replicas run in lockstep (`StepGraph`, made for one choice)."""
    return StepGraph(plan, cost, steps).lower_bound(recompute)


class Bounds:
    """The most tokens/s of `plan`'s step with a recompute choice, `tokens` a step; its
    `StepGraph` is made at the first question."""

    def __init__(self, plan, cost, tokens: int, steps: int = 2):
        self.plan, self.cost, self.tokens, self.steps, self.graph = plan, cost, tokens, steps, None

    def upper(self, recompute, weak: bool = False) -> float:
        if self.graph is None:
            self.graph = StepGraph(self.plan, self.cost, self.steps)
        low = self.graph.lower_bound(recompute, weak)
        return self.tokens / low if low > 0 else math.inf


class TopPlayed:
    """The most tokens/s of the plans simulated so far, kept per group: `keep[group]` of them
    (a search's `top` fastest, and the fastest of each placement). A candidate belongs to
    some groups; once it is slower than what each of them keeps, it cannot change what they
    keep, whatever the order of equals. `keep` None: every candidate is wanted."""

    def __init__(self, keep: dict | None):
        self.keep, self.heaps = keep, {g: [] for g in keep or ()}

    def full(self, groups) -> bool:
        """Whether every one of `groups` keeps all it keeps (before that, nothing is pruned)."""
        return self.keep is not None and all(len(self.heaps[g]) >= self.keep[g] for g in groups)

    def beaten(self, groups, upper: float) -> bool:
        """Whether a plan of at most `upper` tokens/s is slower than what each of `groups`
        keeps."""
        return self.full(groups) and all(upper < self.heaps[g][0] for g in groups)

    def prunes(self, groups, bounds: Bounds, recompute, weak: bool = False) -> bool:
        """Whether the plan of `bounds` with `recompute` is slower than what each of `groups`
        keeps (its bound, `weak` or not, is made only when they are full)."""
        return self.full(groups) and self.beaten(groups, bounds.upper(recompute, weak))

    def add(self, groups, tokens_per_s: float) -> None:
        for g in groups if self.keep is not None else ():
            heap = self.heaps[g]
            (heapq.heappushpop if len(heap) >= self.keep[g] else heapq.heappush)(
                heap, tokens_per_s)


__all__ = ["Bounds", "SLACK", "StepGraph", "TopPlayed", "step_lower_bound"]
