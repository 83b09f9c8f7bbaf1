"""Optimizer state sharded over dp (ratrain, ZeRO-1 per block), without MPI: segments are the
ring's, the union of the replicas' segments is the whole state, a segment update is bitwise the
whole-block update, the schedule is legal and drawn, the memory model sees the saving."""

from dataclasses import replace

import numpy as np
import pytest

from ratrain.config import OptimConfig, ScheduleConfig
from ratrain.exec.optim import AdamW, global_grad_norm
from ratrain.exec.params import STATE_BUFFERS, StageState, segment_bounds
from ratrain.exec.spec import stage_blocks
from ratrain.lifecycle.grid import grid
from ratrain.lifecycle.policies import Policy, StageInfo, policy_of
from ratrain.lifecycle.schedule import MaterializeView, SyncGrad, WaitView
from ratrain.lifecycle.validate import ScheduleError, check_lifecycle, validate_policy
from ratrain.lifecycle.memory import StageSizes, choose_recompute, simulate_peak
from ratrain.shim.ledger import Ledger
from tests._executor_util import MODEL


def states(p, precision="fp32", pp=1, stage=0):
    """The whole-block state and the p replicas' sharded states of one stage (same seed)."""
    blocks = stage_blocks(MODEL, pp, stage)
    whole = StageState(blocks, precision, Ledger(None), np, 7)
    shards = [StageState(blocks, precision, Ledger(None), np, 7, shard=(q, p)) for q in range(p)]
    return whole, shards


def test_segments_are_the_rings():
    from ratrain.comm.collectives import segments

    for n in (0, 1, 2, 5, 17, 1000):
        for p in (1, 2, 3, 4, 7):
            b = segments(n, p)
            assert [segment_bounds(n, q, p) for q in range(p)] == [(b[q], b[q + 1]) for q in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_sharded_state_holds_its_segments(p):
    whole, shards = states(p)
    for kind in STATE_BUFFERS:
        whole.buffer(kind)[:] = np.random.default_rng(len(kind)).standard_normal(whole.size)
    full = {k: {n: np.array(a) for n, a in whole.named(k)} for k in STATE_BUFFERS}
    for q, st in enumerate(shards):
        st.load_state_dict(full)
        assert st.held_size == sum(np.diff(segment_bounds(b.size, q, p)) for b in st.blocks)
        assert st.ledger.by_tag()["params.master"] == 4 * st.held_size
        for b in st.block_names:
            lo, hi = st.segment(b)
            for k in STATE_BUFFERS:
                assert np.array_equal(st.flat(k, b), whole.flat(k, b)[lo:hi])
        with pytest.raises(RuntimeError, match="sharded"):
            st.state_dict()
    # shard() in place keeps the same segments as a state built sharded
    for q, st in enumerate(shards):
        conv = StageState(whole.blocks, "fp32", Ledger(None), np, 7)
        conv.load_state_dict(full)
        conv.shard(q, p)
        for k in STATE_BUFFERS:
            assert np.array_equal(conv.buffer(k), st.buffer(k))
        assert conv.ledger.current == st.ledger.current
    # init from the seed is the same split
    w0, s0 = states(p)
    assert np.array_equal(np.concatenate([np.concatenate([s.flat("master", b) for s in s0])
                                          for b in w0.block_names]), w0.master_buf)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("p", [2, 3])
def test_segment_update_is_bitwise_the_whole_update(p, precision):
    # decay exemptions (norms) fall inside and across segment boundaries
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, no_decay=("*norm*",))
    whole, shards = states(p, precision)
    ow, os_ = AdamW(cfg), [AdamW(cfg) for _ in shards]
    rng = np.random.default_rng(0)
    for t in (1, 2, 3):
        for b in whole.block_names:
            g = rng.standard_normal(whole.block(b).size).astype(np.float32)
            whole.alloc_grad(b)[:] = g
            ow.update_block(whole, b, t, 1e-2, 0.5)
            whole.free_grad(b)
            for st, o in zip(shards, os_):
                st.alloc_grad(b)[:] = g  # the reduce-scatter's result, on every segment
                st.shrink_grad(b)
                assert st.ledger.by_tag()[f"grads.{b}"] == 4 * st.grad_segment(b).size
                o.update_block(st, b, t, 1e-2, 0.5)
                st.free_grad(b)
    for b in whole.block_names:
        for k in STATE_BUFFERS:
            union = np.concatenate([st.flat(k, b) for st in shards])
            assert np.array_equal(union, whole.flat(k, b)), (b, k)
        # the view: own segment cast, the rest is what the all-gather brings
        views = [st.materialize_view(b).copy() for st in shards]
        for q, st in enumerate(shards):
            lo, hi = st.segment(b)
            views[0][lo:hi] = views[q][lo:hi]
        assert np.array_equal(views[0], whole.materialize_view(b))


def test_norm_partials_add_segments_then_blocks():
    assert global_grad_norm([1.0, 2.0, 3.0, 4.0], segments=2) == np.sqrt((1.0 + 2.0) + (3.0 + 4.0))
    assert global_grad_norm([9.0, 16.0]) == 5.0
    with pytest.raises(ValueError):
        global_grad_norm([1.0, 2.0, 3.0], segments=2)


def infos(pp, m, precision="fp16", shards=2, per_stage=2):
    out = []
    for s in range(pp):
        blocks = (["embed"] if s == 0 else []) + [
            f"layers.{i}" for i in range(per_stage * s, per_stage * (s + 1))
        ] + (["head"] if s == pp - 1 else [])
        out.append(StageInfo(pp, s, m, tuple(blocks), tuple(100 for _ in blocks), precision, shards))
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_sharded_ratrain_validates(pp, precision):
    for m in range(1, 7):
        validate_policy(Policy("ratrain"), infos(pp, m, precision, shards=3), steps=3)
    with pytest.raises(ValueError, match="only a sharding policy shards it"):
        Policy("baseline-1f1b").build_step(infos(pp, 2, precision)[0])
    assert Policy("ratrain").shards(4) == 4
    assert policy_of(ScheduleConfig(shard_optimizer=False)).shards(4) == 1
    assert Policy("megatron-1f1b").shards(4) == 1 and Policy("ratrain").shards(1) == 1


def test_sharded_schedule_places_gathers_and_scatters():
    info = infos(2, 4, "fp32")[1]
    lists = Policy("ratrain").steps(info, 2)
    step = lists[1]
    # every view is gathered at step start (after the block's update) and waited for just
    # before the block's first forward; every sync is a reduce-scatter
    gathers = [a for a in step if isinstance(a, MaterializeView)]
    assert [a.block for a in gathers] == list(info.blocks) and all(a.gather for a in gathers)
    first_fwd = next(a for a in step if type(a).__name__ == "Forward")
    assert [h for b, h in first_fwd.pre] == [WaitView(b) for b in info.blocks]
    syncs = [h for a in step if type(a).__name__ == "Backward" for _, h in a.post
             if isinstance(h, SyncGrad)]
    assert syncs and all(s.scatter for s in syncs)
    text = grid([Policy("ratrain").steps(i, 2)[1] for i in infos(2, 4, "fp32")],
                [i.blocks for i in infos(2, 4, "fp32")])
    assert "gather-view L2" in text and "wait-view L2" in text and "sync-scatter L2" in text

    def broken(drop):
        return [tuple(a if type(a).__name__ != "Forward" else
                      replace(a, pre=tuple((b, h) for b, h in a.pre if not drop(h)))
                      for a in lst) for lst in lists]

    with pytest.raises(ScheduleError, match="all-gather was waited"):
        check_lifecycle(broken(lambda h: isinstance(h, WaitView)), info.blocks, 4, 1, False, True)
    with pytest.raises(ScheduleError, match="sharded"):  # a sharded stage must scatter
        check_lifecycle(lists, info.blocks, 4, 1, False, False)


def _sizes(precision, shards, params, keep=None):
    act = {b: ({"none": 20000, "full": 1000} if b.startswith("layers.") else {"none": 10})
           for b in params}
    return StageSizes(precision, params, act, {b: a["none"] for b, a in act.items()},
                      message_bytes=100, recompute=keep or {}, shards=shards)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_memory_model_sees_the_sharded_state(precision):
    pp, m, dp = 2, 4, 4
    for s, info in enumerate(infos(pp, m, precision, shards=1)):
        params = {b: 10_000 for b in info.blocks}
        base = simulate_peak(Policy("baseline-1f1b").steps(info, 2, flush=False), info.blocks,
                             _sizes(precision, 1, params))
        sinfo = replace(info, shards=dp)
        ours = simulate_peak(Policy("ratrain").steps(sinfo, 2, flush=False), info.blocks,
                             _sizes(precision, dp, params))
        assert ours < base, (s, ours, base)
        # a cap where the baseline must recompute every layer: ratrain recomputes fewer
        lists_b = Policy("baseline-1f1b").steps(info, 2, flush=False)
        lists_r = Policy("ratrain").steps(sinfo, 2, flush=False)
        full_b = choose_recompute(0, _sizes(precision, 1, params), lists_b, info.blocks)[1]
        kb, _ = choose_recompute(full_b, _sizes(precision, 1, params), lists_b, info.blocks)
        kr, pr = choose_recompute(full_b, _sizes(precision, dp, params), lists_r, info.blocks)
        layers = [b for b in info.blocks if b.startswith("layers.")]
        assert all(kb[b] == "full" for b in layers) and pr <= full_b
        assert sum(kr[b] == "full" for b in layers) < len(layers)
