"""Offload to the memory tier (issue 31): the same training with and without it, the actions'
placement and their checks, the recovery choice under the DDR cap, the DDR peak it saves, the
tier's files and its faults. MPI equivalence at pp 2 x dp 2: tests/test_offload_mpi.py."""

from __future__ import annotations

import errno
import os
from dataclasses import replace

import numpy as np
import pytest

from ratrain.config import ConfigError, OffloadConfig, PlatformConfig, ScheduleConfig, load_config
from ratrain.exec.spec import OFFLOAD, block_role
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.passes import offload as off
from ratrain.lifecycle.passes.offload import OffloadPass, TierCheck, place
from ratrain.lifecycle.pipeline import PipelinePlan, stage_block_names
from ratrain.lifecycle.recovery import hidden_layers
from ratrain.lifecycle.validate import ScheduleError, check_lifecycle
from ratrain.shim.tier import TierFull, TierLedger
from ratrain.shim.tierstore import TierError, TierStore
from tests._executor_util import params_digest, tiny_config, train

POLICIES = ("baseline-1f1b", "megatron-1f1b", "ratrain")


def _with_tier(cfg, path, **kw):
    return replace(cfg, offload=OffloadConfig(path=str(path), **kw))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_offload_is_bitwise_the_run_without_under_every_policy(precision, tmp_path):
    state = "masters" if precision == "fp16" else "moments"
    variants = {"activations": {"activations": "all"}, "optimizer": {"optimizer": state},
                "both": {"activations": "all", "optimizer": state}}
    ref = None
    for policy in POLICIES:
        base = tiny_config(precision=precision, policy=policy, steps=3)
        runs = {"none": base} if ref is None else {}
        runs.update({k: _with_tier(base, tmp_path, **v) for k, v in variants.items()})
        for name, cfg in runs.items():
            res, _, ex = train(cfg)
            got = ([(r.loss, r.grad_norm, r.skipped) for r in res], params_digest(ex.final_params))
            ref = ref or got
            assert got == ref, (policy, name)
    assert os.listdir(tmp_path) == []  # the tier's files are gone with the run


def test_activations_offload_on_a_device_twin(tmp_path):
    base = tiny_config(precision="fp16", steps=2)
    base = replace(base, run=replace(base.run, device="standin"))
    res, _, ex = train(base)
    got, _, ex2 = train(_with_tier(base, tmp_path, activations="all"))
    assert [r.loss for r in res] == [r.loss for r in got]
    assert params_digest(ex.final_params) == params_digest(ex2.final_params)


def _plan(policy="ratrain", pp=2, m=4, dp=1, precision="fp16", state="off", offload_all=True):
    cfg = tiny_config(pp=pp, dp=dp, m=m, precision=precision, policy=policy)
    layers = [tuple(b for b in names if block_role(b) == "layer") if offload_all else ()
              for names in stage_block_names(cfg.model, pp)]
    return PipelinePlan.of_model(cfg.model, PipelinePlan.from_config(cfg).policy, pp, dp, m,
                                 precision, passes=(OffloadPass(layers, state),))


def _events(actions, blocks):
    return [(blk, e) for a in actions for blk, e in sched.expand(a, blocks)]


@pytest.mark.parametrize("policy", POLICIES)
def test_transfers_sit_around_their_compute_double_buffered(policy):
    plan = _plan(policy, dp=2, state="masters")  # validated when made (TierCheck included)
    for s, info in enumerate(plan.stages):
        names = _events(plan.step_list(s, carry=True), info.blocks)
        for i, (_, e) in enumerate(names):
            if isinstance(e, off.Offload) and e.what == "act":
                # right after its own forward (its own hooks between)
                back = next(j for j in range(i - 1, -1, -1) if names[j][0] is not None)
                assert names[back][0] == e.block and isinstance(names[back][1], sched.Forward)
            if isinstance(e, off.WaitFetch) and e.what == "act":
                ahead = next(j for j in range(i + 1, len(names)) if names[j][0] is not None)
                assert names[ahead][0] == e.block and isinstance(names[ahead][1], sched.Backward)
            if isinstance(e, sched.Update):
                assert isinstance(names[i - 1][1], (off.Fetch, off.WaitFetch))


def test_the_validator_refuses_a_backward_before_its_fetch():
    plan = _plan("baseline-1f1b", pp=1, m=2)
    info = plan.stages[0]
    # leave out the read of layer 1's activations of micro-batch 0: its backward finds nothing
    gone = (off.Fetch("layers.1", 0), off.WaitFetch("layers.1", 0))
    bad = [replace(a, pre=tuple(h for h in a.pre if h[1] not in gone),
                   post=tuple(h for h in a.post if h[1] not in gone))
           if a.group == "compute" else a for a in plan.step_list(0) if a not in gone]
    with pytest.raises(ScheduleError, match="before its activations are back"):
        check_lifecycle([bad], info.blocks, info.num_micro_batches, 0, True, False, plan.passes)
    # and a second write started before the first is waited for: not double-buffered
    check = TierCheck(lambda e, msg: (_ for _ in ()).throw(ScheduleError(msg)), ("layers.0", "layers.1"))
    check.before("layers.0", sched.Forward(0))
    check.before("layers.1", sched.Forward(0))
    check._move(off.Offload("layers.0", 0), "layers.0", None)
    with pytest.raises(ScheduleError, match="double-buffered"):
        check._move(off.Offload("layers.1", 0), "layers.1", None)
    # without the pass, its actions reach an interpreter that has no handler for them
    with pytest.raises(TypeError, match="no handler for Offload"):
        check_lifecycle([plan.step_list(0)], info.blocks, info.num_micro_batches, 0, True, False)


def test_placement_is_pure_and_leaves_lists_without_a_tier_alone():
    plan = _plan(offload_all=False)
    for s, info in enumerate(plan.stages):
        lst = plan.step_list(s, True)
        assert place(lst, info.blocks) == lst
        assert not any(type(e) in off.TIER_ACTIONS for _, e in _events(lst, info.blocks))


def test_config_rules():
    with pytest.raises(ConfigError, match="schedule.recompute=auto"):
        load_config("tiny", ["offload.activations=prefer"])
    with pytest.raises(ConfigError, match="schedule.recompute=none"):
        load_config("tiny", ["offload.activations=all", "schedule.recompute=full"])
    cfg = load_config("tiny", ["offload.optimizer=off", "offload.activations=off"])
    assert cfg.offload == OffloadConfig() and not cfg.offload.enabled
    with pytest.raises(ValueError, match="masters"):
        _plan("baseline-1f1b", precision="fp32", state="masters")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_layers_cache_from_shapes_is_what_the_kernels_keep(precision):
    from ratrain.exec import layers
    from ratrain.exec.context import ExecContext
    from ratrain.exec.params import StageState
    from ratrain.exec.spec import stage_blocks
    from ratrain.shim.ledger import Ledger

    cfg = tiny_config(precision=precision)
    ctx = ExecContext(cfg.model, precision, np, ledger=Ledger(), threads=1)
    state = StageState(stage_blocks(cfg.model, 1, 0), precision, ctx.ledger)
    state.materialize_view("layers.0")
    x = np.zeros((3, cfg.model.seq_len, cfg.model.hidden), ctx.dtype)
    for rec in ("none", "selective", "full"):
        cache = layers.layer_forward(x, state.view("layers.0"), ctx, rec)[1]
        assert layers.cache_nbytes(cache) == layers.layer_cache_nbytes(cfg.model, 3, precision,
                                                                       rec), rec
    ctx.close()


def test_hidden_layers_weighs_the_tier_against_compute():
    assert hidden_layers(4, 100, 1.0, None) == 4  # not modelled: free
    assert hidden_layers(4, 100, 1.0, 800.0) == 4  # 0.25 s per layer and micro-batch
    assert hidden_layers(4, 100, 1.0, 400.0) == 2
    assert hidden_layers(4, 100, 1.0, 400.0, sharing=2) == 1  # the node's ranks share it
    assert hidden_layers(4, 100, 0.1, 400.0) == 0


def _cap_between(cfg, tmp_path):
    """A DDR cap the tiny job's stage fits only with some layers out of the DDR."""
    from ratrain.runtime.rank import build_rank

    peaks = []
    for rec in ("none", "full"):
        c = replace(cfg, schedule=replace(cfg.schedule, recompute=rec))
        rank = build_rank(c, None, cap=None)
        peaks.append(rank.executor.predicted_peak)
        rank.close()
    return (peaks[0] + peaks[1]) // 2


def test_recompute_auto_keeps_recomputes_or_offloads_under_the_cap(tmp_path):
    from ratrain.runtime.rank import build_rank

    base = tiny_config(precision="fp16", policy="baseline-1f1b", m=3, steps=2)
    base = replace(base, schedule=replace(base.schedule, recompute="auto"))
    cap = _cap_between(base, tmp_path)
    ref, _, _ = train(replace(base, schedule=replace(base.schedule, recompute="none")))
    seen = {}
    for mode in ("off", "prefer"):
        cfg = _with_tier(base, tmp_path, activations=mode)
        rank = build_rank(cfg, None, cap=cap)
        ex = rank.executor
        seen[mode] = sorted(set(ex.recovery.values()))
        assert ex.predicted_peak <= cap
        rank.close()
        res, _, _ = train(cfg, cap=cap)  # the ledger would refuse going over the cap
        assert [r.loss for r in res] == [r.loss for r in ref]
        assert max(r.peak_ddr_bytes for r in res) <= cap
    assert "full" in seen["off"] and OFFLOAD not in seen["off"]
    assert OFFLOAD in seen["prefer"] and "full" not in seen["prefer"]


def test_the_ddr_peak_drops_by_the_offloaded_bytes_less_the_double_buffer(tmp_path):
    """Offloaded: the activation bytes in the tier when the DDR peaks; the double buffer: a
    layer's activations being written and one being read."""
    from ratrain.exec import layers
    from ratrain.runtime.rank import build_rank

    cfg = tiny_config(precision="fp32", policy="baseline-1f1b", m=2, steps=1)
    base, _, _ = train(cfg)
    rank = build_rank(_with_tier(cfg, tmp_path, activations="all"), None, cap=None)
    ex, ledger = rank.executor, rank.ledger
    tier, seen, reserve = ex.offloader.store.ledger, {"peak": 0, "tier": 0}, ledger.reserve

    def watched(tag, nbytes):  # the tier's activation bytes at each new DDR peak
        reserve(tag, nbytes)
        if ledger.current > seen["peak"]:
            seen.update(peak=ledger.current, tier=tier.in_use("tier.act"))

    ledger.reserve = watched
    res = ex.run_step(0, _batch(cfg))
    x = np.zeros(ex.act_shape, np.float32)
    layer = layers.cache_nbytes(layers.layer_forward(x, rank.state.view("layers.0"), rank.ctx)[1])
    rank.close()
    drop = base[0].peak_ddr_bytes - res.peak_ddr_bytes
    offloaded = seen["tier"] // (-(-layer // 4096) * 4096) * layer  # extents are whole pages
    assert offloaded >= 2 * layer and drop >= offloaded - 2 * layer, (drop, offloaded, layer)


def _batch(cfg):
    from tests._executor_util import global_batch

    return global_batch(cfg, 0)


def test_store_files_extents_cap_and_failures(tmp_path):
    ledger = TierLedger(3 * 4096, 0, str(tmp_path), "offload.path", "nvme")
    store = TierStore(str(tmp_path), 0, ledger)
    try:
        assert os.listdir(tmp_path) == []  # unlinked at once: nothing left, ever
        a = store.region("act", "a", 5000)  # two pages
        a[:] = 7
        store.copy([(store.region("act", "b", 10), np.arange(10, dtype=np.uint8))]).result()
        assert list(store.view("b", 10)) == list(range(10))
        with pytest.raises(TierFull, match=r"offload.path.*platform.tier_bytes|platform.tier_bytes.*offload.path"):
            store.region("act", "c", 4096)
        store.free("a")
        store.region("act", "c", 8192)  # the freed pages again
        bad = store.copy([(np.zeros(2, np.uint8), np.zeros(3, np.uint8))])
        with pytest.raises(ValueError):
            bad.result()

        def fails():
            raise OSError(errno.ENOSPC, "No space left on device")

        err = store.copy([], before=fails).exception()
        assert isinstance(err, TierError) and "offload.path=" + str(tmp_path) in str(err)
        assert "\n" not in str(err)
    finally:
        store.close()


def test_start_up_refuses_a_missing_or_too_small_tier(tmp_path):
    from ratrain.train.startup import check_tier

    cfg = _with_tier(tiny_config(), tmp_path / "nope", activations="all")
    with pytest.raises(OSError, match=r"offload.path=.*nope does not exist"):
        check_tier(cfg, 0)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="is not a directory"):
        check_tier(_with_tier(tiny_config(), tmp_path / "file", activations="all"), 0)
    small = replace(_with_tier(tiny_config(), tmp_path, activations="all"),
                    platform=PlatformConfig(tier_bytes=4096))
    with pytest.raises(OSError, match="platform.tier_bytes"):
        check_tier(small, 0)
    check_tier(_with_tier(tiny_config(), tmp_path, activations="all"), 0)


def test_schedule_config_untouched_by_offload_defaults():
    assert ScheduleConfig().recompute == "none" and OffloadConfig().activations == "off"
