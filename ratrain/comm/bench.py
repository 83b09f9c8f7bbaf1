"""Communication benchmark: `python -m ratrain.comm.bench --op allreduce --algo ring,mpi ...`

Under `mpirun -n P`. Prints one JSON object per line (rank 0) per (op, algo, size):

    op, algo, ranks, bytes, dtype, iters, time_s (median over iterations of the slowest rank;
    each rank times from a barrier to the end of its op, and the ranks meet again before the
    next iteration's untimed set-up),
    time_min_s, algbw_GBps, busbw_GBps (from time_s), busbw_best_GBps (from time_min_s), ok,
    max_abs_err, identical (same bytes on every rank), model_s (with --link)

Bandwidths follow nccl-tests: algbw = bytes / time; busbw = algbw x 2(p-1)/p for all-reduce,
x (p-1)/p for reduce-scatter and all-gather (bytes = the whole buffer), x 1 for broadcast and the
point-to-point tests. Several algorithms (`--algo ring,tree,mpi`) are interleaved iteration by
iteration, so they see the same machine noise. Every result is checked exactly against the sum
of the known inputs (small integers, exact in every dtype).

Point-to-point ops: `sendrecv` (every rank sends to rank+1 and receives from rank-1),
`pingpong` (ranks 0 and 1, time_s = half the round trip, like osu_latency), `stream` (rank 0
sends `--window` messages back to back to rank 1, which acknowledges; like osu_bw).
`--link` runs through the shim's throttle (`--bandwidth`, `--latency`, `--time-scale`, or the
values of `--profile`) in two levels: `--bandwidth` / `--latency` are a node's interface (shared by
its ranks), `--intra-bandwidth` / `--intra-latency` the path inside a node (default: free);
`--engine` submits through the CommEngine thread.

`--algo` names algorithms of the registry (`comm.algos`), or `auto`, the registry's rule: `hier`
here, as the runtime's topology groups every communicator by node (`algos.choose`). An
algorithm without the op (the tree has no reduce-scatter) is refused; `--op bcast` runs the
binomial tree, or MPI's with `mpi`. `--log-messages` prints every message (the config's
`comm.log_messages`; debug only).

`--algo hier` is the hierarchical algorithm (`comm.hier`) over the nodes the ranks are on (MPI's
shared-memory split and processor names; `--ranks-per-node K` cuts a host into nodes of K
ranks; with `--link`, every rank is its own node unless `--ranks-per-node` says otherwise).
`--shared` keeps the buffers in the node's shared memory (`NodeGroup.shared_array`), where
the hierarchical all-reduce of a one-node group works in place (without it, what the runtime's
gradients do: copied through the staging window). `--model` prints `model_s`, the two-level
model's time (the algorithm's terms, `comm.model`) over the ranks' nodes, from the rates given,
for a run that is not throttled (real nodes: scripts/cluster.sh); with `--link` it is always
there.
Every record names `nodes` x `ranks_per_node`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib

import numpy as np
from mpi4py import MPI

from ratrain.shim import allocator
from ratrain.shim.link import Levels, Link
from ratrain.shim.platform import load_profile

from . import algos
from . import collectives as coll
from . import model as cost
from .engine import CommEngine
from .progress import run, run_all
from .shm import SharedSlots
from .topology import NodeLinks, Topology, teardown
from .wire import exchange_op, log_messages, recv_op, send_op

OPS = ("allreduce", "reduce_scatter", "allgather", "bcast", "sendrecv", "pingpong", "stream")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("B").rstrip("I")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    return int(float(s[: len(s) - len(unit)]) * _UNITS[unit])


def sizes_from(spec: str, factor: int) -> list[int]:
    if ":" not in spec:
        return [parse_size(v) for v in spec.split(",")]
    lo, hi = (parse_size(v) for v in spec.split(":"))
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= factor
    return out


def pattern(rank: int, n: int, dtype) -> np.ndarray:
    """Rank `rank`'s input: small integers, so every sum is exact in every dtype."""
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 3) % 13) - 6).astype(dtype)


def busbw_factor(op: str, p: int) -> float:
    if op == "allreduce":
        return 2 * (p - 1) / p
    if op in ("reduce_scatter", "allgather"):
        return (p - 1) / p
    return 1.0


def _args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ratrain.comm.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="allreduce", choices=OPS,
                    help="collective or point-to-point test (default allreduce)")
    ap.add_argument("--algo", default="ring",
                    help=f"{'|'.join(algos.names())}|auto, or several: hier,ring,mpi")
    ap.add_argument("--sizes", default="8:256M", help="MIN:MAX (x --factor) or a list 8,64M")
    ap.add_argument("--factor", type=int, default=4,
                    help="size step between MIN and MAX of --sizes (default 4)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "float64"),
                    help="element type of the buffers (default float32)")
    ap.add_argument("--iters", type=int, default=10,
                    help="timed iterations per size (default 10; time_s is their median)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed iterations per size first (default 2)")
    ap.add_argument("--link", action="store_true", help="run through the shim's link throttle")
    ap.add_argument("--bandwidth", type=float, default=None, help="link B/s (default: profile's)")
    ap.add_argument("--latency", type=float, default=None, help="link s/message (default: profile's)")
    ap.add_argument("--intra-bandwidth", type=float, default=None,
                    help="B/s inside a node (default: the profile's with --profile, else free)")
    ap.add_argument("--intra-latency", type=float, default=None, help="s/message inside a node")
    ap.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                    help="cut each host's ranks into nodes of K")
    ap.add_argument("--model", action="store_true",
                    help="print the two-level model's time from the rates given (no throttle)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="--link: emulated time = platform time x this (default 1)")
    ap.add_argument("--profile", default="mt3000",
                    help="--link: platform profile whose link values are the defaults (mt3000)")
    ap.add_argument("--chunk-bytes", type=int, default=None,
                    help="--link: bytes per throttled chunk (default: about 1 ms of wire)")
    ap.add_argument("--allow-one-rank", action="store_true",
                    help="run on a single rank anyway (no communication: only for testing)")
    ap.add_argument("--engine", action="store_true", help="submit through the CommEngine thread")
    ap.add_argument("--shared", action="store_true",
                    help="keep the buffers in the node's shared memory (NodeGroup.shared_array): "
                    "hier then all-reduces one node's buffers in place; every algorithm uses them")
    ap.add_argument("--window", type=int, default=64, help="messages per window for --op stream")
    ap.add_argument("--log-messages", action="store_true",
                    help="print every message to stderr (debug only: slow; comm.log_messages)")
    a = ap.parse_args(argv)
    a.algos = a.algo.split(",")
    if a.op in ("sendrecv", "pingpong", "stream"):
        a.algos = ["p2p"]  # point to point: no algorithm to choose
    for algo in a.algos:
        if algo not in algos.names() + ("auto", "p2p"):
            ap.error(f"--algo {algo!r} is not one of {', '.join(algos.names())}, auto")
        if algo == "mpi" and (a.link or a.engine):
            ap.error("--algo mpi is MPI's own collective: it cannot run with --link or --engine")
        if a.op in cost.OPS and algo != "auto" and not algos.get(algo).has(a.op):
            ap.error(f"--algo {algo}: it has no {a.op}; use one of "
                     f"{', '.join(algos.names(a.op))}, auto")
        if a.op == "bcast" and algo not in ("tree", "mpi"):
            ap.error(f"--algo {algo}: the broadcast is the binomial tree (tree) or MPI's (mpi)")
    if a.ranks_per_node is not None and a.ranks_per_node < 1:
        ap.error("--ranks-per-node must be >= 1")
    if a.model and not (a.link or a.bandwidth):
        ap.error("--model needs the rates: --bandwidth (and --latency, --intra-bandwidth, ...)")
    try:
        a.size_list = sizes_from(a.sizes, a.factor)
    except ValueError:
        ap.error(f"--sizes {a.sizes!r}: expected MIN:MAX or a list, e.g. 8:256M or 8,64M")
    if a.iters < 1 or a.warmup < 0 or a.factor < 2:
        ap.error("--iters >= 1, --warmup >= 0, --factor >= 2")
    return a


def rates(a) -> dict:
    """The two link levels' rates (B/s, s) from the arguments and `--profile`."""
    prof = load_profile(a.profile)
    bw = a.bandwidth if a.bandwidth is not None else prof.link_bandwidth
    if not bw:
        raise SystemExit(f"--link: profile {a.profile!r} has no link bandwidth; pass --bandwidth")
    given = a.bandwidth is not None  # explicit rates: the profile's intra level is not implied
    intra = a.intra_bandwidth if a.intra_bandwidth is not None else (
        None if given else prof.intra_bandwidth)
    return {"bandwidth": bw,
            "latency": a.latency if a.latency is not None else (prof.link_latency or 0.0),
            "intra_bandwidth": intra or math.inf,
            "intra_latency": a.intra_latency if a.intra_latency is not None else (
                0.0 if given else prof.intra_latency or 0.0)}


def open_topology(a, comm, nbytes: int):
    """(topology, links, slots): the ranks' nodes (for `hier` and the two-level throttle),
    with --link the two levels and the interfaces' shared slot books."""
    per_node = a.ranks_per_node if a.ranks_per_node or not a.link else 1
    topo = Topology(comm, 1, comm.Get_size(), "pp", per_node, shm_bytes=nbytes)
    if not a.link:
        return topo, None, None
    r = rates(a)
    slots = SharedSlots(topo.node_comm)
    inter = Link(r["bandwidth"], r["latency"], a.time_scale, a.chunk_bytes or None, shared=slots)
    intra = Link(r["intra_bandwidth"], r["intra_latency"], a.time_scale, inter.chunk_bytes)
    return topo, NodeLinks(Levels(intra, inter), topo), slots


class Runner:
    """Runs one iteration of an op; checks the last result."""

    def __init__(self, a, comm, link, engine, group=None):
        self.a, self.comm, self.link, self.engine, self.group = a, comm, link, engine, group
        self.p, self.r = comm.Get_size(), comm.Get_rank()
        self.tags = 0

    def _drive(self, op):
        if self.engine is not None:
            return self.engine.submit(lambda: op, name=self.a.op).result()
        return run(op, coll.LINK_POLL_S if self.link is not None else None)

    def setup(self, nbytes, dtype):
        p, r = self.p, self.r
        n = max(1, nbytes // np.dtype(dtype).itemsize)
        self.n, self.dtype = n, np.dtype(dtype)
        op = self.a.op
        if op in ("allreduce", "reduce_scatter"):
            self.init = pattern(r, n, dtype)
            self.expect = sum(pattern(q, n, np.float64) for q in range(p)).astype(dtype)
        elif op == "allgather":
            b = coll.segments(n, p)
            self.init = np.zeros(n, dtype)
            self.init[b[r]:b[r + 1]] = pattern(r, n, dtype)[b[r]:b[r + 1]]
            self.expect = np.concatenate([pattern(q, n, dtype)[b[q]:b[q + 1]] for q in range(p)])
        elif op == "bcast":
            self.init = pattern(0, n, dtype) if r == 0 else np.zeros(n, dtype)
            self.expect = pattern(0, n, dtype)
        else:  # point to point
            self.init = pattern(r, n, dtype)
            self.expect = pattern((r - 1) % p if op == "sendrecv" else 0, n, dtype)
        if self.a.shared:  # the same shared buffer for every algorithm of this size
            self.buf = self.group.shared_array(n, dtype)
            np.copyto(self.buf, self.init)
        else:
            self.buf = self.init.copy()
        self.out = np.zeros(n, dtype)

    def reset(self):
        np.copyto(self.buf, self.init)

    def once(self, algo):
        a, c, link = self.a, self.comm, self.link
        op, p, r = a.op, self.p, self.r
        g = self.group
        if op == "allreduce":
            if self.engine is not None:
                self.engine.submit(coll.allreduce_op, self.buf, c, algo, "sum", coll.COLL_TAG,
                                   link, None, g).result()
            else:
                coll.allreduce(self.buf, c, algo, link=link, group=g)
            self.result = self.buf
        elif op == "reduce_scatter":
            self.result = coll.reduce_scatter(self.buf, c, algo=algo, link=link, group=g)
            b = coll.segments(self.n, p)
            self.expect_view = self.expect[b[r]:b[r + 1]]
        elif op == "allgather":
            coll.allgather(self.buf, c, algo=algo, link=link, group=g)
            self.result = self.buf
        elif op == "bcast":
            coll.bcast(self.buf, c, 0, algo="mpi" if algo == "mpi" else "tree", link=link)
            self.result = self.buf
        elif op == "sendrecv":
            self._drive(exchange_op(self.buf, (r + 1) % p, self.out, (r - 1) % p, 7, c, link))
            self.result = self.out
        elif op == "pingpong":
            if r == 0:
                self._drive(send_op(self.buf, 1, 7, c, link))
                self._drive(recv_op(self.out, 1, 7, c, link))
            elif r == 1:
                self._drive(recv_op(self.out, 0, 7, c, link))
                self._drive(send_op(self.out, 0, 7, c, link))
            self.result = self.out if r < 2 else self.init
        elif op == "stream":
            w = a.window
            ack = np.zeros(1, np.uint8)
            poll = coll.LINK_POLL_S if link is not None else 1e-6
            if r == 0:
                run_all([send_op(self.buf, 1, 8, c, link) for _ in range(w)], poll)
                run(recv_op(ack, 1, 9, c, link), poll)
                self.result = self.init
            elif r == 1:
                # one receive buffer for the whole window, as osu_bw does (no page faults timed)
                run_all([recv_op(self.out, 0, 8, c, link) for _ in range(w)], poll)
                run(send_op(ack, 0, 9, c, link), poll)
                self.result = self.out
            else:
                self.result = self.init

    def check(self):
        res, exp = self.result, self.expect
        if self.a.op == "reduce_scatter":
            exp = self.expect_view
        if self.a.op in ("stream", "pingpong") and self.r > 1:  # not taking part
            res, exp = self.init, self.init
        err = float(np.max(np.abs(res.astype(np.float64) - exp.astype(np.float64)))) if res.size else 0.0
        digest = zlib.crc32(np.ascontiguousarray(self.result).view(np.uint8))
        return err, digest


def _measure(runner, a, comm):
    """Interleaved iterations of every algorithm at the runner's size: ({algo: [seconds]},
    {algo: (max error, digest)} of the last iteration)."""
    times = {algo: [] for algo in a.algos}
    checks = {}
    for it in range(a.warmup + a.iters):
        for algo in a.algos:
            runner.reset()
            comm.Barrier()
            t0 = time.perf_counter()
            runner.once(algo)
            dt = time.perf_counter() - t0
            # a rank that is done waits for the others before its untimed work (the next
            # reset, a copy of the whole buffer), which would otherwise take a core from a
            # rank still in its timed op where ranks outnumber cores
            comm.Barrier()
            if it >= a.warmup:
                times[algo].append(dt)
            if it == a.warmup + a.iters - 1:
                checks[algo] = runner.check()
    return times, checks


def _model_s(a, algo, nb, p, rt, group, link) -> float:
    """What the link model says the op should take (emulated rates: the link's x time_scale):
    a collective by its algorithm's terms (`auto` chosen as `collectives` chooses) over the
    nodes of `group` (the NodeGroup: its runs and lanes). `rt`: the levels' rates."""
    ts = a.time_scale if a.link else 1.0
    bw, lat = rt["bandwidth"] / ts, rt["latency"] * ts
    if a.op in cost.OPS:
        name = algo if algo != "auto" else coll.choose_algo(nb, p, link, group, op=a.op)
        links = cost.Links(rt["intra_latency"] * ts, rt["intra_bandwidth"] / ts, lat, bw)
        nodes, local = len(group.runs), group.lanes
        chunk = group.staging.chunk_bytes if name == "hier" else None

        def alone(nbytes):
            terms = algos.get(name).terms(a.op, nbytes, nodes, local, links, chunk)
            return cost.alone(terms, links)

        if a.dtype != "float16" or a.op == "allgather":
            return alone(nb)
        if name == "ring" and a.op == "allreduce":  # partials in float32, the gather in float16
            return (alone(nb) + alone(2 * nb)) / 2
        return alone(2 * nb)  # partial sums travel as float32
    if a.op in ("pingpong", "sendrecv"):
        return lat + nb / bw
    if a.op == "stream":
        return nb / bw + lat / a.window
    return math.nan


def _record(a, algo, p, nb, t, errs, digests, link, topo) -> dict:
    """One output line (see the module) from the slowest rank's iteration times `t`."""
    med, best = float(np.median(t)), float(np.min(t))
    sizes = [topo.node_of.count(n) for n in range(topo.nodes)]
    rec = {
        "op": a.op, "algo": algo, "ranks": p, "bytes": nb, "dtype": a.dtype,
        "iters": a.iters, "time_s": med, "time_min_s": best,
        "algbw_GBps": nb / med / 1e9, "busbw_GBps": nb / med / 1e9 * busbw_factor(a.op, p),
        "busbw_best_GBps": nb / best / 1e9 * busbw_factor(a.op, p),
        "ok": max(errs) == 0.0, "max_abs_err": max(errs),
        "nodes": topo.nodes, "ranks_per_node": max(sizes),
    }
    if a.op in ("allreduce", "allgather", "bcast"):
        rec["identical"] = len(set(digests)) == 1
    if link is not None or a.model:
        rt = rates(a)
        if algo != "mpi" and a.op != "bcast":
            rec["model_s"] = _model_s(a, algo, nb, p, rt, topo.dp_group, link)
        rec["link"] = {**rt, "time_scale": a.time_scale if link is not None else 1.0,
                       "throttled": link is not None}
        if link is not None:
            rec["link"]["chunk_bytes"] = link.chunk_bytes
    if a.engine:
        rec["engine"] = True
    return rec


def main(argv=None) -> int:
    a = _args(argv)
    allocator.tune()  # the process keeps freed memory, as python -m ratrain.train does
    comm = MPI.COMM_WORLD
    p, r = comm.Get_size(), comm.Get_rank()
    if p < 2 and not a.allow_one_rank:
        print("error: one rank: nothing to communicate (a collective on one rank moves no bytes); "
              "launch it with mpirun -n 2 or more, e.g. mpirun -n 4 python -m ratrain.comm.bench "
              f"--op {a.op}", file=sys.stderr)
        return 2
    if a.op in ("pingpong", "stream") and p < 2:
        if r == 0:
            print(f"--op {a.op} needs at least 2 ranks", file=sys.stderr)
        return 2
    log_messages(a.log_messages)
    topo, link, slots = open_topology(a, comm, max(a.size_list))
    engine = CommEngine(comm, watchdog_s=600, link=link) if a.engine else None
    runner = Runner(a, comm, link, engine, topo.dp_group)
    try:
        for nbytes in a.size_list:
            runner.setup(nbytes, a.dtype)
            times, checks = _measure(runner, a, comm)
            for algo in a.algos:
                t = np.array(times[algo])
                comm.Allreduce(MPI.IN_PLACE, t, MPI.MAX)  # each iteration: the slowest rank
                if a.op == "pingpong":
                    t = t / 2
                if a.op == "stream":
                    t = t / a.window
                err, digest = checks[algo]
                errs, digests = comm.gather(err, 0), comm.gather(digest, 0)
                if r == 0:
                    nb = runner.n * runner.dtype.itemsize
                    print(json.dumps(_record(a, algo, p, nb, t, errs, digests, link, topo)),
                          flush=True)
    finally:
        teardown(engine, slots, topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
