"""The device kernels (numba-cuda: `ratrain.exec.devkernels`, and the head's cross-entropy in
`exec.devloss`) against the numpy reference (`exec.kernels`), and the head through the kernel
table against the host's.

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
from ratrain.exec import devlaunch, devloss, fused, kernels
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
def test_cross_entropy_rows_are_the_references_lse_and_losses(dk, xp, dtype):
    N, V = 5, 37  # rows wider than the block
    z, t = rand(N, V, dtype=dtype, scale=4.0), RNG.integers(0, V, N)
    rlse, rlosses = kernels.cross_entropy_rows(z.astype(np.float32), t, np)
    lse, losses = devloss.cross_entropy_rows(xp.asarray(z), xp.asarray(t), xp, threads=TPB)
    assert lse.dtype == losses.dtype == np.float32 and lse.shape == losses.shape == (N,)
    close(lse, rlse)
    close(losses, rlosses)
    out = xp.zeros((2, N + 2), np.float32)  # slices of larger arrays, as the head's row chunks
    devloss.cross_entropy_rows(xp.asarray(z), xp.asarray(t), xp, out=(out[0, 2:], out[1, 2:]),
                               threads=TPB)
    close(out[0, 2:], rlse)
    close(out[1, 2:], rlosses)
    assert not host(out[:, :2]).any()


@pytest.mark.parametrize("dtype", [np.float32, F16])
def test_cross_entropy_grad_of_a_vocabulary_chunk_is_the_references(dk, xp, dtype,
                                                                    monkeypatch):
    monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 3)  # 5 x 13 on 3 x 16 threads: grid-stride
    N, V, v0, W = 5, 37, 20, 13  # columns 20..32: targets before, inside and after them
    z, t = rand(N, V, dtype=dtype, scale=4.0), np.array([3, 20, 27, 32, 36])
    rlse, _ = kernels.cross_entropy_rows(z.astype(np.float32), t, np)
    chunk = np.ascontiguousarray(z[:, v0 : v0 + W])
    want = kernels.cross_entropy_grad(chunk.astype(np.float32), t, rlse, 0.3, np, v0=v0)
    full = kernels.cross_entropy_backward(0.3 * N, (z.astype(np.float32), t, rlse), np)
    np.testing.assert_array_equal(want, full[:, v0 : v0 + W])  # a chunk of the whole
    dz = xp.asarray(chunk.copy())  # numpy's asarray would not copy: the chunk is overwritten
    d = devloss.cross_entropy_grad(dz, xp.asarray(t), xp.asarray(rlse), 0.3, xp, v0=v0,
                                   threads=TPB)
    assert d is dz  # over the logits themselves, rounded once to their dtype
    if dtype == np.float32:
        close(d, want)
    else:
        half_close(d, want)
    d16 = devloss.cross_entropy_grad(xp.asarray(chunk.copy()), xp.asarray(t), xp.asarray(rlse), 0.3,
                                     xp, v0=v0, out=xp.empty((N, W), F16), threads=TPB)
    half_close(d16, want)  # the cast fused: rounded once


@pytest.mark.parametrize("dtype", [np.float32, F16, kernels.BF16])
def test_cross_entropy_rows_write_the_rows_gradient_over_the_logits(dk, xp, dtype):
    """With `grad` (the head computed once), the same launch writes (softmax - onehot) * grad
    over the logits, rounded once into their dtype: the reference's, from the same lse. A
    target outside the vocabulary adds no one-hot."""
    N, V = 5, 37
    z, t = rand(N, V, scale=4.0).astype(dtype), np.array([3, 0, 36, 20, 37])
    z32 = z.astype(np.float32)
    rlse, rlosses = kernels.cross_entropy_rows(z32, t.clip(0, V - 1), np)  # lse: no target
    want = kernels.cross_entropy_grad(z32.copy(), t, rlse, 2.0 ** 15, np)
    dz = xp.asarray(z.copy())
    lse, losses = devloss.cross_entropy_rows(dz, xp.asarray(t), xp, grad=2.0 ** 15, threads=TPB)
    close(lse, rlse)
    close(losses[:4], rlosses[:4])
    assert np.isnan(host(losses)[4])
    if dtype == np.float32:
        close(dz, want, rtol=1e-5)
    elif dtype == F16:
        half_close(dz, want)
    else:
        close(host(dz).astype(np.float32), want, rtol=2.0 ** -7)


BF16 = kernels.BF16


def test_bfloat16_loads_are_exact_and_stores_round_as_the_host_cast():
    """`devlaunch.ld` widens every bfloat16 bit pattern to its float32 exactly; `st` rounds a
    float32 to nearest even as the host's cast (`fused.cast`) does: ties both ways, the largest
    finite values and their overflow, infinities, NaNs (the quiet NaN of their sign), zeros
    and subnormals. (What a compiled kernel runs instead is typed in tests/test_devcompile.py.)"""
    u = np.arange(1 << 16, dtype=np.uint16)
    got = np.array([devlaunch.ld(v) for v in u], np.float32)
    finite = ~np.isnan(u.view(BF16).astype(np.float32))
    np.testing.assert_array_equal(got[finite], u.view(BF16).astype(np.float32)[finite])
    assert np.isnan(got[~finite]).all()
    edges = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF,
                      0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000000,
                      0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x807FFFFF], np.uint32)
    bits = np.concatenate([edges, RNG.integers(0, 1 << 32, 20000, dtype=np.uint64)
                           .astype(np.uint32)])
    f = bits.view(np.float32)
    out = np.empty(f.size, np.uint16)
    for i, v in enumerate(f):
        devlaunch.st(out, i, v)
    np.testing.assert_array_equal(out, fused.cast(f, BF16).view(np.uint16))


def same16(got, want32):
    """A bfloat16 result against the fp32 one it rounds: bitwise its cast under the simulator,
    within one bfloat16 ulp on a GPU."""
    got = host(got)
    assert got.dtype == BF16
    want = host(want32).astype(BF16)
    if devlaunch.simulated():
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    else:
        close(got.astype(np.float32), want.astype(np.float32), rtol=2.0 ** -7)


def test_kernels_read_and_write_bfloat16_as_their_fp32_copies_rounded(dk, xp, monkeypatch):
    """Each kernel handed bfloat16 arrays (through their bits: `devlaunch.bits`, `ld`, `st`)
    computes what it computes on their exact fp32 copies, and a bfloat16 `out` holds that
    result rounded once: no fp32 copy in, no cast out."""
    monkeypatch.setattr(dk, "ROW_GROUPS", 4)
    monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 3)

    def pair(*shape, scale=1.0):  # a bfloat16 array on the device and its fp32 copy
        a = rand(*shape, scale=scale).astype(BF16)
        return xp.asarray(a), xp.asarray(a.astype(np.float32))

    def empty(shape, dtype=BF16):
        return xp.empty(shape, dtype)

    (x, x32), (w, w32), (dy, dy32), (res, res32) = (pair(5, 20), pair(20), pair(5, 20),
                                                    pair(5, 20))
    copy = empty(x.shape, np.float32)  # x's fp32 copy, written by the same pass
    y, cache = dk.rmsnorm_forward(x, w, 1e-5, xp, out=empty(x.shape), x_copy=copy, threads=TPB)
    y32, cache32 = dk.rmsnorm_forward(x32, w32, 1e-5, xp, threads=TPB)
    same16(y, y32)
    same(dk, cache[1], host(cache32[1]))
    np.testing.assert_array_equal(host(copy), host(x32))
    back16 = empty(x.shape)  # and fp32 x's 16-bit copy: x32 rounded, x's own bits
    dk.rmsnorm_forward(x32, w32, 1e-5, xp, x_copy=back16, threads=TPB)
    same16(back16, x32)
    dx, dw = dk.rmsnorm_backward(dy, cache, xp, out=empty(x.shape), threads=TPB)
    dx32, dw32 = dk.rmsnorm_backward(dy32, cache32, xp, threads=TPB)
    same16(dx, dx32)
    same(dk, dw, host(dw32))
    # a residual's gradient added (read in bf16), dx written in fp32 and rounded into bf16
    full, half = empty(x.shape, np.float32), empty(x.shape)
    dk.rmsnorm_backward(dy, cache, xp, residual=res, out=full, copy_out=half, threads=TPB)
    with_res = host(dx32) + host(res32)
    same(dk, full, with_res)
    same16(half, with_res)

    (gu, gu32), (da, da32) = pair(3, 40, scale=3.0), pair(3, 20)
    halves, halves32 = (gu[:, :20], gu[:, 20:]), (gu32[:, :20], gu32[:, 20:])
    a, _ = dk.swiglu_forward(*halves, xp, out=empty((3, 20)), threads=TPB)
    same16(a, dk.swiglu_forward(*halves32, xp, threads=TPB)[0])
    outs = (empty((3, 20)), empty((3, 40))[:, 20:], empty((3, 20)))  # the act too, a view
    dk.swiglu_backward(da, halves, xp, out=outs, with_act=True, threads=TPB)
    for got, want in zip(outs, dk.swiglu_backward(da32, halves32, xp, with_act=True,
                                                  threads=TPB)):
        same16(got, want)

    cos, sin = (xp.asarray(t[:, None]) for t in kernels.rope_tables(5, 8, 10000.0))
    (q, q32) = pair(2, 5, 3, 8)
    out = empty((2, 3, 5, 8))  # written head-major, as the layers do
    dk.rope_forward(q, cos, sin, xp, out=out.transpose(0, 2, 1, 3), threads=TPB)
    same16(out.transpose(0, 2, 1, 3), dk.rope_forward(q32, cos, sin, xp, threads=TPB)[0])
    same16(dk.rope_backward(q, (cos, sin), xp, out=empty(q.shape), threads=TPB),
           dk.rope_backward(q32, (cos, sin), xp, threads=TPB))

    (z, z32), t = pair(3, 20, scale=4.0), xp.asarray(RNG.integers(0, 20, 3))
    lse, losses = devloss.cross_entropy_rows(z, t, xp, threads=TPB)
    for got, want in zip((lse, losses), devloss.cross_entropy_rows(z32, t, xp, threads=TPB)):
        same(dk, got, host(want))
    d = devloss.cross_entropy_grad(z, t, lse, 0.3, xp, out=empty(z.shape), threads=TPB)
    same16(d, devloss.cross_entropy_grad(z32.copy(), t, lse, 0.3, xp, threads=TPB))


def test_cross_entropy_target_out_of_range_is_a_nan_loss_not_a_stray_read(dk, xp):
    z, t = rand(3, 20), np.array([0, 20, -1])
    lse, losses = devloss.cross_entropy_rows(xp.asarray(z), xp.asarray(t), xp, threads=TPB)
    got = host(losses)
    assert np.isfinite(got[0]) and np.isnan(got[1:]).all() and np.isfinite(host(lse)).all()
    d = devloss.cross_entropy_grad(xp.asarray(z), xp.asarray(t), lse, 1.0, xp, threads=TPB)
    assert np.isfinite(host(d)).all() and (host(d)[1:] > 0).all()  # no one-hot subtracted


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


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_the_head_takes_the_cross_entropy_kernels_and_keeps_its_numbers(dk, precision,
                                                                        monkeypatch):
    """The head of a device rank (the stand-in in the simulator; a card with it off), its logits
    walked 3 rows and 6 vocabulary columns at a time: the loss, dx and the gradients are those
    of the same device's reference table, from one launch per chunk each way and fewer device
    operations."""
    from ratrain.device import to_device
    from ratrain.device.standin import COUNTS, standin
    from ratrain.exec import head
    from ratrain.exec.backends import kernel_table
    from ratrain.exec.context import ExecContext
    from tests.test_layers import M, make_params

    if devlaunch.simulated():
        dxp, mode = standin, "sim"
        monkeypatch.setattr(devlaunch, "SIM_THREADS", 8)
    else:
        from tests._devices import GPU

        dxp, mode = GPU.xp, "on"
    rng = np.random.default_rng(8)
    dt = kernels.DTYPES[precision]
    x = rng.standard_normal((2, M.seq_len, M.hidden)).astype(dt)
    t = rng.integers(0, M.vocab_size, (2, M.seq_len))
    P = {k: to_device(dxp, v.astype(dt)) for k, v in make_params(M, np.float32)[-1].items()}
    launched, real = [], devlaunch.launch
    monkeypatch.setattr(devlaunch, "launch",
                        lambda k, *a: launched.append(k.py_func.__name__) or real(k, *a))
    res = {}
    for name in ("off", mode):
        table = kernel_table(dxp, precision, devkernels_mode=name, reference_ops=(
            "rmsnorm", "rope", "swiglu", "adamw", "grad_norm"))  # the head's loss alone differs
        assert table.names["cross_entropy"] == ("devkernels" if name == mode else "standin"
                                                if dxp is standin else "cupy")
        with ExecContext(M, precision, dxp, threads=1, head_chunk_bytes=4 * 3 * M.vocab_size,
                         kernels=table) as ctx:
            launched.clear()
            COUNTS.clear()
            loss, cache = head.head_forward(to_device(dxp, x), to_device(dxp, t), P, ctx)
            g = {k: dxp.zeros(v.shape, dxp.float32) for k, v in P.items()}
            dx = head.head_backward(0.5, cache, P, g, ctx)
            res[name] = COUNTS["ops"], [host(a) for a in (loss, dx, *g.values())]
    rows, cols = 2 * M.seq_len // 3, -(-M.vocab_size // 6)  # 12 row chunks, 7 column chunks
    assert launched.count("ce_rows") == rows and launched.count("ce_grad") == cols, launched
    (ref_ops, want), (ops, got) = res["off"], res[mode]
    if dxp is standin:
        assert ops < ref_ops - 3 * (rows + cols), (ops, ref_ops)
    tol = 1e-5 if precision == "fp32" else 2e-3
    for a, b in zip(got, want):
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), (precision, a, b)


def test_bad_input_is_one_line_before_any_launch(dk, xp):
    x = xp.asarray(rand(2, 8))
    with pytest.raises(TypeError, match="float64 runs on ratrain.exec.kernels"):
        dk.rmsnorm_forward(xp.asarray(rand(2, 8, dtype=np.float64)), x[0], 1e-5, xp)
    with pytest.raises(ValueError, match="threads=48: a block is a power of two"):
        dk.swiglu_forward(x, x, xp, threads=48)
    with pytest.raises(ValueError, match=r"out: shape \(8, 2\) float32, expected \(2, 8\)"):
        dk.rmsnorm_forward(x, x[0], 1e-5, xp, out=x.T)
    with pytest.raises(ValueError, match="logits \\(N, V\\) and targets \\(N,\\)"):
        devloss.cross_entropy_rows(x, xp.zeros(3, np.int64), xp)
    with pytest.raises(TypeError, match="targets are token ids \\(integers\\), not float32"):
        devloss.cross_entropy_grad(x, x[:, 0], x[:, 0], 1.0, xp)
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
