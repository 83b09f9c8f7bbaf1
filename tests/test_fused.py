"""The fused fast path (numba, the `fast` extra) against the numpy reference it replaces."""

from dataclasses import replace

import numpy as np
import pytest

from ratrain.config import ModelConfig, OptimConfig
from ratrain.exec import fused, kernels
from ratrain.exec.backends import kernel_table
from ratrain.exec.optim import AdamW
from ratrain.exec.params import StageState
from ratrain.exec.spec import stage_blocks
from ratrain.shim.ledger import Ledger
from tests._prereq import need_fast
RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def _numba():
    need_fast()  # a failure under CI when numba is missing


def rand(*shape):
    return RNG.standard_normal(shape, dtype=np.float32)


def both(fn):
    """(fused result, reference result) of fn(module): `fused`'s entry, then `kernels`'."""
    return fn(fused), fn(kernels)


def test_the_host_table_takes_the_fused_kernels_where_they_apply():
    on, off = kernel_table(np, "fp32"), kernel_table(np, "fp32", fused_mode="off")
    assert on.rmsnorm_forward is fused.rmsnorm_forward and on.adamw is fused.adamw
    assert off.rmsnorm_forward is kernels.rmsnorm_forward and off.adamw is None
    assert on.names["rope"] == "fused" and off.names["rope"] == "numpy"
    half = kernel_table(np, "fp16")  # the norms' weights are fp16 views: the reference's
    assert half.names["rmsnorm"] == "numpy" and half.names["swiglu"] == "fused"
    assert kernel_table(np, "fp64").names["swiglu"] == "numpy"
    # what a fused entry does not take goes to the reference: float64, fp16 weights
    x, w = rand(3, 8).astype(np.float64), rand(8)
    np.testing.assert_array_equal(fused.rmsnorm_forward(x, w, 1e-5, np)[0],
                                  kernels.rmsnorm_forward(x, w, 1e-5, np)[0])


def test_swiglu_forward_and_backward_on_strided_halves():
    gu, dact = rand(33, 2 * 40), rand(33, 40)
    gate, up = gu[:, :40], gu[:, 40:]  # the layer's views: strided
    (a, _), (ra, _) = both(lambda k: k.swiglu_forward(gate, up, np))
    np.testing.assert_array_equal(a, ra)
    f, r = both(lambda k: k.swiglu_backward(dact, (gate, up), np, with_act=True))
    for x, y in zip(f, r):
        np.testing.assert_array_equal(x, y)
    out = (np.empty((33, 40), np.float32), np.empty((33, 40), np.float32))
    got = fused.swiglu_backward(dact, (gate, up), np, out=out)
    assert got[0] is out[0] and got[1] is out[1]


def test_rmsnorm_forward_and_backward():
    x, w, dy = rand(2, 7, 48), rand(48), rand(2, 7, 48)
    (y, c), (ry, rc) = both(lambda k: k.rmsnorm_forward(x, w, 1e-5, np))
    np.testing.assert_allclose(y, ry, rtol=3e-6, atol=1e-6)
    np.testing.assert_allclose(c[1], rc[1], rtol=3e-6)
    (dx, dw), (rdx, rdw) = both(lambda k: k.rmsnorm_backward(dy, rc, np))
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dw, rdw)  # summed over rows in the same order


@pytest.mark.parametrize("backward", [False, True])
def test_rope_bitwise_on_the_layers_layout(backward):
    b, T, H, D = 2, 9, 3, 8
    cos, sin = kernels.rope_tables(T, D, 10000.0)
    cos3, sin3 = cos[:, None, :], sin[:, None, :]
    qkv = rand(b * T, 5 * H * D)
    x = qkv[:, H * D : 2 * H * D].reshape(b, T, H, D)  # a strided view, as in the layer
    dst = np.empty((b, H, T, D), np.float32).transpose(0, 2, 1, 3)

    def run(k):
        out = dst.copy()
        if backward:
            k.rope_backward(x, (cos3, sin3), np, out=out)
        else:
            k.rope_forward(x, cos3, sin3, np, out=out)
        return out

    f, r = both(run)
    np.testing.assert_array_equal(f, r)


@pytest.mark.parametrize("lr,wd,grad_scale", [(1e-2, 0.1, 0.37), (3e-4, 0.0, 1.0)])
def test_adamw_bitwise(lr, wd, grad_scale):
    model = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=64,
                        seq_len=8)
    cfg = OptimConfig(weight_decay=wd, no_decay=("*norm*",))
    states = []
    for mode in ("on", "off"):
        st = StageState(stage_blocks(model, 1, 0), "fp32", Ledger(), np, 3)
        opt = AdamW(cfg, kernel_table(np, fused_mode=mode))
        for t in (1, 2, 3):
            for b in st.block_names:
                st.alloc_grad(b)
                st.grad_flat(b)[:] = np.random.default_rng(t).standard_normal(st.grad_flat(b).size)
                opt.update_block(st, b, t, lr, grad_scale)
                st.free_grad(b)
        states.append(st)
    for buf in ("master", "m", "v"):
        np.testing.assert_array_equal(states[0].buffer(buf), states[1].buffer(buf), err_msg=buf)


def test_half_casts_are_numpys_for_every_kind_of_float32():
    # every exponent with edge and random mantissas (ties, subnormals, overflow, inf, NaN
    # payloads), and a slice of consecutive bit patterns around the subnormal boundary
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.concatenate([np.array([0, 1, 0xFFF, 0x1000, 0x1FFF, 0x2000, 0x3000, 0x7FE000,
                                      0x7FF000, 0x7FFFFF], np.uint32),
                            RNG.integers(0, 1 << 23, 200).astype(np.uint32)])
    bits = (exps[:, None] | mants[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(1 << 31),
                           np.arange(0x33000000, 0x38900000, 997, dtype=np.uint32)])
    f = bits.view(np.float32)
    with np.errstate(all="ignore"):
        ref = f.astype(np.float16)
    got = np.empty_like(ref)
    assert fused.cast_into(got, f)
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
    every_half = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    back = fused.cast(every_half, np.float32)
    np.testing.assert_array_equal(back.view(np.uint32), every_half.astype(np.float32).view(np.uint32))
    # what does not apply is left to the caller
    assert not fused.cast_into(np.empty(4, np.float16), np.zeros(8, np.float32)[::2])
    assert not fused.cast_into(np.empty(4, np.float64), np.zeros(4, np.float32))


def test_fp16_layers_are_bitwise_the_reference():
    from tests._executor_util import tiny_config, train

    cfg = tiny_config(pp=1, dp=1, m=2, precision="fp16", steps=2)
    res, _, ex = train(cfg, None)
    assert ex.ctx.kernels.names["swiglu"] == "fused"
    ref, _, ref_ex = train(replace(cfg, run=replace(cfg.run, fused="off")), None)
    assert ref_ex.ctx.kernels.names["swiglu"] == "numpy"
    assert [(r.loss, r.grad_norm) for r in res] == [(r.loss, r.grad_norm) for r in ref]
    for name, arr in ex.final_params.items():
        np.testing.assert_array_equal(arr, ref_ex.final_params[name])
