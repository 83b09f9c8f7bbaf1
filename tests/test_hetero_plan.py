"""The planner for mixed clusters (`ratrain.plan.hetero`): layer splits and replica shares from
each rank's class, the simulator's prediction with each stage at its class's rates, the search
under each class's cap, and `python -m ratrain.plan` on a mixed cluster. No MPI."""

import pytest

from ratrain.config import config_from_dict
from ratrain.plan import hetero
from ratrain.plan.__main__ import main as plan_main
from ratrain.plan.simulate import simulate_config
from ratrain.shim.platform import class_map

MODEL = {"vocab_size": 256, "hidden": 64, "layers": 8, "heads": 2, "kv_heads": 2,
         "ffn_hidden": 172, "seq_len": 64}


def mixed(pp=1, dp=8, m=3, placement="pp", fast=(0, 1, 2, 3), slow=(4, 5, 6, 7), factor=2.0,
          slow_extra=None, **parallel):
    rate = 4.5e12
    classes = [{"name": "fast", "ranks": list(fast), "compute_flops": rate},
               {"name": "slow", "ranks": list(slow), "compute_flops": rate / factor,
                **(slow_extra or {})}]
    cfg = config_from_dict({
        "model": MODEL, "precision": "fp16",
        "parallel": {"pp": pp, "dp": dp, "micro_batch": 4, "num_micro_batches": m,
                     "placement": placement, **parallel},
        "schedule": {"policy": "ratrain"},
        "platform": {"profile": "mt3000", "emulate": True, "time_scale": 100.0,
                     "classes": classes},
    })
    return cfg, class_map(cfg.platform, [""] * cfg.parallel.world_size)


def test_a_stage_twice_as_fast_takes_about_twice_the_layers():
    # placement dp: stage 0 is ranks 0-3 (fast), stage 1 ranks 4-7 (slow)
    cfg, classes = mixed(pp=2, dp=4, placement="dp")
    layers = hetero.split_layers(cfg, classes)
    assert sum(layers) == 8 and layers[0] > layers[1]
    t = [hetero.stage_seconds(cfg, s, layers[s], hetero.grid_rates(cfg, classes)[s][0])
         for s in range(2)]
    # the split balances the two stages better than any other split
    for k in range(1, 8):
        other = [hetero.stage_seconds(cfg, 0, k, hetero.grid_rates(cfg, classes)[0][0]),
                 hetero.stage_seconds(cfg, 1, 8 - k, hetero.grid_rates(cfg, classes)[1][0])]
        assert max(t) <= max(other)


def test_the_head_is_weighed_as_it_costs():
    # equal ranks, a large vocabulary: the last stage (the head) takes fewer layers
    cfg, _ = mixed(pp=2, dp=4, placement="dp")
    big = config_from_dict({**cfg.to_dict(), "model": {**MODEL, "vocab_size": 32000}})
    same = ("fast",) * 8
    assert hetero.split_layers(big, same)[1] < hetero.split_layers(big, same)[0]
    assert hetero.split_layers(cfg, same) in ((4, 4), (5, 3))


def test_shares_follow_speed_and_add_up():
    cfg, classes = mixed(m=3)  # placement pp, pp 1: replicas 0-3 fast, 4-7 slow
    shares = hetero.split_shares(cfg, classes, (8,))
    assert shares == (4, 4, 4, 4, 2, 2, 2, 2)
    cfg, classes = mixed(m=5)
    shares = hetero.split_shares(cfg, classes, (8,))
    assert sum(shares) == 40 and min(shares[:4]) >= max(shares[4:])


def test_prediction_of_a_uniform_cluster_is_the_lockstep_simulators():
    cfg, _ = mixed(pp=2, dp=4, m=4)
    same = ("fast",) * 8
    uniform = config_from_dict({**cfg.to_dict(), "platform": {
        **cfg.to_dict()["platform"], "classes": [], "compute_flops": 4.5e12}})
    ref = simulate_config(uniform, steps=3, with_memory=False).step_s
    assert hetero.predict_step_s(cfg, same) == pytest.approx(ref, rel=1e-12)


def test_fitting_the_work_to_the_ranks_pays_on_a_mixed_cluster():
    cfg, classes = mixed(m=6)
    sym = hetero.predict(cfg, classes)
    asym = hetero.predict(hetero.resolve(
        config_from_dict({**cfg.to_dict(), "parallel": {**cfg.to_dict()["parallel"],
                                                        "replica_shares": "auto"}}),
        classes), classes)
    assert 1.2 < asym / sym <= 1.5  # at most the 1.5 of the compute alone


def test_the_planner_picks_an_asymmetric_plan_and_the_best_symmetric_one():
    cfg, classes = mixed(m=3)
    best = hetero.best_plans(cfg, classes, policies=("ratrain",))
    a, s = best["asymmetric"].parallel, best["symmetric"].parallel
    assert len(set(a.shares)) > 1 or (a.layers_per_stage and len(set(a.layers_per_stage)) > 1)
    assert len(set(s.shares)) == 1 and a.global_batch == s.global_batch == cfg.parallel.global_batch
    assert hetero.predict(best["asymmetric"], classes) > hetero.predict(best["symmetric"], classes)


def test_a_stage_over_its_class_cap_is_not_chosen():
    cfg, classes = mixed(pp=2, dp=4, placement="dp", slow_extra={"ddr_bytes": 2_000_000})
    assert hetero.stage_caps(cfg, classes)[1] == 2_000_000
    assert not hetero.fits(cfg, classes)
    tiny = {"ddr_bytes": 1000}
    cfg, classes = mixed(slow_extra=tiny, fast=(0, 1, 2, 3))
    cfg = config_from_dict({**cfg.to_dict(), "platform": {
        **cfg.to_dict()["platform"], "ddr_bytes": 1000}})
    with pytest.raises(ValueError, match="ddr_bytes"):
        hetero.best_plans(cfg, classes, policies=("ratrain",))


def test_uniform_like_keeps_the_total_compute():
    cfg, classes = mixed()
    uni = hetero.uniform_like(cfg, classes)
    (one,) = uni.platform.classes
    assert one.compute_flops * 8 == pytest.approx(4 * 4.5e12 + 4 * 2.25e12)
    assert hetero.halves(cfg, 2.0).platform.classes[1].compute_flops == 2 * 4.5e12


def test_the_command_shows_the_partition_beside_the_symmetric_plan(tmp_path, capsys):
    cfg, _ = mixed(m=3)
    job = tmp_path / "mixed.yaml"
    job.write_text(cfg.to_yaml())
    assert plan_main(["--config", str(job), "--policy", "ratrain"]) == 0
    out = capsys.readouterr().out
    assert "planner's choice:" in out and "best symmetric:" in out
    assert "micro-batches per replica [4 x4, 2 x4]" in out and "choice / symmetric:" in out
    assert plan_main(["--config", str(job), "--policy", "ratrain", "--mixed", "2"]) == 0
    assert "mixed / uniform:" in capsys.readouterr().out
