"""The device kernels (`ratrain.exec.devkernels`, numba-cuda; and those no run calls yet,
tests/_unwired_devkernels.py) against the numpy reference (`exec.kernels`).

Under the simulator (NUMBA_ENABLE_CUDASIM=1, tests/conftest.py's default: CI has no GPU) the
kernels run on numpy arrays, one Python thread per CUDA thread, so the shapes are tiny, the
blocks small (16 threads) and widths straddling the block; on a GPU
(NUMBA_ENABLE_CUDASIM=0) the same tests run on cupy. Tolerances (max |error| / max |reference|)
hold on both: fp32 results within 1e-6 of the reference (fp16 inputs are computed in fp32, so
the same), fp16 outputs within one fp16 ulp of the reference's value.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ratrain.device import to_host
from ratrain.exec import devlaunch, fused, kernels
from tests import _unwired_devkernels as ux
from ratrain.exec.kernels import block_sq_norm
from tests._prereq import missing

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(19)
F16 = np.float16
RTOL = 1e-6  # fp32 results: a few ulps apart (tree sums against numpy's pairwise ones)
TPB = 16  # threads per block in every test (one kernel set to compile): widths straddle it


@pytest.fixture(scope="module")
def dk():
    from ratrain.exec import devkernels

    try:
        devlaunch.load()
    except ImportError as e:
        missing(str(e))  # a failure under CI: numba-cuda is in the test extra
    return devkernels


@pytest.fixture(scope="module")
def xp(dk):
    if devlaunch.simulated():
        return np
    from tests._devices import GPU  # opens the GPU: only when the simulator is off

    if GPU is None:
        missing("NUMBA_ENABLE_CUDASIM=0 and no working GPU: the device kernels run on a GPU, or "
                "in numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1)")
    return GPU.xp


def rand(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def host(a):
    return to_host(a)


def close(got, want, rtol=RTOL):
    got, want = host(got).astype(np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= rtol, f"max |error| / max |reference| = {err:.2e} > {rtol:.0e}"


def same(dk, got, want):
    """Bitwise under the simulator (numpy's fp32 arithmetic, op for op as the reference's);
    within RTOL on a GPU (the compiler may fuse a multiply and an add)."""
    if devlaunch.simulated():
        np.testing.assert_array_equal(host(got), want)
    else:
        close(got, want)


def half_close(got, want):
    """An fp16 result within one fp16 ulp of the fp32 reference."""
    got = host(got)
    assert got.dtype == F16
    ulp = np.spacing(np.abs(np.asarray(want)).astype(F16)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - want) <= ulp)


def test_numpy_compat_puts_back_what_numba_cuda_still_names():
    """numpy 2.5 removed `row_stack`, which numba-cuda registers when it compiles its first
    kernel: put back as vstack where missing, left alone where present."""
    from types import SimpleNamespace

    bare = SimpleNamespace(vstack=np.vstack)
    assert devlaunch.numpy_compat(bare) == ["row_stack"] and bare.row_stack is np.vstack
    own = SimpleNamespace(vstack=np.vstack, row_stack=len)
    assert devlaunch.numpy_compat(own) == [] and own.row_stack is len


@pytest.mark.parametrize("dtype", [np.float32, F16])
def test_rmsnorm_forward_backward(dk, xp, dtype, monkeypatch):
    monkeypatch.setattr(dk, "ROW_GROUPS", 4)  # 6 rows on 4 blocks: dw partials of 1-2 rows
    x, w, dy = rand(2, 3, 45, dtype=dtype), rand(45, dtype=dtype), rand(2, 3, 45, dtype=dtype)
    y, cache = dk.rmsnorm_forward(xp.asarray(x), xp.asarray(w), 1e-5, xp, threads=TPB)
    ry, rcache = kernels.rmsnorm_forward(x, w, 1e-5, np)
    assert y.dtype == ry.dtype == np.float32 and cache[1].shape == rcache[1].shape == (2, 3, 1)
    close(y, ry)
    close(cache[1], rcache[1])
    dx, dw = dk.rmsnorm_backward(xp.asarray(dy), cache, xp, threads=TPB)
    rdx, rdw = kernels.rmsnorm_backward(dy, rcache, np)
    close(dx, rdx)
    close(dw, rdw)
    y16, _ = dk.rmsnorm_forward(xp.asarray(x), xp.asarray(w), 1e-5, xp,
                                out=xp.empty(x.shape, F16), threads=TPB)
    half_close(y16, ry)


@pytest.mark.parametrize("dtype", [np.float32, F16])
def test_swiglu_on_strided_halves_and_a_grid_smaller_than_the_work(dk, xp, dtype, monkeypatch):
    monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 3)  # 185 elements on 3 x 16 threads: grid-stride
    gu, dact = rand(5, 2 * 37, dtype=dtype, scale=3.0), rand(5, 37, dtype=dtype)
    gu[0, 0] = -100.0  # exp(100) overflows fp32: silu is -0, as the reference's
    dgu = xp.asarray(gu)
    gate, up = dgu[:, :37], dgu[:, 37:]  # the layer's views: strided
    with np.errstate(over="ignore"):
        ra, _ = kernels.swiglu_forward(gu[:, :37], gu[:, 37:], np)
        rg, ru, ract = kernels.swiglu_backward(
            dact, (gu[:, :37], gu[:, 37:]), np, with_act=True)
    a, _ = dk.swiglu_forward(gate, up, xp, threads=TPB)
    close(a, ra)
    dg, du, act = dk.swiglu_backward(xp.asarray(dact), (gate, up), xp, with_act=True, threads=TPB)
    for got, want in ((dg, rg), (du, ru), (act, ract)):
        close(got, want)
    outs = (xp.empty((5, 37), F16), xp.empty((5, 2 * 37), np.float32)[:, 37:])  # fp16, a view
    dk.swiglu_backward(xp.asarray(dact), (gate, up), xp, out=outs, threads=TPB)
    half_close(outs[0], rg)
    close(outs[1], ru)


@pytest.mark.parametrize("dtype", [np.float32, F16])
def test_rope_both_layouts_into_a_strided_output(dk, xp, dtype):
    B, T, H, D = 2, 5, 3, 8
    cos, sin = kernels.rope_tables(T, D, 10000.0)  # (T, D) fp32, the reference's tables
    x = rand(B, T, H, D, dtype=dtype)
    # token-major x with (T, 1, D) tables, written head-major as the layers do
    out = xp.empty((B, H, T, D), np.float32)
    c3, s3 = xp.asarray(cos[:, None]), xp.asarray(sin[:, None])
    dk.rope_forward(xp.asarray(x), c3, s3, xp, out=out.transpose(0, 2, 1, 3), threads=TPB)
    ry, _ = kernels.rope_forward(x, cos[:, None], sin[:, None], np)
    same(dk, out.transpose(0, 2, 1, 3), ry)
    dx = dk.rope_backward(xp.asarray(x), (c3, s3), xp, threads=TPB)
    same(dk, dx, kernels.rope_backward(x, (cos[:, None], sin[:, None]), np))
    # head-major x with (T, D) tables
    xh = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    y, _ = dk.rope_forward(xp.asarray(xh), xp.asarray(cos), xp.asarray(sin), xp, threads=TPB)
    same(dk, y, kernels.rope_forward(xh, cos, sin, np)[0])


@pytest.mark.parametrize("dtype", [np.float32, F16])
def test_cross_entropy_forward_backward_and_fused(dk, xp, dtype):
    N, V = 5, 37
    z, t = rand(N, V, dtype=dtype, scale=4.0), RNG.integers(0, V, N)
    loss, cache = ux.cross_entropy_forward(xp.asarray(z), xp.asarray(t), xp, threads=TPB)
    rloss, rcache = kernels.cross_entropy_forward(z, t, np)
    assert loss.shape == () and loss.dtype == np.float32
    close(loss, rloss)
    close(cache[2], rcache[2])  # lse
    close(dk.logsumexp_rows(xp.asarray(z), xp, threads=TPB), kernels.logsumexp_rows(
        z.astype(np.float32), np))
    rd = kernels.cross_entropy_backward(3.0, rcache, np)
    close(ux.cross_entropy_backward(3.0, cache, xp, threads=TPB), rd)
    # one launch: losses, lse and the gradient, written over the logits themselves
    zz = xp.asarray(z.astype(np.float32))
    losses, lse, d = ux.cross_entropy_fused(zz, xp.asarray(t), 3.0 / N, xp, out=zz, threads=TPB)
    assert d is zz
    close(losses, rcache[2] - z.astype(np.float32)[np.arange(N), t])
    close(lse, rcache[2])
    close(d, rd)
    _, _, d16 = ux.cross_entropy_fused(xp.asarray(z), xp.asarray(t), 3.0 / N, xp,
                                       out=xp.empty((N, V), F16), threads=TPB)
    half_close(d16, rd)


def test_cross_entropy_target_out_of_range_is_a_nan_loss_not_a_stray_read(dk, xp):
    z, t = rand(3, 20), np.array([0, 20, -1])
    losses, _, d = ux.cross_entropy_fused(xp.asarray(z), xp.asarray(t), 1.0, xp, threads=TPB)
    got = host(losses)
    assert np.isfinite(got[0]) and np.isnan(got[1:]).all()
    assert np.isfinite(host(d)).all()


def test_softmax_forward_backward_is_the_reference_attentions(dk, xp):
    B, H, KV, T, D = 1, 1, 1, 17, 4  # keys straddle the 16-thread block
    q, k, v, do = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D), rand(B, H, T, D)
    _, (qg, kg, vg, rp) = kernels.attention_forward(q, k, v, np)  # rp (B, KV, G, T, T)
    s = qg @ kg.swapaxes(-1, -2)  # raw scores
    scale = 1.0 / np.sqrt(D)
    p, lse = ux.softmax_forward(xp.asarray(s), xp, scale=scale, with_lse=True, threads=TPB)
    close(p, rp)
    ss = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s * np.float32(scale))
    close(lse, np.log(np.exp(ss - ss.max(-1, keepdims=True)).sum(-1)) + ss.max(-1))
    dq, dk_, _ = kernels.attention_backward(do, (qg, kg, vg, rp), np)
    dog = do.reshape(qg.shape)
    dp = dog @ vg.swapaxes(-1, -2)  # (B, KV, G, T, T)
    ds = host(ux.softmax_backward(xp.asarray(dp), p, xp, scale=scale, threads=TPB))
    close((ds @ kg).reshape(dq.shape), dq)
    close((ds.swapaxes(-1, -2) @ qg).sum(axis=2), dk_)
    delta = (do * kernels.attention_forward(q, k, v, np)[0]).sum(-1).reshape(B, KV, -1, T)
    ds2 = ux.softmax_backward(xp.asarray(dp), p, xp, scale=scale, delta=xp.asarray(delta),
                              out=xp.asarray(dp), threads=TPB)  # flash's rowsum(dO * O)
    close(ds2, ds)


def test_softmax_of_a_tile_masks_by_global_positions(dk, xp):
    s = rand(8, 17)  # scores of queries 10..17 against keys 1..17 (more keys than threads)
    q, k = np.arange(10, 18)[:, None], np.arange(1, 18)[None, :]
    z = np.where(k > q, -np.inf, s * np.float32(0.5))  # the reference's order: scale, mask
    e = np.exp(z - z.max(-1, keepdims=True))
    tile, lse = ux.softmax_forward(xp.asarray(s), xp, scale=0.5, q0=10, k0=1, with_lse=True,
                                   threads=TPB)
    close(tile, e / e.sum(-1, keepdims=True))
    close(lse, np.log(e.sum(-1)) + z.max(-1))
    assert host(tile)[0, 10:].max() == 0.0 and host(tile)[0, :10].min() > 0  # query 10: keys 1..10
    # keys 15..17 against queries 0..2: nothing visible
    p, lse = ux.softmax_forward(xp.asarray(s[:3, :3]), xp, q0=0, k0=15, with_lse=True,
                                threads=TPB)
    assert (host(p) == 0).all() and (host(lse) == -np.inf).all()


@pytest.mark.parametrize("b1", [0.9, 0.3])  # both of torch's lerp formulas
def test_adamw_is_the_fused_update(dk, xp, b1, monkeypatch):
    monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 3)
    n = 150
    p, m, v, g = rand(n), rand(n, scale=0.1), np.abs(rand(n, scale=0.01)), rand(n)
    args = (0.5, 1 - 1e-3 * 0.1, b1, 0.95, 1e-3 / (1 - b1**3), (1 - 0.95**3) ** 0.5, 1e-8)
    want = [a.copy() for a in (p, m, v, g)]
    fused.adamw(*want, *args)  # numba or its plain Python loop: the same arithmetic
    got = [xp.asarray(a) for a in (p, m, v, g)]
    dk.adamw(*got, *args, xp, threads=TPB)
    for a, b in zip(got[:3], want[:3]):
        same(dk, a, b)
    np.testing.assert_array_equal(host(got[3]), g)  # the gradient is left as it was


def test_sum_squares_in_fp64_two_stages(dk, xp, monkeypatch):
    monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 5)
    a = rand(1001, scale=30.0)
    got = dk.sum_squares(xp.asarray(a), xp, threads=TPB)
    assert got.shape == () and got.dtype == np.float64
    assert abs(float(got) - block_sq_norm(a)) <= 1e-13 * block_sq_norm(a)
    a[500] = np.inf
    assert float(dk.sum_squares(xp.asarray(a), xp, threads=TPB)) == np.inf
    a[7] = np.nan
    assert np.isnan(float(dk.sum_squares(xp.asarray(a), xp, threads=TPB)))
    assert float(dk.sum_squares(xp.asarray(a[:0]), xp)) == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e6 -> inf, as numpy's
def test_casts_round_as_numpy_and_scale_before_rounding(dk, xp, monkeypatch):
    monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 4)
    special = [65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-10, 0.0, -0.0, np.inf, -np.inf]
    a = np.concatenate([rand(199, scale=100.0), np.array(special, np.float32)]).reshape(-1, 7)
    with np.errstate(over="ignore"):
        want16 = a.astype(F16)
        scaled = (a * np.float32(0.125)).astype(F16)
    h = ux.cast(xp.asarray(a), F16, xp, threads=TPB)
    np.testing.assert_array_equal(host(h).view(np.uint16), want16.view(np.uint16))
    np.testing.assert_array_equal(host(ux.cast(xp.asarray(a), F16, xp, scale=0.125,
                                               threads=TPB)).view(np.uint16),
                                  scaled.view(np.uint16))
    back = ux.cast(h, np.float32, xp, threads=TPB)
    np.testing.assert_array_equal(host(back), want16.astype(np.float32))
    nan = ux.cast(xp.asarray(np.array([np.nan], np.float32)), F16, xp)
    assert np.isnan(host(nan)).all()


def test_bad_input_is_one_line_before_any_launch(dk, xp):
    x = xp.asarray(rand(2, 8))
    with pytest.raises(TypeError, match="float64 runs on ratrain.exec.kernels"):
        dk.rmsnorm_forward(xp.asarray(rand(2, 8, dtype=np.float64)), x[0], 1e-5, xp)
    with pytest.raises(ValueError, match="threads=48: a block is a power of two"):
        dk.swiglu_forward(x, x, xp, threads=48)
    with pytest.raises(ValueError, match=r"out: shape \(2, 8\) float32, expected \(8, 2\)"):
        ux.cast(x.T, F16, xp, out=x)
    with pytest.raises(ValueError, match="logits \\(N, V\\) and targets \\(N,\\)"):
        ux.cross_entropy_forward(x, xp.zeros(3, np.int64), xp)
    with pytest.raises(TypeError, match="targets are token ids \\(integers\\), not float32"):
        ux.cross_entropy_forward(x, x[:, 0], xp)
    other = None if xp is np else np  # the module that does not go with this run
    if other is None:
        with pytest.raises(TypeError, match="simulator .* take numpy or stand-in arrays: pass xp=numpy"):
            dk.sum_squares(x[0], object())
    else:
        with pytest.raises(TypeError, match="on a GPU take cupy arrays"):
            dk.sum_squares(x[0], np)


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **env}, timeout=120)


def test_without_numba_cuda_the_error_names_the_package():
    code = ("import sys, types\n"
            "m = types.ModuleType('numba.cuda'); m.implementation = 'Built-in'\n"
            "sys.modules['numba.cuda'] = m\n"
            "from ratrain.exec import devlaunch\n"
            "for case in ('built-in', 'absent'):\n"
            "    try:\n"
            "        devlaunch.load.__wrapped__()\n"
            "    except ImportError as e:\n"
            "        print(case, '|', e)\n"
            "    sys.modules['numba.cuda'] = None\n")
    p = _run(code)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 2, p.stderr
    assert lines[0].startswith("built-in | ratrain.exec.devkernels needs numba-cuda")
    assert lines[1].startswith("absent | ratrain.exec.devkernels needs numba-cuda")


def test_benchmark_refuses_in_one_line_without_a_gpu(dk):
    if not devlaunch.simulated():
        pytest.skip("a GPU is here: the benchmark runs (scripts' job, not a test's)")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "devkernels.py")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "devkernels benchmark" in p.stderr
