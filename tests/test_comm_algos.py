"""The registry of collective algorithms (`comm.algos`): one entry per algorithm (operations,
reference order, cost terms), one rule that the runtime and the planner share, an algorithm
registered from outside the package that runs a training step, and a message log that never
changes the path a collective takes."""

import functools
import json
import os
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from ratrain.comm import algos, model, wire
from ratrain.comm import collectives as C
from ratrain.comm.arrays import as_ufunc, work_dtype
from ratrain.comm.engine import CommEngine
from ratrain.comm.topology import Topology
from ratrain.comm.wire import recv_op, send_op
from ratrain.config import CommConfig, ConfigError, load_config
from ratrain.plan.__main__ import main as plan_main
from ratrain.plan.cost import CostModel, Rates
from ratrain.shim.ledger import Ledger
from ratrain.shim.link import Link
from ratrain.train import main
from tests._mpi_job import tiny_job

COMM = MPI.COMM_WORLD

# -- a toy algorithm, registered from outside the package ------------------------------------
# Every rank sends its buffer to rank 0, which folds them in reverse rank order
# (x[p-1] + x[p-2] + ... + x[0]) and sends the result back. Nothing of ratrain is edited: the
# test touches only the registry.

CALLS = []  # the sizes the toy all-reduced in this process


def toy_allreduce_op(buf, comm, op="sum", tag=0, link=None, ledger=None, group=None):
    x = buf.reshape(-1)
    ufunc, p, r = as_ufunc(op), comm.Get_size(), comm.Get_rank()
    CALLS.append(x.size)
    w = x.astype(work_dtype(x.dtype))
    if r == 0:
        parts = [w] + [np.empty_like(w) for _ in range(1, p)]
        for q in range(1, p):
            yield from recv_op(parts[q], q, tag, comm, link, verb="toy.in")
        w[:] = toy_order(parts, ufunc)
        for q in range(1, p):
            yield from send_op(w, q, tag, comm, link, verb="toy.out")
    else:
        yield from send_op(w, 0, tag, comm, link, verb="toy.in")
        yield from recv_op(w, 0, tag, comm, link, verb="toy.out")
    x[:] = w
    return buf


def toy_order(xs, ufunc):
    return functools.reduce(ufunc, reversed(xs[:-1]), xs[-1].copy())


def toy_terms(op, nbytes, nodes, local, links, chunk_bytes=None):
    p = nodes * local
    return 2 * (p - 1) * links.net_latency, 0.0, 2 * (p - 1) * nbytes


@pytest.fixture
def toy():
    a = algos.register(algos.Algorithm("toy", toy_allreduce_op, toy_order, toy_terms))
    CALLS.clear()
    yield a
    algos.unregister("toy")


# -- single process ----------------------------------------------------------------------------


def test_each_algorithm_is_one_entry(toy):
    assert algos.names() == ("ring", "tree", "hier", "mpi", "toy")
    assert algos.names("reduce_scatter", runtime=True) == ("ring", "hier")
    assert algos.names(runtime=False) == ("mpi",)
    with pytest.raises(ValueError, match="'toy' is registered already"):
        algos.register(toy)
    with pytest.raises(ValueError, match="needs its reference order and its cost terms"):
        algos.register(algos.Algorithm("bare", toy_allreduce_op, None, toy_terms))
    with pytest.raises(ValueError, match=r"algo='nope' is not one of auto, ring, tree, hier"):
        algos.get("nope")
    with pytest.raises(ValueError, match="algo='toy' has no reduce_scatter: use one of ring, "):
        algos.get("toy").op("reduce_scatter")
    xs = [np.random.default_rng(q).standard_normal(7).astype(np.float16) for q in range(3)]
    want = ((xs[2].astype(np.float32) + xs[1]) + xs[0]).astype(np.float16)
    assert algos.reference(xs, "toy").tobytes() == want.tobytes()  # fp16: reduced in fp32
    with pytest.raises(ValueError, match="no reference order for algo='mpi'"):
        algos.reference(xs, "mpi")


def test_the_rule():
    """`choose`: the configured all-reduce, else hier for a group by node, else the cheapest."""
    rule = functools.partial(algos.choose, latency=20e-6, bandwidth=1e9)
    assert rule("allreduce", 8, 8, grouped=True) == "hier"
    assert rule("allreduce", 8, 8, grouped=False) == "tree"
    assert rule("allreduce", 64 << 20, 8, grouped=False) == "ring"
    assert rule("allreduce", 64 << 20, 2, grouped=False) == "tree"  # same bytes, fewer steps
    assert rule("allreduce", 8, 8, grouped=True, configured="ring") == "ring"
    for op in ("reduce_scatter", "allgather"):  # comm.allreduce names the all-reduce only
        assert rule(op, 8, 8, grouped=True, configured="tree") == "hier"
        assert rule(op, 8, 8, grouped=False, configured="tree") == "ring"
    # the runtime's side: a link's emulated rates, a NodeGroup or none
    assert C.choose_algo(1 << 20, 8, Link(1e9, 1e-3)) == "tree"
    assert C.choose_algo(1 << 20, 8, group=object()) == "hier"
    assert C.choose_algo(8, 8, group=object(), configured="ring") == "ring"


def test_the_planner_prices_what_the_runtime_runs(toy):
    """The planner's data-parallel group is grouped by node: auto prices hier (the runtime's
    choice there), a configured all-reduce prices that algorithm; its reduce-scatter and
    all-gather stay hier."""
    cfg = load_config("jobs/llama2-7b.yaml")
    cost = CostModel.from_config(cfg, Rates(1e12, 2.5e10, 5e-6, intra_bandwidth=2.56e10,
                                            intra_latency=1e-6, ranks_per_node=4))
    links, n = cost.links, 64 << 20
    for op in ("allreduce", "reduce_scatter", "allgather"):
        assert cost.collective_terms(op, n, 8, 4) == model.hier_terms(op, n, 8, 4, links)
    for name, terms in (("ring", model.ring_terms), ("tree", model.tree_terms),
                        ("toy", toy_terms)):
        named = CostModel.from_config(replace(cfg, comm=CommConfig(allreduce=name)), cost.rates)
        assert named.algo == name
        assert named.collective_terms("allreduce", n, 8, 4) == terms("allreduce", n, 8, 4, links)
        assert named.collective_terms("allgather", n, 8, 4) == model.hier_terms(
            "allgather", n, 8, 4, links)
        assert named.collective_time("allreduce", n, 8, 4) == model.alone(
            terms("allreduce", n, 8, 4, links), links)


def test_terms_on_two_levels_reduce_to_the_flat_formulas():
    a, B, n = 20e-6, 1e9, 3 << 20
    flat = model.Links.flat(a, B)
    for p in range(2, 10):
        m = 1 << (p.bit_length() - 1)
        steps = (m.bit_length() - 1) + 2 * (p > m)
        assert model.tree_terms("allreduce", n, p, 1, flat) == pytest.approx(
            (steps * a, 0.0, steps * n))
        assert model.ring_terms("allreduce", n, p, 1, flat) == pytest.approx(
            (2 * (p - 1) * a, 0.0, 2 * (p - 1) * n / p))
        one = model.ring_terms("reduce_scatter", n, 1, p, flat)  # one node: no interface
        assert one == pytest.approx(((p - 1) * a, (p - 1) * n / p, 0.0))
    two = model.Links(1e-6, 1e10, 5e-6, 1e9)
    # 2 nodes of 4: exchanges 1 and 2 inside a node, 4 across (every rank of a node crosses)
    assert model.tree_terms("allreduce", n, 2, 4, two) == pytest.approx((2e-6 + 5e-6, 2 * n, 4 * n))
    # the ring: each of its 14 steps crosses the interface once per node boundary
    assert model.ring_terms("allreduce", n, 2, 4, two) == pytest.approx((14 * 5e-6, 14 * n / 8,
                                                                         14 * n / 8))
    with pytest.raises(ValueError, match="there is no tree reduce_scatter"):
        model.tree_terms("reduce_scatter", n, 2, 4, two)


def test_an_unknown_algorithm_is_refused_at_start_up(tmp_path_factory, capsys):
    job = tiny_job(MPI.COMM_SELF, tmp_path_factory)
    with pytest.raises(ConfigError, match=r"^comm.allreduce='mpi' is not one of: auto, ring, "):
        algos.check_choice("mpi")  # MPI's own: a reference, never the runtime's
    rc = main(["--config", f"{job}/job.yaml", "--set", "comm.allreduce=butterfly",
               "--set", f"run.dir={job}/bad"])
    assert rc == 2
    err = capsys.readouterr().err
    assert ("comm.allreduce='butterfly' is not one of: auto, ring, tree, hier (registered in "
            "ratrain.comm.algos)") in err
    assert not os.path.exists(f"{job}/bad")
    assert plan_main(["--config", "jobs/tiny.yaml", "--set", "comm.allreduce=butterfly"]) == 2
    assert "comm.allreduce='butterfly' is not one of" in capsys.readouterr().err  # the planner


# -- MPI -----------------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_the_toy_algorithm_is_exact_and_chosen_by_the_config(toy):
    comm = COMM.Dup()
    p, r = comm.Get_size(), comm.Get_rank()
    for n, dtype in ((1, np.float32), (1001, np.float32), (77, np.float16)):
        xs = [np.random.default_rng(n + q).standard_normal(n).astype(dtype) for q in range(p)]
        x = xs[r].copy()
        C.allreduce(x, comm, "toy")
        assert x.tobytes() == algos.reference(xs, "toy").tobytes(), (n, dtype)
    topo = Topology(comm, 1, p)
    engine = CommEngine(topo, config=CommConfig(allreduce="toy"))
    try:
        before = len(CALLS)
        y = xs[r].copy()
        engine.allreduce(y, topo.dp_comm).result()  # auto: the configured algorithm
        assert len(CALLS) == before + 1 and y.tobytes() == algos.reference(xs, "toy").tobytes()
    finally:
        engine.close()
        topo.free()
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_training_step_runs_with_the_toy_algorithm(toy, tmp_path_factory):
    """comm.allreduce=toy at dp = the world: the gradients and the step's facts go through the
    toy, and the losses match the default's (hier) within reassociation."""
    job = tiny_job(COMM, tmp_path_factory)
    common = ["--config", f"{job}/job.yaml", "--set", f"parallel.dp={COMM.size}",
              "--set", "schedule.policy=baseline-1f1b", "--set", "run.steps=2"]
    assert main([*common, "--set", f"run.dir={job}/auto"]) == 0
    assert not CALLS
    assert main([*common, "--set", "comm.allreduce=toy", "--set", f"run.dir={job}/toy"]) == 0
    assert len(CALLS) >= 2  # a gradient all-reduce per step at least
    COMM.Barrier()
    if COMM.rank == 0:
        def losses(d):
            with open(f"{d}/metrics.jsonl") as f:
                return [r["loss"] for r in map(json.loads, f) if "loss" in r]

        got, want = losses(f"{job}/toy"), losses(f"{job}/auto")
        assert len(got) == 2 and got[0] == want[0]  # the first step's loss: before any sum
        assert got[1] == pytest.approx(want[1], rel=1e-5)
        with open(f"{job}/toy/config.yaml") as f:
            assert "allreduce: toy" in f.read()  # recorded with the run


@pytest.mark.mpi(min_size=2)
def test_the_message_log_never_changes_the_path(capfd):
    """With the log on, the tree's blocking path and the throttled ring's pipelined path (its
    two scratch segments in the ledger) run as without it, give the same bits, and log their
    messages."""
    comm = COMM.Dup()
    p, r = comm.Get_size(), comm.Get_rank()
    n = 5001
    xs = [np.random.default_rng(q).standard_normal(n).astype(np.float32) for q in range(p)]
    ledger = Ledger(rank=r)
    wire.log_messages(True)
    try:
        x = xs[r][:2].copy()
        C.allreduce(x, comm, "tree")
        assert x.tobytes() == algos.reference([v[:2] for v in xs], "tree").tobytes()
        y = xs[r].copy()
        C.allreduce(y, comm, "ring", link=Link(2e10, 1e-6, chunk_bytes=4096), ledger=ledger)
        assert y.tobytes() == algos.reference(xs, "ring").tobytes()
    finally:
        wire.log_messages(False)
        comm.Free()
    assert ledger.peak_by_tag()["comm.ring"] == 2 * -(-n // p) * 4  # the pipelined ring's
    err = capfd.readouterr().err
    m = 1 << (p.bit_length() - 1)
    if r < m and m > 1:
        assert f"rank {COMM.rank} tree.step.send peer={r ^ 1} tag={C.COLL_TAG} bytes=8" in err
    assert f"rank {COMM.rank} ring.rs.send peer={(r + 1) % p}" in err
    assert f"rank {COMM.rank} ring.ag.recv peer={(r - 1) % p}" in err
