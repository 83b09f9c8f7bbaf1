"""The planner: cost model formulas, the simulator against analytic pipeline times, overlap of
communication with bubbles, monotonicity, calibration, the search and the CLI. No MPI."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pytest

from ratrain.config import config_from_dict, load_config
from ratrain.exec.spec import block_flops
from ratrain.lifecycle.memory import stage_sizes
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.lifecycle.policies import PRESETS, Policy
from ratrain.plan import cost as C
from ratrain.plan.__main__ import main
from ratrain.plan.calibrate import calibrate
from ratrain.plan.cost import CostModel, Rates
from ratrain.plan.events import Sim, _Link
from ratrain.plan.memory import peak_memory
from ratrain.plan.search import (
    Layout,
    candidate_layouts,
    memory_table,
    plan_layout,
    scaling,
    search,
)
from ratrain.plan.simulate import simulate, simulate_config
from ratrain.plan.steps import recompute_for

POLICIES = ("baseline-1f1b", "megatron-1f1b", "ratrain")


# -- a cost model with uniform stages, for analytic checks ---------------------------------------


@dataclass
class _Rates:
    link_bandwidth: float = math.inf
    link_latency: float = 0.0
    intra_bandwidth: float = math.inf
    intra_latency: float = 0.0
    ranks_per_node: int = 1  # every rank its own node: one link each, as before nodes


class Uniform:
    """Every block costs tf forward, tb backward; gradients of `grad` bytes except the embedding's
    (0); ring all-reduce; update and view times as given."""

    def __init__(self, tf=1.0, tb=2.0, bw=math.inf, lat=0.0, act=1e6, grad=0.0, upd=0.0):
        self.tf, self.tb, self.act_, self.grad, self.upd = tf, tb, act, grad, upd
        self.rates = _Rates(bw, lat)
        self.activation_bytes = act

    def forward_time(self, role):
        return self.tf

    def backward_time(self, role, recompute="none"):
        return self.tb + (self.tf if recompute == "full" else 0.0)

    def update_time(self, role, shards=1):
        return self.upd / shards

    def view_time(self, role, shards=1):
        return 0.0

    def view_bytes(self, role):
        return self.grad / 2

    def nodes(self, pp, dp):
        return C.NodeLayout(pp, dp, "pp", self.rates.ranks_per_node)

    def staging_chunk(self, blocks, nodes, local):
        return None

    def collective_terms(self, op, nbytes, nodes, local, chunk_bytes=None):
        """A flat ring over the nodes' interfaces (no intra-node bytes)."""
        lat, wire = self.allreduce_terms(nbytes, nodes * local)
        return (lat, 0.0, wire) if op == "allreduce" else (lat / 2, 0.0, wire / 2)

    def collective_time(self, op, nbytes, nodes, local, chunk_bytes=None):
        lat, _, wire = self.collective_terms(op, nbytes, nodes, local)
        return lat + wire / self.rates.link_bandwidth

    def grad_bytes(self, role):
        return 0.0 if role == "embed" else self.grad

    def allreduce_terms(self, nbytes, p, algo=None):
        return C.allreduce_terms(nbytes, p, "ring", self.rates.link_bandwidth,
                                 self.rates.link_latency)

    def allreduce_time(self, nbytes, p, algo=None):
        lat, wire = self.allreduce_terms(nbytes, p)
        return lat + wire / self.rates.link_bandwidth


def _layers(pp, per=1, embed=False):
    out, i = [], 0
    for s in range(pp):
        names = ["embed"] if embed and s == 0 else []
        names += [f"layers.{i + j}" for j in range(per)]
        i += per
        out.append(tuple(names))
    return out


def _run(policy, pp, m, cost, dp=1, per=1, embed=False, precision="fp32", mode="eager", steps=2):
    # whole optimizer state on every replica (the cost of sharding is not what these measure)
    pol = Policy(policy, components=replace(PRESETS[policy], shard=False))
    plan = PipelinePlan.build(pol, _layers(pp, per, embed), m, precision, dp)
    return simulate(plan, cost, send_mode=mode, steps=steps)


# -- cost model ---------------------------------------------------------------------------------


def test_allreduce_formulas():
    """The planner prices the algorithms the runtime runs (`comm.model`): ring, and the tree
    as recursive doubling (log2 p exchanges; 2 more messages when p is not a power of two)."""
    n, B, a = 64 * 2**20, 1e9, 20e-6
    ring = CostModel(load_config("jobs/llama2-7b.yaml").model,
                     Rates(1e12, B, a), algo="ring")
    assert ring.allreduce_time(n, 4) == pytest.approx(2 * 3 * (a + n / (4 * B)))
    assert ring.allreduce_time(n, 1) == 0.0
    tree = replace(ring, algo="tree")
    assert tree.allreduce_time(8, 16) == pytest.approx(4 * (a + 8 / B))
    assert tree.allreduce_time(8, 24) == pytest.approx((4 + 2) * (a + 8 / B))
    # auto: the tree for small messages on many ranks, the ring for large ones
    lat, wire = C.allreduce_terms(8, 1024, "auto", B, a)
    assert lat == pytest.approx(10 * a)
    lat, wire = C.allreduce_terms(n, 64, "auto", B, a)
    assert wire == pytest.approx(2 * 63 * n / 64)
    with pytest.raises(ValueError, match="algo"):
        C.allreduce_terms(n, 4, "butterfly", B, a)


def test_cost_model_llama7b():
    cfg = load_config("jobs/llama2-7b.yaml")
    cost = CostModel.from_config(cfg)
    assert cost.rates.compute_flops == 4.5e12 and "112,790" in cost.rates.source("compute_flops")
    m = cfg.model
    # forward + backward of every block of the model = flops_per_token x tokens
    total = sum(
        (block_flops(m, r, cost.tokens, "forward") + block_flops(m, r, cost.tokens, "backward"))
        * n for r, n in (("layer", m.layers), ("head", 1))
    )
    assert total == pytest.approx(m.flops_per_token() * cost.tokens, rel=1e-3)
    assert cost.backward_time("layer") == pytest.approx(2 * cost.forward_time("layer"))
    assert cost.backward_time("layer", "full") == pytest.approx(3 * cost.forward_time("layer"))
    assert cost.forward_time("layer") < cost.backward_time("layer", "selective") \
        < cost.backward_time("layer", "full")
    assert cost.activation_bytes == 4096 * 4096 * 2
    # across nodes through the 25e9 B/s interface, inside a node at 25.6e9 B/s
    assert cost.p2p_time() == pytest.approx(5e-6 + 4096 * 4096 * 2 / 2.5e10)
    assert cost.p2p_time(same_node=True) == pytest.approx(1e-6 + 4096 * 4096 * 2 / 2.56e10)
    assert cost.rates.ranks_per_node == 4 and "assumed" in cost.rates.source("ranks_per_node")
    p = cost.block_params("layer")
    assert cost.update_time("layer") == pytest.approx(28 * p / C.DEFAULT_MEM_BANDWIDTH)
    assert cost.view_time("layer") == pytest.approx(6 * p / C.DEFAULT_MEM_BANDWIDTH)
    assert replace(cost, precision="fp32").view_time("layer") == 0.0


def test_host_profile_refused_with_hint():
    cfg = config_from_dict({"platform": {"profile": "host"}})
    with pytest.raises(ValueError, match="mt3000"):
        Rates.from_config(cfg)


# -- the simulator against analytic times ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["1f1b-bare", "gpipe-bare", *POLICIES, "gpipe"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (4, 2), (4, 8), (8, 8), (3, 12)])
@pytest.mark.parametrize("mode", ["eager", "rendezvous"])
def test_uniform_pipeline_is_analytic(policy, pp, m, mode):
    """No communication: (m + p - 1) (t_f + t_b), 1F1B and GPipe alike, every policy."""
    res = _run(policy, pp, m, Uniform(1.0, 2.0), mode=mode)
    assert res.step_s == pytest.approx((m + pp - 1) * 3.0)
    for st in res.ranks:
        assert st.compute_s == pytest.approx(3.0 * m)
        assert st.bubble_s == pytest.approx((pp - 1) * 3.0)
        assert st.comm_exposed_s == 0.0


def test_one_step_makespan_and_message_costs():
    # pp=2, m=1: F0, message, F1, B1, message, B0
    c = Uniform(1.0, 2.0, bw=1e6, lat=0.1, act=1e5)  # a message costs 0.1 + 0.1 s
    res = _run("1f1b-bare", 2, 1, c, steps=1)
    assert res.step_s == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * 0.2)
    # the receiver's wait is the transfer: exposed communication
    assert res.ranks[1].comm_exposed_s == pytest.approx(0.2)
    assert res.ranks[0].comm_exposed_s == pytest.approx(0.2)
    rv = _run("1f1b-bare", 2, 1, c, steps=1, mode="rendezvous")
    assert rv.step_s == pytest.approx(res.step_s)


def test_link_is_shared_by_concurrent_flows():
    sim = Sim([], Uniform(bw=1e6), 1, "eager", False)
    link, done = _Link(sim, 1e6), {}
    link.add(0.0, 1e6, lambda t: done.setdefault("a", t))
    link.add(0.0, 1e6, lambda t: done.setdefault("b", t))
    sim.at(0.5, lambda t: link.add(t, 0.5e6, lambda t2: done.setdefault("c", t2)))
    sim.run()
    # 0..0.5 s: a and b at 0.5 MB/s each (0.75 MB left); then three flows at 1/3 MB/s: c
    # (0.5 MB) ends at 2.0 s; a and b (0.25 MB left each) share the link to 2.5 s
    assert done["c"] == pytest.approx(2.0)
    assert done["a"] == pytest.approx(2.5) and done["b"] == pytest.approx(2.5)


def test_communication_in_bubbles_hidden_by_ratrain_exposed_by_baseline():
    """Per-layer gradient syncs that fit under the rest of the backward cost ratrain nothing;
    the baseline starts them after the last backward, so stage 0 waits for them."""
    pp, m, dp, per = 4, 8, 8, 4
    free = _run("1f1b-bare", pp, m, Uniform(1.0, 2.0), embed=True, per=per)
    # each layer's all-reduce takes 1 s alone: less than one block's backward (2 s)
    grad = 1e6 / (2 * (dp - 1) / dp)
    c = Uniform(1.0, 2.0, bw=1e6, lat=0.0, act=0.0, grad=grad)
    rt = _run("ratrain", pp, m, c, dp=dp, embed=True, per=per)
    base = _run("baseline-1f1b", pp, m, c, dp=dp, embed=True, per=per)
    # (+ 31 us: the GradNorm collective of 16 bytes over 32 ranks)
    assert rt.step_s == pytest.approx(free.step_s, abs=1e-4)
    assert base.step_s == pytest.approx(free.step_s + per * 1.0, abs=1e-4)  # stage 0's syncs
    assert base.ranks[0].comm_exposed_s == pytest.approx(per * 1.0, rel=1e-4)  # + GradNorm
    assert rt.ranks[0].comm_exposed_s == pytest.approx(0.0, abs=1e-4)


def test_ratrain_moves_updates_into_bubbles():
    pp, m = 4, 8
    free = _run("1f1b-bare", pp, m, Uniform(1.0, 2.0), per=2)
    c = Uniform(1.0, 2.0, upd=0.5)
    rt = _run("ratrain", pp, m, c, per=2)
    base = _run("baseline-1f1b", pp, m, c, per=2)
    # baseline: every stage updates after the global norm (2 blocks x 0.5 s on the critical path);
    # ratrain: later stages update in their warm-up bubble, stage 0 just ahead of its forward
    assert base.step_s == pytest.approx(free.step_s + 1.0)
    assert rt.step_s == pytest.approx(free.step_s + 1.0)
    assert rt.ranks[-1].update_s == pytest.approx(1.0)


def test_deadlock_is_reported():
    blocks = _layers(2)
    plan = PipelinePlan.build(Policy("1f1b-bare"), blocks, 2)
    lists = plan.steps(1)
    no_sends = tuple(a for a in lists[0][0] if type(a).__name__ != "SendForward")
    lists = [[no_sends, lists[0][1]]]  # stage 1 waits for activations that never come
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(plan, Uniform(), steps=1, step_lists=lists)


# -- monotonicity on a real shape -----------------------------------------------------------------


def _small():
    cfg = load_config("jobs/llama2-7b.yaml", ["parallel.pp=4", "parallel.dp=8",
                                              "parallel.num_micro_batches=8",
                                              "model.layers=8", "model.seq_len=1024"])
    return cfg, CostModel.from_config(cfg)


def _rate(cost, **kw):
    r = cost.rates
    for k, v in kw.items():
        r = r.with_(k, v, "test")
    return cost.with_rates(r)


@pytest.mark.parametrize("policy", POLICIES)
def test_monotone_in_rates(policy):
    cfg, cost = _small()
    t = simulate_config(cfg, cost, policy, with_memory=False).step_s
    assert simulate_config(cfg, _rate(cost, link_bandwidth=1e8), policy,
                           with_memory=False).step_s > t
    assert simulate_config(cfg, _rate(cost, link_latency=1e-3), policy,
                           with_memory=False).step_s > t
    assert simulate_config(cfg, _rate(cost, compute_flops=9e12), policy,
                           with_memory=False).step_s < t
    faster_mem = simulate_config(cfg, _rate(cost, mem_bandwidth=1e12), policy,
                                 with_memory=False).step_s
    assert faster_mem <= t


def test_monotone_in_layout():
    cfg, cost = _small()
    # more micro-batches: smaller bubble fraction, higher tokens/s
    tps = [simulate_config(replace(cfg, parallel=replace(cfg.parallel, num_micro_batches=m)),
                           cost, "ratrain", with_memory=False).tokens_per_s for m in (4, 8, 16)]
    assert tps == sorted(tps)
    # weak scaling: tokens/s per cluster never rises with dp
    per = [
        simulate_config(replace(cfg, parallel=replace(cfg.parallel, dp=dp)), cost, "baseline-1f1b",
                        with_memory=False).tokens_per_s / (4 * dp)
        for dp in (1, 4, 16, 64)
    ]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(per, per[1:]))
    # recomputation costs time and saves memory
    res = {r: simulate_config(replace(cfg, schedule=replace(cfg.schedule, recompute=r)), cost,
                              "ratrain") for r in ("none", "selective", "full")}
    assert res["none"].step_s < res["selective"].step_s < res["full"].step_s
    assert res["none"].peak_bytes > res["selective"].peak_bytes > res["full"].peak_bytes
    assert res["full"].ranks[0].recompute_s > 0 and res["none"].recompute_s == 0


def test_ratrain_never_slower_than_baseline():
    cfg, cost = _small()
    for bw in (1e8, 1e9, 6.25e9):
        c = _rate(cost, link_bandwidth=bw)
        rt = simulate_config(cfg, c, "ratrain", with_memory=False).step_s
        base = simulate_config(cfg, c, "baseline-1f1b", with_memory=False).step_s
        assert rt <= base * (1 + 1e-9)


# -- calibration ----------------------------------------------------------------------------------


def test_calibrate_recovers_compute_rate(tmp_path):
    cfg, cost = _small()
    true = _rate(cost, compute_flops=3.0e12)
    step = simulate_config(cfg, true, cfg.schedule.policy, with_memory=False).step_s
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for i, s in enumerate([10 * step, step * 0.999, step, step * 1.001]):
            f.write(json.dumps({"step": i, "step_time_s": s}) + "\n")
    cal = calibrate(cfg, str(tmp_path), cost)
    assert cal.method == "step" and cal.steps_used == 3
    assert cal.rates.compute_flops == pytest.approx(3.0e12, rel=1e-4)
    assert abs(cal.residual) < 1e-4
    assert "calibrated" in cal.rates.source("compute_flops")


# -- search, scaling, memory ----------------------------------------------------------------------


def test_candidates_keep_the_global_batch():
    cfg = load_config("jobs/llama2-7b.yaml")
    for lay in candidate_layouts(cfg, 1024):
        assert lay.clusters <= 1024
        assert lay.global_batch == pytest.approx(cfg.parallel.global_batch, rel=0.5)


def test_search_respects_cap_and_ranks():
    cfg, cost = _small()
    cap = 8 * 2**30
    plans = search(cfg, 32, ("baseline-1f1b", "ratrain"), cost, cap, micro_batches=(1,))
    for pol, ps in plans.items():
        assert ps, pol
        assert all(p.fits and p.peak_bytes <= cap for p in ps)
        tps = [p.tokens_per_s for p in ps]
        assert tps == sorted(tps, reverse=True)
    assert plans["ratrain"][0].tokens_per_s >= plans["baseline-1f1b"][0].tokens_per_s * (1 - 1e-9)


def test_auto_recompute_is_the_fewest_layers_that_fit():
    cfg, cost = _small()
    lay = Layout(2, 16, 1, 8)
    none = plan_layout(cfg, lay, "ratrain", cost, None, ("none",))[0]
    full = plan_layout(cfg, lay, "ratrain", cost, None, ("full",))[0]
    assert full.peak_bytes < none.peak_bytes
    cap = (none.peak_bytes + full.peak_bytes) // 2
    auto = plan_layout(cfg, lay, "ratrain", cost, cap, ("auto",))[0]
    assert auto.fits and auto.layout.recompute == "auto"
    counts = auto.layout.recompute_layers
    assert sum(counts) > 0
    # one fewer recomputed layer on any stage that recomputes goes over the cap
    plan = PipelinePlan.from_config(cfg, "ratrain", pp=2, dp=1, m=8, layers_per_stage=None)
    blocks = plan.blocks
    for s, n in enumerate(counts):
        if n:
            fewer = list(counts)
            fewer[s] -= 1
            lists = plan.steps(2)
            choice = recompute_for(blocks, "auto", fewer)[s]
            sizes = stage_sizes(cfg.model, 1, cfg.precision, blocks[s], choice)
            assert peak_memory(lists, s, blocks[s], sizes) > cap
    assert plan_layout(cfg, lay, "ratrain", cost, 2**20)[0].result is None  # nothing fits


def test_scaling_efficiency_relative_to_smallest():
    cfg, cost = _small()
    rows = scaling(cfg, Layout(4, 1, 1, 8), "baseline-1f1b", (4, 16, 64), cost, None)
    assert [r.plan.layout.dp for r in rows] == [1, 4, 16]
    assert rows[0].efficiency == 1.0
    assert all(0.5 < r.efficiency <= 1.0 + 1e-12 for r in rows)  # more sync, same work


def test_sharded_ratrain_updates_a_segment_and_gathers_views():
    """ratrain shards its optimizer state over dp (as the runtime does): each replica updates
    and casts 1/dp of every block, the gradient sync is a reduce-scatter and the view comes back
    by all-gather, so its per-replica update time falls as 1/dp and weak scaling can exceed 1."""
    cfg, cost = _small()
    rows = scaling(cfg, Layout(4, 1, 1, 8), "ratrain", (4, 16, 64), cost, None)
    upd = [r.plan.result.ranks[0].update_s for r in rows]
    assert upd[1] == pytest.approx(upd[0] / 4, rel=1e-3)
    assert upd[2] == pytest.approx(upd[0] / 16, rel=1e-3)
    assert all(r.efficiency > 0.5 for r in rows)
    assert rows[0].plan.result.ranks[0].comm_total_s == 0.0  # dp = 1: nothing to sync
    assert rows[2].plan.result.ranks[0].comm_total_s > 0.0
    # unsharded ratrain (schedule.shard_optimizer: false) updates whole blocks at every dp
    cfg1 = load_config("jobs/llama2-7b.yaml", ["schedule.shard_optimizer=false"])
    cfg1 = replace(cfg1, model=cfg.model, parallel=cfg.parallel, precision=cfg.precision)
    rows1 = scaling(cfg1, Layout(4, 1, 1, 8), "ratrain", (4, 64), cost, None)
    assert rows1[1].plan.result.ranks[0].update_s == pytest.approx(upd[0])


def test_memory_table_more_stages_less_memory():
    cfg = load_config("jobs/llama2-7b.yaml")
    rows = memory_table(cfg, [4, 8, 16], "ratrain")
    peaks = [r.peak_full for r in rows]
    assert peaks == sorted(peaks, reverse=True)
    assert rows[0].recomputed is None  # 4 stages cannot hold LLaMA-2-7B in 20 GiB
    assert rows[-1].recomputed is not None and rows[-1].recomputed < 32


# -- the CLI -----------------------------------------------------------------------------------


def test_cli(capsys):
    rc = main(["--config", "jobs/llama2-7b.yaml", "--set", "model.layers=8",
               "--set", "parallel.pp=4", "--set", "parallel.dp=8",
               "--set", "model.seq_len=1024", "--clusters", "32", "--top", "2",
               "--scaling", "8,32", "--micro-batches", "1", "--policy", "all"])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("compute_flops", "baseline-1f1b", "ratrain", "tokens/s", "peak GiB",
                 "weak scaling", "eff"):
        assert word in out


def test_cli_errors(capsys):
    assert main(["--config", "jobs/nope.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--config", "jobs/tiny.yaml"]) == 2  # host profile: no link model
    assert "mt3000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", "jobs/llama2-7b.yaml", "--policy", "zero3"])


# -- nodes ----------------------------------------------------------------------------------------


def test_node_layout_per_placement():
    # 4 ranks per node, pp 2 x dp 4: "pp" puts two replicas' both stages on a node (the data-
    # parallel group spans 2 nodes, 2 ranks each); "dp" a stage's four replicas (1 node of 4)
    pp_ = C.NodeLayout(2, 4, "pp", 4)
    assert pp_.node == (0, 0) and pp_.copies == (2, 2) and pp_.runs == ((2, 2), (2, 2))
    assert pp_.same_node(0, 1)
    dp_ = C.NodeLayout(2, 4, "dp", 4)
    assert dp_.node == (0, 1) and dp_.copies == (4, 4) and dp_.runs == ((1, 4), (1, 4))
    assert not dp_.same_node(0, 1)
    one = C.NodeLayout(16, 64, "pp", 1)  # a rank per node: every message crosses the network
    assert one.copies == (1,) * 16 and one.runs[0] == (64, 1) and one.world_runs == (1024, 1)
    deep = C.NodeLayout(16, 64, "pp", 4)  # stages 0-3 of a replica share a node
    assert deep.node[:5] == (0, 0, 0, 0, 1) and deep.runs[0] == (64, 1)


def test_interface_is_shared_and_nodes_change_the_step():
    cfg = load_config("jobs/bench-lifecycle.yaml")
    cost = CostModel.from_config(cfg)
    assert cost.rates.ranks_per_node == 4 and cost.placement == "pp"
    # all-reduce over 2 nodes of 2: the interface carries n; over one node of 4: nothing
    fixed, intra, nic = cost.collective_terms("allreduce", 1e6, 2, 2)
    assert nic == 1e6 and intra == pytest.approx(1e6) and fixed > 0
    assert cost.collective_terms("allreduce", 1e6, 1, 4)[2] == 0.0
    steps = {}
    for pl in ("pp", "dp"):
        for bw in (2.5e10, 2.5e8):
            c = replace(cost, placement=pl, rates=cost.rates.with_("link_bandwidth", bw, "test"))
            steps[pl, bw] = simulate_config(cfg, c, "baseline-1f1b", [0, 0]).step_s
    # a slower interface slows both placements (pp: the gradient syncs cross it; dp: the
    # pipeline messages do), and never speeds a step up
    for pl in ("pp", "dp"):
        assert steps[pl, 2.5e8] > steps[pl, 2.5e10]


def test_cli_ranks_per_node_and_placement(capsys):
    argv = ["--config", "jobs/llama2-7b.yaml", "--set", "model.layers=8", "--set",
            "parallel.pp=4", "--set", "parallel.dp=8", "--set", "model.seq_len=1024",
            "--clusters", "32", "--top", "4", "--scaling", "",
            "--micro-batches", "1", "--policy", "ratrain", "--placement", "both"]
    assert main([*argv, "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "ranks_per_node = 8 ranks  (--ranks-per-node)" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert {r[4] for r in rows} == {"pp", "dp"}
    with pytest.raises(SystemExit):
        main([*argv, "--ranks-per-node", "0"])
