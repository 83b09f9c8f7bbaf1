"""`python -m ratrain.comm.bench`: arguments, JSON records, correctness checks."""

import argparse
import json

import pytest
from mpi4py import MPI

from ratrain.comm import bench


def test_sizes():
    assert bench.parse_size("8") == 8 and bench.parse_size("256M") == 256 << 20
    assert bench.parse_size("4KiB") == 4096
    assert bench.sizes_from("8:128", 4) == [8, 32, 128]
    assert bench.sizes_from("8,1M", 2) == [8, 1 << 20]


def test_no_rank_does_untimed_work_while_another_is_timed():
    """Each iteration: reset, barrier, the timed op, barrier. Without the second barrier a rank
    done early copies its buffer for the next iteration while a slower rank is still timed (4
    ranks on 2 cores: up to +8 ms on a 100 ms throttled all-reduce)."""
    calls = []

    class Comm:
        def Barrier(self):
            calls.append("barrier")

    class Runner:
        def reset(self):
            calls.append("reset")

        def once(self, algo):
            calls.append(algo)

        def check(self):
            return 0.0, 0

    a = argparse.Namespace(algos=["ring", "tree"], warmup=1, iters=2)
    times, checks = bench._measure(Runner(), a, Comm())
    assert calls == ["reset", "barrier", "ring", "barrier", "reset", "barrier", "tree", "barrier"] * 3
    assert [len(t) for t in times.values()] == [2, 2] and set(checks) == {"ring", "tree"}


def test_bad_arguments_exit_before_work(capsys):
    for argv in (["--algo", "nccl"], ["--algo", "mpi", "--link"], ["--sizes", "x:y"], ["--iters", "0"],
                 ["--op", "bcast", "--algo", "hier"], ["--model"], ["--ranks-per-node", "0"],
                 ["--op", "reduce_scatter", "--algo", "tree"]):  # the tree is an all-reduce
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2


def records(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", bench.OPS)
def test_every_op_reports_and_checks(capsys, op):
    algo = {"allreduce": "ring,tree,mpi", "bcast": "tree,mpi"}.get(op, "ring,mpi")
    argv = ["--op", op, "--algo", algo, "--sizes", "8,20000", "--iters", "2", "--warmup", "1"]
    if op == "stream":
        argv += ["--window", "4"]
    assert bench.main(argv) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        recs = records(capsys)
        assert recs and all(r["ok"] for r in recs), recs
        for r in recs:
            for key in ("op", "algo", "ranks", "bytes", "time_s", "algbw_GBps", "busbw_GBps"):
                assert key in r
            assert r.get("identical", True)


@pytest.mark.mpi(min_size=2)
def test_link_and_engine_modes(capsys):
    argv = ["--op", "allreduce", "--algo", "ring,tree", "--sizes", "64K", "--iters", "2", "--warmup", "0",
            "--link", "--bandwidth", "1e10", "--latency", "1e-6", "--engine"]
    assert bench.main(argv) == 0
    argv = ["--op", "pingpong", "--sizes", "64K", "--iters", "2", "--link", "--bandwidth", "1e9", "--latency", "2e-5"]
    assert bench.main(argv) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        recs = records(capsys)
        assert len(recs) == 3 and all(r["ok"] and "model_s" in r for r in recs)
        assert recs[-1]["time_s"] >= 2e-5 + 65536 / 1e9


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "allgather"])
def test_hier_on_nodes_with_the_model(capsys, op):
    """--algo hier on nodes of one rank (--ranks-per-node 1), the model from given rates."""
    argv = ["--op", op, "--algo", "hier,ring", "--sizes", "8,300000", "--iters", "2", "--warmup",
            "1", "--ranks-per-node", "1", "--model", "--bandwidth", "1e9", "--latency", "1e-5",
            "--intra-bandwidth", "1e10"]
    assert bench.main(argv) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        recs = records(capsys)
        p = MPI.COMM_WORLD.Get_size()
        assert len(recs) == 4 and all(r["ok"] for r in recs), recs
        for r in recs:
            assert r["nodes"] == p and r["ranks_per_node"] == 1
            assert r["link"]["throttled"] is False
        hier = [r for r in recs if r["algo"] == "hier"]
        assert all(r["model_s"] > 0 for r in hier)


@pytest.mark.mpi(min_size=2)
def test_shared_buffers(capsys):
    """--shared: every algorithm on buffers in the node's shared memory (hier in place)."""
    argv = ["--op", "allreduce", "--algo", "hier,ring,mpi", "--sizes", "8,70000", "--iters", "2",
            "--warmup", "1", "--shared", "--dtype", "float16"]
    assert bench.main(argv) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        recs = records(capsys)
        assert len(recs) == 6 and all(r["ok"] and r["identical"] for r in recs), recs
