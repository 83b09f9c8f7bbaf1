"""Rank classes of a heterogeneous cluster (`platform.classes`) and unequal replica shares
(`parallel.replica_shares`): the config's refusals, each rank's class and profile, the data each
replica reads. (The planner's choices: tests/test_plan_hetero.py; MPI runs:
tests/test_hetero_mpi.py.)"""

import numpy as np
import pytest

from ratrain.config import ConfigError, config_from_dict
from ratrain.data import TokenDataset, write_tokens
from ratrain.runtime.facts import FactsLayout
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.plan.hetero import resolve, with_measured_rates
from ratrain.shim.pacing import Pacer
from ratrain.shim.platform import ProfileError, class_map, class_profile, rank_profile

MODEL = {"vocab_size": 64, "hidden": 32, "layers": 4, "heads": 4, "kv_heads": 2,
         "ffn_hidden": 64, "seq_len": 16}
FAST = {"name": "fast", "ranks": [0, 1], "compute_flops": 2e9, "ddr_bandwidth": 4e9}
SLOW = {"name": "slow", "hosts": ["slow*"], "compute_flops": 1e9, "ddr_bytes": 2**30}


def cfg_of(parallel=None, classes=(FAST, SLOW), **platform):
    return config_from_dict({
        "model": MODEL,
        "parallel": {"pp": 2, "dp": 2, "micro_batch": 2, "num_micro_batches": 3,
                     **(parallel or {})},
        "platform": {"profile": "mt3000", "classes": list(classes), **platform},
    })


# -- the config's refusals: one line naming the key -----------------------------------------


@pytest.mark.parametrize("parallel,key", [
    ({"replica_shares": [4, 1]}, "parallel.replica_shares=[4, 1] adds up to 5"),
    ({"replica_shares": [6]}, "parallel.replica_shares=[6] has 1 entries but parallel.dp=2"),
    ({"replica_shares": [6, 0]}, "every replica needs at least one micro-batch"),
    ({"replica_shares": "some"}, "parallel.replica_shares='some' is not a list"),
    ({"layers_per_stage": "even"}, "parallel.layers_per_stage='even' is not a list"),
])
def test_bad_parallel_keys_are_refused_naming_the_key(parallel, key):
    with pytest.raises(ConfigError) as e:
        cfg_of(parallel)
    assert key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("classes,msg", [
    ([FAST, dict(FAST)], "the name 'fast' is given twice"),
    ([FAST, {"name": "slow", "ranks": [1, 2]}], "rank 1 is in both fast and slow"),
    ([{"name": "x"}], "platform.classes[0] (x) has neither ranks nor hosts"),
    ([{"ranks": [0]}], "platform.classes[0].name is empty"),
    ([{"name": "x", "ranks": [0], "compute_flops": -1}], "platform.classes[0].compute_flops=-1.0"),
])
def test_bad_classes_are_refused_naming_the_key(classes, msg):
    with pytest.raises(ConfigError) as e:
        cfg_of(classes=classes)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_auto_and_lists_parse_and_unresolved_auto_is_refused_where_used():
    cfg = cfg_of({"layers_per_stage": "auto", "replica_shares": "auto"})
    assert cfg.parallel.auto == ("layers_per_stage", "replica_shares")
    with pytest.raises(ConfigError, match="replica_shares=auto is not resolved"):
        cfg.parallel.micro_batches_of(0)
    with pytest.raises(ConfigError, match="replica_shares=auto is not resolved"):
        PipelinePlan.from_config(cfg)
    with pytest.raises(ConfigError, match="layers_per_stage=auto is not resolved"):
        PipelinePlan.from_config(cfg, m=3)
    cfg = cfg_of({"layers_per_stage": "3,1", "replica_shares": [4, 2]})  # --set's form too
    assert cfg.parallel.layers_per_stage == (3, 1) and cfg.parallel.shares == (4, 2)
    assert [cfg.parallel.share_offset(r) for r in range(2)] == [0, 4]


# -- each rank's class -------------------------------------------------------------------------


def test_class_map_by_ranks_then_hosts():
    cfg = cfg_of()
    assert class_map(cfg.platform, ["fast-a", "fast-a", "slow-1", "slow-2"]) == (
        "fast", "fast", "slow", "slow")
    with pytest.raises(ProfileError, match=r"rank 3 \(node 'other'\) is in no class"):
        class_map(cfg.platform, ["a", "a", "slow-1", "other"])
    with pytest.raises(ProfileError, match="lists rank 1 but the world has 1 ranks"):
        class_map(cfg.platform, ["slow-1"])
    two = cfg_of(classes=[FAST, SLOW, {"name": "any", "hosts": ["*"]}])
    with pytest.raises(ProfileError, match="matches the hosts of slow and any"):
        class_map(two.platform, ["a", "a", "slow-1", "b"])
    assert class_map(cfg_of(classes=()).platform, ["a"]) is None


def test_a_rank_plays_its_class_profile_and_is_paced_to_it():
    cfg = cfg_of(emulate=True, time_scale=10.0)
    base = class_profile(cfg.platform, None)
    fast = rank_profile(cfg.platform, 0, "anything")
    slow = rank_profile(cfg.platform, 2, "slow-7")
    assert fast.compute_flops == 2e9 and slow.compute_flops == 1e9
    assert fast.fact("ddr_bandwidth").value == 4e9
    assert slow.ddr_bytes == 2**30 and fast.ddr_bytes == base.ddr_bytes
    assert "platform.classes.slow" in slow.source("compute_flops")
    # the pacer of each pads the same work to its own rate
    assert Pacer(slow).target(1e9) == 2 * Pacer(fast).target(1e9) == pytest.approx(10.0)


def test_calibrated_class_takes_its_slowest_rank():
    cfg = cfg_of(classes=[dict(FAST, calibrate=True), SLOW])
    out = with_measured_rates(cfg, ("fast", "fast", "slow", "slow"), [5e9, 3e9, 1e9, 1e9])
    fast = out.platform.classes[0]
    assert fast.compute_flops == 3e9 and not fast.calibrate
    assert out.platform.classes[1] == cfg.platform.classes[1]


def test_resolve_gives_fast_replicas_more_and_keeps_the_global_batch():
    cfg = cfg_of({"replica_shares": "auto", "placement": "pp"})
    out = resolve(cfg, ("fast", "fast", "slow", "slow"))  # replica 0 fast, replica 1 slow
    assert out.parallel.replica_shares == (4, 2)
    assert out.parallel.layers_per_stage is None
    assert resolve(cfg_of(), ("fast",) * 4) == cfg_of()  # nothing on auto: unchanged


# -- the data each replica reads and the facts it reports ----------------------------------


def test_unequal_shares_read_the_same_global_batch(tmp_path):
    path = tmp_path / "t.bin"
    write_tokens(path, np.arange(4000) % 64, vocab_size=64)
    even = TokenDataset(path, 16, 64, dp=2, micro_batch=2, num_micro_batches=3)
    uneven = TokenDataset(path, 16, 64, dp=2, micro_batch=2, num_micro_batches=3, shares=(5, 1))
    for step in (0, 3):
        whole = np.concatenate([even.batch_for_step(step, r)[0] for r in range(2)])
        parts = [uneven.batch_for_step(step, r)[0] for r in range(2)]
        assert [len(p) for p in parts] == [5, 1]
        assert np.array_equal(np.concatenate(parts), whole)
        assert np.array_equal(uneven.micro_batch(step, 1, 0)[0], whole[5])


def test_facts_place_losses_by_global_micro_batch():
    lay = FactsLayout(blocks=2, dp=2, shares=(3, 1), world=2)
    vec = lay.vector()
    for r, mb, loss in ((0, 0, 1.0), (0, 1, 2.0), (0, 2, 3.0), (1, 0, 6.0)):
        lay.put_loss(vec, r, mb, loss)
    assert lay.nl == 4 and lay.mean_loss(vec) == 3.0
    assert vec[lay.nb + 3] == 6.0


def test_hosts_take_slurm_node_lists_and_shell_patterns():
    from ratrain.shim.platform import expand_hostlist, host_matches

    assert expand_hostlist("cn[08-10,12]") == ["cn08", "cn09", "cn10", "cn12"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert host_matches("cn09", "cn[08-10]") and not host_matches("cn11", "cn[08-10]")
    assert not host_matches("cn9", "cn[08-10]")  # the padding is part of the name
    assert host_matches("rtc-n2", "*-n2") and host_matches("gpu3", "gpu[0-9]")
    cfg = cfg_of(classes=[FAST, {"name": "old", "hosts": ["cn[01-02]"]}])
    assert class_map(cfg.platform, ["x", "x", "cn01", "cn02"])[2:] == ("old", "old")


def test_ranks_take_ranges():
    cfg = cfg_of(classes=[{"name": "a", "ranks": "0-1"}, {"name": "b", "ranks": "2,3"}])
    assert [c.ranks for c in cfg.platform.classes] == [(0, 1), (2, 3)]
    for bad, msg in (("0-x", "is not a list of ranks or of ranges"), ("3-1", "runs backwards")):
        with pytest.raises(ConfigError, match=msg):
            cfg_of(classes=[{"name": "a", "ranks": bad}])
