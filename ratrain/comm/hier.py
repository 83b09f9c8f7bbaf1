"""Hierarchical collectives: shared memory inside a node, one chain of messages per local rank
across nodes, shared memory again on the way back.

A `NodeGroup` is a communicator whose members are grouped by node: a *run* is a maximal
sequence of consecutive members (in rank order) on one node (with the usual packing, one run per
node). Each run stages its members' data in an MPI shared-memory window (`shm.Staging`); the
buffer is cut into `lanes` slices (lanes = the smallest run's size), and member c of every run
carries lane c between the runs. Data moves in rounds of one chunk per lane, so the shared
memory phases and the network overlap, and a window of `depth` rounds bounds the memory.

The order of reduction (`allreduce`, `reduce_scatter`) is a left fold over the communicator's
ranks in rank order, for every element:

    x[0] + x[1] + x[2] + ... + x[p-1]            (((x0 + x1) + x2) + ...), in the work dtype

whatever the grouping into nodes: lane c's partial of a chunk leaves run 0 as the fold of run
0's members, run j adds its members one by one in rank order to the partial it receives from
run j-1 and passes it on, and the last run holds the result, which goes back (all-reduce:
everything, back along the chain; reduce-scatter: each earlier run its members' segments,
directly from the last run). So a run is bitwise the same however its ranks are packed into
nodes, one node or one rank per node (`algos.reference(xs, "hier")` computes
it in one process). float16 is reduced in float32 and rounded once, on the way out; the
all-gather moves bytes only (prefixes forward along the chain, suffixes back).

Why a chain and not a ring across nodes: a ring's partials start at every node, so the order
would depend on where the node boundaries fall; the chain keeps one order and costs a ring's
traffic between two nodes (and at most twice a ring's, 2n against 2(R-1)/R n, at an interior
node of a long chain, a ratio that tends to 1 as nodes grow).

Cost (`comm.model.hier_terms`): inside a node each rank moves 2(L-1)/L n bytes (the fold of
its lane and the copy of the others'); the busiest node interface carries n for a reduce-scatter,
and for an all-reduce n between two nodes (a ring's traffic) and 2n at an interior node of a
longer chain (a ring's 2(R-1)/R n tends to the same); rounds overlap the two.

A one-node group's buffers kept in shared memory (`NodeGroup.shared_array`) are all-reduced in
place (`_InPlace`: each member folds its lane out of the others' buffers and into them).

    group = NodeGroup(comm, nodes_of_members)      # collective over comm (a window per run)
    run(hier_reduce_op(buf, group, tag=..., link=...))          # all-reduce in place
    seg = run(hier_reduce_op(buf, group, scatter=True))          # reduce-scatter: own segment
    run(hier_allgather_op(buf, group))                           # segment q from rank q to all
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .arrays import as_ufunc, flat, scratch, segments, work_dtype
from .model import HIER_DEPTH, hier_chunk_bytes, hier_depth, runs_of
from .progress import Scheduler, Task
from .shm import LocalStaging, SharedBuffers, Staging
from .wire import recv_op, send_op

DEPTH = HIER_DEPTH  # rounds in flight inside one node (model.hier_depth: more across nodes)


class NodeGroup:
    """`comm`'s members grouped by node (`nodes[q]`: the node of member q), with a staging
    window per run of `depth` rounds (`model.hier_depth`) of chunks sized for buffers of about
    `nbytes` (`model.hier_chunk_bytes`), unless given. Collective over `comm`; `free()` too."""

    def __init__(self, comm, nodes, chunk_bytes: int | None = None, depth: int | None = None,
                 nbytes: int = 1 << 20):
        p, r = comm.Get_size(), comm.Get_rank()
        if len(nodes) != p:
            raise ValueError(f"NodeGroup: {len(nodes)} node ids for a communicator of {p} ranks")
        self.comm, self.p, self.rank = comm, p, r
        self.runs = runs_of(list(nodes))
        self.run = next(j for j, (a, b) in enumerate(self.runs) if a <= r < b)
        a, b = self.runs[self.run]
        self.index, self.size = r - a, b - a
        self.lanes = min(b - a for a, b in self.runs)
        self.nodes = len(set(nodes))
        if depth is None:
            depth = hier_depth(len(self.runs))
        if chunk_bytes is None:
            chunk_bytes = hier_chunk_bytes(nbytes, self.lanes, len(self.runs))
        self.run_comm = comm.Split(self.run, r)  # collective over comm
        if self.size > 1:
            self.staging = Staging(self.run_comm, self.lanes, chunk_bytes, depth)
        else:
            self.staging = LocalStaging(self.lanes, chunk_bytes, depth)
        self._queue: deque = deque()  # collectives of this group, in submission order
        self._shared: list[tuple[SharedBuffers, np.ndarray]] = []

    def shared_array(self, n: int, dtype) -> np.ndarray:
        """An array of `n` elements of `dtype` in shared memory, one per member of this rank's
        run (collective over the run; freed with the group). An all-reduce of such arrays on a
        one-node group works in place: no staging, each member folding its lane straight out
        of the others' arrays and into them (`_InPlace`)."""
        dtype = np.dtype(dtype)
        bufs = SharedBuffers(self.run_comm, n * dtype.itemsize)
        arr = bufs.mine.view(dtype)
        self._shared.append((bufs, arr))
        return arr

    def shared_views(self, x: np.ndarray):
        """Every member's array of which `x` is this rank's (whole), or None."""
        for bufs, arr in self._shared:
            if x.dtype == arr.dtype and x.size == arr.size and \
                    x.__array_interface__["data"][0] == arr.__array_interface__["data"][0]:
                return [b.view(arr.dtype) for b in bufs.all], bufs
        return None

    def peer(self, run: int, lane: int) -> int:
        """The member that carries `lane` in `run`."""
        return self.runs[run][0] + lane

    def enter(self):
        """A place in line: collectives on one group run one after another (they share the
        staging's rounds), in submission order, which is the same on every member."""
        token = object()
        self._queue.append(token)
        return token

    def turn(self, token) -> bool:
        return self._queue[0] is token

    def leave(self, token) -> None:
        self._queue.remove(token)

    def free(self) -> None:
        for bufs, _ in self._shared:
            bufs.free()
        self.staging.free()
        self.run_comm.Free()

    def __repr__(self) -> str:
        return (f"NodeGroup({self.p} ranks in {len(self.runs)} runs on {self.nodes} nodes, "
                f"lanes {self.lanes}, member {self.index} of run {self.run})")


class _Parts:
    """The concurrent parts of one collective (copy in, lane, copy out, messages), driven as
    one operation: `spawn` adds a part; `drive()` yields until every part is done."""

    def __init__(self):
        self.sched = Scheduler()
        self.errors: list = []

    def spawn(self, op) -> list:
        """Start `op`; returns a box whose first item becomes True when it is done."""
        box = [False]
        self.sched.add(Task(op, lambda _v, box=box: box.__setitem__(0, True), self.errors.append))
        return box

    def drive(self):
        def poll():
            self.sched.poll()
            return bool(self.errors) or not self.sched.tasks

        while self.sched.tasks and not self.errors:
            yield poll
        if self.errors:
            raise self.errors[0]


def _done(boxes) -> bool:
    return all(b[0] for b in boxes)


class _Collective:
    """What the parts of one hierarchical collective share: the group, the rounds, the data."""

    def __init__(self, x, group, tag, link, dtype):
        st = group.staging
        self.x, self.g, self.st, self.tag, self.dtype = x, group, st, tag, np.dtype(dtype)
        self.comm = group.comm
        self.link = link
        self.intra = getattr(link, "intra", None)
        self.j, self.R = group.run, len(group.runs)
        self.i, self.L, self.C = group.index, group.size, group.lanes
        self.lane = self.i if self.i < self.C else None
        n = x.size
        self.lb = segments(n, self.C)
        self.S = st.chunk_bytes // self.dtype.itemsize  # elements of one lane's chunk
        longest = max(self.lb[c + 1] - self.lb[c] for c in range(self.C))
        self.K = max(1, -(-longest // self.S))  # rounds
        sb = segments(n, group.p)
        self.sb = sb
        self.starts = [sb[a] for a, _ in group.runs]
        self.ends = [sb[b] for _, b in group.runs]
        self.own = (sb[group.rank], sb[group.rank + 1])
        self.base = st.take(self.K)
        self.parts = _Parts()
        self.out_sends: dict[int, list] = {}  # output slot -> boxes of sends reading it

    def chunk(self, r: int, c: int) -> tuple[int, int]:
        """Elements [lo, hi) of lane c in round r (empty past the lane's end)."""
        end = self.lb[c + 1]
        lo = min(self.lb[c] + r * self.S, end)
        return lo, min(lo + self.S, end)

    # -- waiting on the other members ------------------------------------------------------

    def until(self, row, value: int):
        """Wait until every counter of `row` (a staging counter row) reaches `value`."""
        st = self.st

        def ok():
            st.fence()
            return int(row.min()) >= value

        if not ok():
            yield ok

    def wait(self, boxes):
        if not _done(boxes):
            yield lambda: _done(boxes)

    def out_free(self, g: int):
        """Wait until output slot g mod depth may be written for round g."""
        yield from self.until(self.st.read, g - self.st.depth + 1)
        yield from self.wait(self.out_sends.pop(g % self.st.depth, []))

    def pace(self, nbytes: float):
        """Under the link throttle, the intra-node level's time for `nbytes` of shared memory."""
        if self.intra is not None and nbytes > 0:
            yield self.intra.reserve(int(nbytes), after=None)

    def send(self, arr, peer) -> list:
        return self.parts.spawn(send_op(arr, peer, self.tag, self.comm, self.link, verb="hier"))

    def recv(self, arr, peer) -> list:
        return self.parts.spawn(recv_op(arr, peer, self.tag, self.comm, self.link, verb="hier"))

    # -- the members' parts ----------------------------------------------------------------

    def copy_in(self, lo_hi=None, skip=None):
        """Copy this member's data into its slots, round by round: the whole buffer, or only
        elements within `lo_hi` (the all-gather's own segment); not lane `skip` (its own lane,
        which it reads from its own buffer)."""
        st, x, i = self.st, self.x, self.i
        for r in range(self.K):
            g = self.base + r
            yield from self.until(st.consumed, g - st.depth + 1)
            dst = st.slot(i, g, self.dtype)
            for c in range(self.C):
                if c == skip:
                    continue
                lo, hi = self.chunk(r, c)
                a, b = (lo, hi) if lo_hi is None else (max(lo, lo_hi[0]), min(hi, lo_hi[1]))
                if a < b:
                    dst[c, a - lo : b - lo] = x[a:b]
            st.fence()
            st.filled[i] = g + 1

    def copy_out(self, lo_hi=None):
        """Copy the results out of the output slots, round by round (all, or within `lo_hi`)."""
        st, x, i = self.st, self.x, self.i
        share = (self.L - 1) / self.L
        for r in range(self.K):
            g = self.base + r
            yield from self.until(st.ready, g + 1)
            out = st.out(g, self.dtype)
            moved = 0
            for c in range(self.C):
                lo, hi = self.chunk(r, c)
                a, b = (lo, hi) if lo_hi is None else (max(lo, lo_hi[0]), min(hi, lo_hi[1]))
                if a < b:
                    x[a:b] = out[c, a - lo : b - lo]  # float16: rounded here, once
                    moved += b - a
            yield from self.pace(share * moved * x.itemsize)
            st.fence()
            st.read[i] = g + 1

    def drive(self, *parts):
        for part in parts:
            self.parts.spawn(part)
        yield from self.parts.drive()


class _Reduce(_Collective):
    """All-reduce (`scatter=False`) or reduce-scatter: the lane's fold forward, the results back."""

    def __init__(self, x, group, ufunc, tag, link, ledger, scatter):
        super().__init__(x, group, tag, link, work_dtype(x.dtype))
        self.ufunc, self.ledger, self.scatter = ufunc, ledger, scatter

    def results(self, j: int, lo: int, hi: int) -> tuple[int, int]:
        """The part of chunk [lo, hi) whose results run j needs: all of it for an all-reduce,
        its members' segments for a reduce-scatter."""
        if not self.scatter:
            return lo, hi
        return max(lo, self.starts[j]), max(lo, min(hi, self.ends[j]))

    def results_from(self, j: int) -> int:
        """The run that sends run j its results: the next one along the chain (all-reduce: the
        results travel back run by run), or the last one directly (reduce-scatter)."""
        return self.R - 1 if self.scatter else j + 1

    def results_to(self, j: int) -> list[int]:
        """The runs run j sends results to (see `results_from`)."""
        return [t for t in range(self.R - 1) if self.results_from(t) == j]

    def send_results(self, j: int, arr, lo: int, hi: int) -> list:
        """Send the runs that get their results from run j their part of chunk [lo, hi), from
        `arr` (the chunk's values)."""
        boxes = []
        for t in self.results_to(j):
            a, b = self.results(t, lo, hi)
            if b > a:
                boxes.append(self.send(arr[a - lo : b - lo], self.g.peer(t, self.lane)))
        return boxes

    def fold(self, g: int, lo: int, hi: int, acc, out) -> None:
        """out = the lane's chunk [lo, hi) of round g folded over this run's members in rank
        order, onto `acc` (the partial from the previous run; None in the first run). This
        member's own term comes from its own buffer, the others' from their slots."""
        st, c, m = self.st, self.lane, hi - lo
        terms = [self.x[lo:hi] if k == self.i else st.slot(k, g, out.dtype)[c, :m]
                 for k in range(self.L)]
        if acc is None:
            acc, terms = terms[0], terms[1:]
        if not terms:
            np.copyto(out, acc)
            return
        self.ufunc(acc, terms[0], out=out)  # (((acc + t0) + t1) + ...): a left fold
        for t in terms[1:]:
            self.ufunc(out, t, out=out)

    def forward(self, accs):
        """Lane c: receive round r's partial from the previous run, add this run's members in
        rank order, send it on; the last run folds into the output slot, publishes the result
        and sends the earlier runs theirs."""
        st, c, j, D = self.st, self.lane, self.j, self.st.depth
        last = j == self.R - 1
        free: list[list] = [[] for _ in range(D)]  # sends still reading acc buffer s
        recvs: dict[int, list] = {}
        posted = 0

        def post_ahead(r):
            nonlocal posted
            while posted < self.K and posted <= r + D - 1 and _done(free[posted % D]):
                lo, hi = self.chunk(posted, c)
                if j > 0 and hi > lo:
                    recvs[posted] = self.recv(accs[posted % D][: hi - lo], self.g.peer(j - 1, c))
                else:
                    recvs[posted] = [True]
                posted += 1

        for r in range(self.K):
            g, s = self.base + r, r % D
            lo, hi = self.chunk(r, c)
            m = hi - lo
            post_ahead(r)
            while posted <= r:
                yield lambda s=s: _done(free[s])
                post_ahead(r)
            yield from self.wait([recvs.pop(r)])
            yield from self.until(st.filled, g + 1)
            if last:
                yield from self.out_free(g)
            out = st.out(g, self.dtype)[c, :m] if last else accs[s][:m]
            self.fold(g, lo, hi, accs[s][:m] if j > 0 else None, out)
            yield from self.pace((self.L - 1) * m * out.itemsize)
            st.fence()
            st.consumed[c] = g + 1
            if not last:
                if m:
                    free[s] = [self.send(out, self.g.peer(j + 1, c))]
                continue
            st.ready[c] = g + 1  # a result, in the output slot
            self.out_sends.setdefault(g % D, []).extend(self.send_results(j, out, lo, hi))

    def backward(self):
        """Lane c of a run before the last: receive its results into the output slots (posted
        ahead while slots are free), pass on what the runs before it need (all-reduce)."""
        st, c, j, D = self.st, self.lane, self.j, self.st.depth
        recvs: dict[int, list] = {}
        posted = 0
        for r in range(self.K):
            while posted < self.K and posted <= r + D - 1:
                g2 = self.base + posted
                if posted > r:  # post ahead only into a slot that is free already
                    st.fence()
                    if int(st.read.min()) < g2 - D + 1 or not _done(self.out_sends.get(g2 % D, [])):
                        break
                yield from self.out_free(g2)
                lo, hi = self.chunk(posted, c)
                a, b = self.results(j, lo, hi)
                out = st.out(g2, self.dtype)[c, a - lo : b - lo]
                src = self.g.peer(self.results_from(j), c)
                recvs[posted] = self.recv(out, src) if b > a else [True]
                posted += 1
            g = self.base + r
            yield from self.wait([recvs.pop(r)])
            st.fence()
            st.ready[c] = g + 1
            lo, hi = self.chunk(r, c)
            boxes = self.send_results(j, st.out(g, self.dtype)[c], lo, hi)
            self.out_sends.setdefault(g % D, []).extend(boxes)

    def run(self):
        parts = [self.copy_in(skip=self.lane), self.copy_out(self.own if self.scatter else None)]
        if self.lane is None:
            yield from self.drive(*parts)
            return
        D = self.st.depth
        with scratch(self.ledger, "comm.hier", D * self.S, self.dtype) as acc:
            accs = [acc[s * self.S : (s + 1) * self.S] for s in range(D)]
            parts.append(self.forward(accs))
            if self.j < self.R - 1:
                parts.append(self.backward())
            yield from self.drive(*parts)


class _Gather(_Collective):
    """All-gather: member q's segment to every member; runs pass prefixes forward and
    suffixes back (bytes only, no arithmetic)."""

    def lane_part(self):
        st, c, j, D = self.st, self.lane, self.j, self.st.depth
        run0, run1 = self.g.runs[j]
        for r in range(self.K):
            g = self.base + r
            lo, hi = self.chunk(r, c)
            yield from self.out_free(g)
            out = st.out(g, self.dtype)[c]
            pre, suf = (lo, min(hi, self.starts[j])), (max(lo, self.ends[j]), hi)
            got_pre, got_suf = [True], [True]
            if j > 0 and pre[1] > pre[0]:
                got_pre = self.recv(out[: pre[1] - lo], self.g.peer(j - 1, c))
            if j < self.R - 1 and suf[1] > suf[0]:
                got_suf = self.recv(out[suf[0] - lo : hi - lo], self.g.peer(j + 1, c))
            yield from self.until(st.filled, g + 1)
            moved = 0
            for k in range(run1 - run0):  # this run's members' segments, from their slots
                a, b = max(lo, self.sb[run0 + k]), min(hi, self.sb[run0 + k + 1])
                if a < b:
                    out[a - lo : b - lo] = st.slot(k, g, self.dtype)[c, a - lo : b - lo]
                    moved += b - a
            yield from self.pace((self.L - 1) / self.L * moved * self.dtype.itemsize)
            st.fence()
            st.consumed[c] = g + 1
            sends = []  # forward once the prefix is in, back once the suffix is (two chains)
            yield from self.wait([got_pre])
            fwd = min(hi, self.ends[j]) - lo
            if j < self.R - 1 and fwd > 0:
                sends.append(self.send(out[:fwd], self.g.peer(j + 1, c)))
            yield from self.wait([got_suf])
            bwd = max(lo, self.starts[j])
            if j > 0 and hi > bwd:
                sends.append(self.send(out[bwd - lo : hi - lo], self.g.peer(j - 1, c)))
            self.out_sends[g % D] = sends
            st.fence()
            st.ready[c] = g + 1

    def run(self):
        parts = [self.copy_in(self.own), self.copy_out()]
        if self.lane is not None:
            parts.append(self.lane_part())
        yield from self.drive(*parts)


class _InPlace:
    """All-reduce of a one-node group's shared arrays (`NodeGroup.shared_array`) in place: once
    every member's input is in, member c folds lane c over the members in rank order, a chunk at
    a time into a private scratch, and writes the result into every member's array; then every
    member waits for every lane. Each rank reads n and writes n bytes (the staged path: about
    4.75 n), the same order of reduction."""

    def __init__(self, x, group, ufunc, link, ledger, views, bufs):
        self.x, self.g, self.ufunc, self.ledger = x, group, ufunc, ledger
        self.views, self.bufs = views, bufs
        self.intra = getattr(link, "intra", None)

    def run(self):
        g, x = self.g, self.x
        wd = work_dtype(x.dtype)
        lo, hi = segments(x.size, g.size)[g.index : g.index + 2]
        step = max(1, (1 << 20) // wd.itemsize)
        yield [g.run_comm.Ibarrier()]  # every member's input is in its array
        self.bufs.fence()
        with scratch(self.ledger, "comm.hier", min(step, max(hi - lo, 1)), wd) as tmp:
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                t = tmp[: b - a]
                np.copyto(t, self.views[0][a:b])  # in the work dtype (float32 for float16)
                for v in self.views[1:]:
                    self.ufunc(t, v[a:b], out=t)  # x0 + x1 + ...: a left fold
                for v in self.views:
                    v[a:b] = t  # float16: rounded here, once
        if self.intra is not None:  # what the staged path's pacing charges
            yield self.intra.reserve(int(2 * (g.size - 1) / g.size * x.nbytes), after=None)
        self.bufs.fence()
        yield [g.run_comm.Ibarrier()]  # every lane is written
        self.bufs.fence()


def _in_turn(group, body):
    """Run the collective made by `body()` when the group's earlier collectives are done."""
    token = group.enter()
    try:
        if not group.turn(token):
            yield lambda: group.turn(token)
        yield from body().run()
    finally:
        group.leave(token)


def hier_reduce_op(buf, group, op="sum", tag=0, link=None, ledger=None, scatter=False):
    """All-reduce `buf` in place over `group.comm` (returns `buf`), or with `scatter=True`
    reduce-scatter it (returns the view of this rank's segment, `segments(n, p)`; the rest of
    `buf` is scratch afterwards), in the documented order."""
    x = flat(buf)
    ufunc = as_ufunc(op)
    lo, hi = segments(x.size, group.p)[group.rank : group.rank + 2]
    shared = group.shared_views(x) if len(group.runs) == 1 and not scatter else None
    if group.p > 1 and x.size and shared is not None:  # one node, arrays in shared memory
        yield from _in_turn(group, lambda: _InPlace(x, group, ufunc, link, ledger, *shared))
    elif group.p > 1 and x.size:
        yield from _in_turn(group, lambda: _Reduce(x, group, ufunc, tag, link, ledger, scatter))
    return x[lo:hi] if scatter else buf


def hier_allgather_op(buf, group, tag=0, link=None):
    """Fill `buf` in place with every member's segment (member q contributes
    `segments(n, p)[q:q+2]`); returns `buf`."""
    x = flat(buf)
    if group.p > 1 and x.size:
        yield from _in_turn(group, lambda: _Gather(x, group, tag, link, x.dtype))
    return buf


def _need(group, what: str):
    if group is None:
        raise ValueError(f"{what} with algo='hier' needs the communicator's NodeGroup (group=; "
                         "Topology.group(comm) or hier.NodeGroup(comm, nodes))")
    return group


# the registry's signatures (`algos`): the group is the communicator's

def allreduce_op(buf, comm, op="sum", tag=0, link=None, ledger=None, group=None):
    return hier_reduce_op(buf, _need(group, "allreduce"), op, tag, link, ledger)


def reduce_scatter_op(buf, comm, op="sum", tag=0, link=None, ledger=None, group=None):
    return hier_reduce_op(buf, _need(group, "reduce_scatter"), op, tag, link, ledger,
                          scatter=True)


def allgather_op(buf, comm, tag=0, link=None, group=None):
    return hier_allgather_op(buf, _need(group, "allgather"), tag, link)


__all__ = ["DEPTH", "NodeGroup", "allgather_op", "allreduce_op", "hier_allgather_op",
           "hier_reduce_op", "reduce_scatter_op"]
