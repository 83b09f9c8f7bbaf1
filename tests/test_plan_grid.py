"""The simulator on the whole pp x dp grid (`plan.simulate.simulate_grid`): replicas grouped by
their stages' classes and their share, each rank at its class's rates, a block's gradient
collective starting when every replica's rank of the stage has submitted it. No MPI."""

import pytest

from ratrain.config import config_from_dict
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.plan import hetero
from ratrain.plan.__main__ import main as plan_main
from ratrain.plan.simulate import grid_groups, simulate, simulate_config
from ratrain.plan.steps import recompute_for
from ratrain.shim.platform import class_map

MODEL = {"vocab_size": 256, "hidden": 64, "layers": 8, "heads": 2, "kv_heads": 2,
         "ffn_hidden": 172, "seq_len": 64}
RATE = 4.5e12


def config(pp, dp, m, classes=(), placement="pp", policy="ratrain", shares=None):
    return config_from_dict({
        "model": MODEL, "precision": "fp16",
        "parallel": {"pp": pp, "dp": dp, "micro_batch": 4, "num_micro_batches": m,
                     "placement": placement, "replica_shares": shares},
        "schedule": {"policy": policy},
        "platform": {"profile": "mt3000", "emulate": True, "time_scale": 100.0,
                     "classes": list(classes)},
    })


def ranks_of(cfg):
    return class_map(cfg.platform, [""] * cfg.parallel.world_size)


@pytest.mark.parametrize("policy", ["baseline-1f1b", "megatron-1f1b", "ratrain"])
@pytest.mark.parametrize("placement,a", [("pp", [0, 1, 2, 3]), ("dp", [0, 1, 4, 5])])
def test_replicas_alike_in_two_groups_play_as_the_lockstep_replica(policy, placement, a):
    # two classes with the profile's values: the grid plays two groups of replicas (replicas
    # 0-1 in class a, 2-3 in b) and must time them as one. Nodes of 4 ranks (mt3000): with pp
    # placement each group on its node; with dp placement every stage on its own node, the
    # groups' pipeline messages sharing its interface
    alike = [{"name": "a", "ranks": a}, {"name": "b", "ranks": sorted(set(range(8)) - set(a))}]
    cfg = config(2, 4, 4, alike, placement=placement, policy=policy)
    grid = simulate_config(cfg, steps=3, with_memory=False)
    assert len(grid.ranks) == 4 and {r.group for r in grid.ranks} == {0, 1}
    assert [g.replicas for g in grid_groups(cfg, ranks_of(cfg))] == [(0, 1), (2, 3)]
    lockstep = simulate_config(config(2, 4, 4, placement=placement, policy=policy), steps=3,
                               with_memory=False)
    assert len(lockstep.ranks) == 2
    assert grid.step_s == pytest.approx(lockstep.step_s, rel=1e-12)
    assert grid.tokens_per_s == pytest.approx(lockstep.tokens_per_s, rel=1e-12)


def test_a_fast_replica_waits_for_the_slow_one_at_the_gradient_sync():
    # pure data parallel, equal shares: the step is the slow replicas' alone
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    res = simulate_config(config(1, 8, 3, mixed), steps=3, with_memory=False)
    slow = simulate_config(config(1, 8, 3, [{"name": "slow", "ranks": list(range(8)),
                                             "compute_flops": RATE / 2}]),
                           steps=3, with_memory=False)
    assert res.step_s == pytest.approx(slow.step_s, rel=1e-9)
    fast, late = (next(r for r in res.ranks if r.group == g) for g in (0, 1))
    assert fast.compute_s < 0.55 * late.compute_s  # half the flop time, the same gathers
    # idle, waiting for them: at the first collective, then through every collective, which
    # overlaps the slow ranks' backward but not the fast ranks' (exposed for them)
    idle = [r.bubble_s + r.comm_exposed_s for r in (fast, late)]
    assert idle[0] > idle[1] + 0.4 * late.compute_s and fast.bubble_s > 0.2 * late.compute_s


@pytest.mark.parametrize("policy", ["baseline-1f1b", "ratrain"])
def test_the_grid_is_no_faster_than_any_of_its_replicas_alone(policy):
    # pp 2 x dp 2, pp placement: replica 0 is ranks 0-1, replica 1 ranks 2-3; the slow ranks
    # are replica 0's stage 0 and replica 1's stage 1, so each stage's collectives wait for a
    # different replica
    crossed = [{"name": "slow", "ranks": [0, 3], "compute_flops": RATE / 2},
               {"name": "fast", "ranks": [1, 2]}]
    cfg = config(2, 2, 4, crossed, policy=policy)
    grid = simulate_config(cfg, steps=3, with_memory=False).step_s
    alone = []
    for grp in grid_groups(cfg, ranks_of(cfg)):
        rec = recompute_for(grp.plan.blocks, "none")
        alone.append(simulate(grp.plan, list(grp.costs), rec, steps=3).step_s)
    assert len(alone) == 2 and alone[0] != alone[1]
    assert grid >= max(alone) * (1 - 1e-12)


def test_unequal_shares_four_fast_four_slow_pure_data_parallel():
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    sym = config(1, 8, 12, mixed)
    asym = config(1, 8, 12, mixed, shares=[16, 16, 16, 16, 8, 8, 8, 8])
    a, s = (simulate_config(c, steps=3, with_memory=False) for c in (asym, sym))
    assert a.tokens_per_step == s.tokens_per_step
    assert 1.35 < a.tokens_per_s / s.tokens_per_s <= 1.5  # compute alone: 6 / 4
    # every group played with its own micro-batches: fast ranks compute 16 at full rate, slow
    # 8 at half, about the same time (the embedding's gathers at the same DDR rate)
    fast, slow = (next(r for r in a.ranks if r.group == g) for g in (0, 1))
    assert fast.compute_s == pytest.approx(slow.compute_s, rel=0.1)


def test_unequal_shares_of_a_uniform_cluster_are_played_per_share():
    cfg = config(2, 4, 4, shares=[5, 5, 3, 3])
    res = simulate_config(cfg, steps=3, with_memory=False)
    groups = grid_groups(cfg)
    assert [g.replicas for g in groups] == [(0, 1), (2, 3)]
    assert [g.plan.num_micro_batches for g in groups] == [5, 3]
    even5 = simulate_config(config(2, 4, 5), steps=3, with_memory=False)
    assert res.step_s == pytest.approx(even5.step_s, rel=1e-9)  # the larger share sets it


def test_predict_is_the_grid_step_in_this_hosts_time():
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    cfg = config(2, 4, 4, mixed, placement="dp")
    res = simulate_config(cfg, steps=3, with_memory=False)
    want = res.tokens_per_step / (res.step_s * cfg.platform.time_scale)
    assert hetero.predict(cfg, ranks_of(cfg)) == pytest.approx(want, rel=1e-12)


def test_groups_follow_the_placement():
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    # dp placement: stage 0 is ranks 0-3 (fast), stage 1 ranks 4-7: every replica alike
    cfg = config(2, 4, 4, mixed, placement="dp")
    (only,) = grid_groups(cfg, ranks_of(cfg))
    assert only.replicas == (0, 1, 2, 3)
    assert [c.rates.compute_flops for c in only.costs] == [RATE, RATE / 2]
    # pp placement: replicas 0-1 fast, 2-3 slow
    cfg = config(2, 4, 4, mixed, placement="pp")
    assert [g.replicas for g in grid_groups(cfg, ranks_of(cfg))] == [(0, 1), (2, 3)]


def test_a_class_map_that_misses_a_rank_is_refused():
    cfg = config(1, 4, 2, [{"name": "a", "ranks": [0, 1, 2]}])
    with pytest.raises(Exception, match="rank 3"):
        simulate_config(cfg, with_memory=False)


def test_the_plans_of_each_group_validate():
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    cfg = config(2, 4, 4, mixed, shares=[6, 6, 2, 2])
    for g in grid_groups(cfg, ranks_of(cfg)):
        assert isinstance(g.plan, PipelinePlan)
        g.plan.validate()


def test_the_planners_moves_keep_the_model_and_the_batch():
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    cfg = config(2, 4, 4, mixed, placement="pp", shares=[5, 5, 3, 3])
    cfg = config_from_dict({**cfg.to_dict(), "parallel": {**cfg.to_dict()["parallel"],
                                                          "layers_per_stage": [4, 4]}})
    moves = hetero.neighbours(cfg, ranks_of(cfg))
    layers = {c.parallel.layers_per_stage for c in moves} - {(4, 4)}
    shares = {c.parallel.replica_shares for c in moves} - {(5, 5, 3, 3)}
    assert layers and all(sum(x) == 8 and min(x) >= 1 for x in layers)
    assert shares == {(4, 4, 4, 4), (6, 6, 2, 2)}  # one micro-batch per replica, kind to kind


def test_refining_with_the_simulator_never_loses():
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 2}]
    cfg = config(1, 8, 3, mixed, shares=[3] * 8)  # the symmetric start: far from the best
    classes = ranks_of(cfg)
    start = hetero.Candidate(cfg, True, hetero.predict(cfg, classes), True)
    better = hetero.refined(start, classes)
    assert better.tokens_per_s > 1.2 * start.tokens_per_s
    assert better.cfg.parallel.replica_shares == (4, 4, 4, 4, 2, 2, 2, 2)
    assert hetero.predict(better.cfg, classes) == better.tokens_per_s


@pytest.mark.parametrize("policy", ["baseline-1f1b", "megatron-1f1b", "ratrain", "gpipe"])
def test_unequal_shares_pair_their_collectives_under_every_policy(policy):
    # a replica with fewer micro-batches than stages still meets the others at every collective
    cfg = config(4, 2, 4, policy=policy, shares=[7, 1])
    res = simulate_config(cfg, steps=3, with_memory=False)
    assert {r.group for r in res.ranks} == {0, 1}
    assert res.step_s >= simulate_config(config(4, 2, 7, policy=policy), steps=3,
                                         with_memory=False).step_s * (1 - 1e-12)


def test_classes_named_by_node_need_the_ranks_nodes():
    cfg = config(1, 2, 2, [{"name": "a", "hosts": ["n1*"]}, {"name": "b", "hosts": ["n2*"]}])
    with pytest.raises(ValueError, match=r"name their ranks by node \(hosts\)"):
        simulate_config(cfg, with_memory=False)
    named = simulate_config(cfg, with_memory=False, classes=class_map(cfg.platform, ["n1", "n2"]))
    assert named.step_s > 0


def test_a_fast_stage_takes_no_more_layers_than_its_cap_holds():
    # dp placement: stage 0 is ranks 0-3 (fast), stage 1 ranks 4-7 (at a quarter the rate)
    mixed = [{"name": "fast", "ranks": [0, 1, 2, 3]},
             {"name": "slow", "ranks": [4, 5, 6, 7], "compute_flops": RATE / 4}]
    cfg = config(2, 4, 4, mixed, placement="dp")
    free = hetero.split_layers(cfg, ranks_of(cfg))
    assert free[0] >= 6
    cap = hetero.state_bytes(cfg, 0, 4)  # masters and moments of 4 layers and the embedding
    assert hetero.state_bytes(cfg, 0, 5) > cap
    capped = config(2, 4, 4, [{**mixed[0], "ddr_bytes": cap}, mixed[1]], placement="dp")
    assert hetero.split_layers(capped, ranks_of(capped)) == (4, 4)
    # no split fits: the fastest regardless, which the memory check then refuses by name
    none = config(2, 4, 4, [{**mixed[0], "ddr_bytes": 1000}, {**mixed[1], "ddr_bytes": 1000}],
                  placement="dp")
    assert hetero.split_layers(none, ranks_of(none)) == free


def test_the_command_refuses_classes_it_cannot_place(tmp_path, capsys):
    cfg = config(1, 2, 2, [{"name": "a", "hosts": ["n1*"]}, {"name": "b", "hosts": ["n2*"]}])
    job = tmp_path / "byhost.yaml"
    job.write_text(cfg.to_yaml())
    assert plan_main(["--config", str(job), "--policy", "ratrain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "platform.classes[].ranks" in err[0]
