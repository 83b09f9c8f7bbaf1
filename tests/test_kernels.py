"""Kernels: float64 finite differences for every backward, blocked attention == plain, fp16 GEMM."""

from __future__ import annotations

import numpy as np
import pytest

from ratrain.exec import attention, kernels
from ratrain.exec.gemm import SCRATCH_TAG, matmul
from ratrain.shim.ledger import Ledger

RNG = np.random.default_rng(1234)


def rand(*shape):
    return RNG.standard_normal(shape)


def fd_check(f, inputs, grads, n_probe=12, eps=1e-6, rtol=1e-6, atol=1e-8):
    """Compare analytic grads of L = f(*inputs) (a scalar) with central differences at
    `n_probe` random entries of every input."""
    for arr, g in zip(inputs, grads):
        if g is None:
            continue
        flat = arr.reshape(-1)
        gflat = np.asarray(g).reshape(-1)
        for i in RNG.choice(flat.size, min(n_probe, flat.size), replace=False):
            old = flat[i]
            flat[i] = old + eps
            lp = f(*inputs)
            flat[i] = old - eps
            lm = f(*inputs)
            flat[i] = old
            num = (lp - lm) / (2 * eps)
            assert abs(num - gflat[i]) <= atol + rtol * max(abs(num), abs(gflat[i])) * 10, (
                f"entry {i}: numeric {num} analytic {gflat[i]}"
            )


def test_linear_fd():
    x, w = rand(2, 3, 5), rand(4, 5)
    r = rand(2, 3, 4)
    y, c = kernels.linear_forward(x, w, np)
    dx, dw = kernels.linear_backward(r, c, np)
    fd_check(lambda x, w: float((kernels.linear_forward(x, w, np)[0] * r).sum()), [x, w], [dx, dw])


def test_embedding_fd_and_accumulates():
    ids = np.array([[1, 3, 1], [0, 3, 3]])
    w = rand(5, 4)
    r = rand(2, 3, 4)
    x, c = kernels.embedding_forward(ids, w, np)
    assert np.array_equal(x, w[ids])
    dw = kernels.embedding_backward(r, c, np)
    fd_check(lambda w: float((kernels.embedding_forward(ids, w, np)[0] * r).sum()), [w], [dw])
    acc = np.ones((5, 4))
    kernels.embedding_backward(r, c, np, dw=acc)
    np.testing.assert_allclose(acc, 1 + dw)


def test_rmsnorm_fd():
    x, w = rand(2, 3, 8), rand(8)
    r = rand(2, 3, 8)
    y, c = kernels.rmsnorm_forward(x, w, 1e-5, np)
    ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    dx, dw = kernels.rmsnorm_backward(r, c, np)
    fd_check(lambda x, w: float((kernels.rmsnorm_forward(x, w, 1e-5, np)[0] * r).sum()), [x, w],
             [dx, dw])


def test_rmsnorm_fp32_stays_fp32():
    x, w = rand(2, 8).astype(np.float32), rand(8).astype(np.float32)
    y, c = kernels.rmsnorm_forward(x, w, 1e-5, np)
    assert y.dtype == np.float32 and c[1].dtype == np.float32
    y16, _ = kernels.rmsnorm_forward(x.astype(np.float16), w.astype(np.float16), 1e-5, np)
    assert y16.dtype == np.float32


def test_rope_tables_hf_convention():
    cos, sin = kernels.rope_tables(7, 8, 10000.0, np, np.float64)
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    ang = np.arange(7)[:, None] * inv[None]
    np.testing.assert_allclose(cos, np.cos(np.concatenate([ang, ang], -1)), atol=2e-6)
    np.testing.assert_allclose(sin, np.sin(np.concatenate([ang, ang], -1)), atol=2e-6)


def test_rope_matches_rotate_half_and_fd():
    T, D = 6, 8
    cos, sin = kernels.rope_tables(T, D, 500.0, np, np.float64)
    x = rand(2, 3, T, D)
    y, c = kernels.rope_forward(x, cos, sin, np)
    rot = np.concatenate([-x[..., D // 2 :], x[..., : D // 2]], -1)
    np.testing.assert_allclose(y, x * cos + rot * sin, rtol=1e-12, atol=1e-14)
    r = rand(*y.shape)
    dx = kernels.rope_backward(r, c, np)
    fd_check(lambda x: float((kernels.rope_forward(x, cos, sin, np)[0] * r).sum()), [x], [dx])
    # (B, T, H, D) layout with (T, 1, D) tables, written into a transposed view
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # (B, T, H, D)
    out = np.empty((2, 3, T, D))
    kernels.rope_forward(xt, cos[:, None], sin[:, None], np, out=out.transpose(0, 2, 1, 3))
    np.testing.assert_allclose(out, y, rtol=1e-13)


@pytest.mark.parametrize("H,KV", [(4, 4), (4, 2), (6, 1)])
def test_attention_plain_fd(H, KV):
    B, T, D = 2, 5, 4
    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    o, c = kernels.attention_forward(q, k, v, np)
    r = rand(*o.shape)
    dq, dk, dv = kernels.attention_backward(r, c, np)
    fd_check(lambda q, k, v: float((kernels.attention_forward(q, k, v, np)[0] * r).sum()), [q, k, v],
             [dq, dk, dv])
    # causal: output at t does not depend on keys after t
    k2 = k.copy()
    k2[:, :, -1] += 10.0
    o2, _ = kernels.attention_forward(q, k2, v, np)
    np.testing.assert_allclose(o2[:, :, :-1], o[:, :, :-1], rtol=1e-12)


def test_attention_plain_matches_explicit_repeat_kv():
    B, H, KV, T, D = 1, 4, 2, 6, 4
    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    o, _ = kernels.attention_forward(q, k, v, np)
    kr, vr = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)  # HF repeat_kv
    s = q @ kr.swapaxes(-1, -2) / np.sqrt(D)
    s[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(o, p @ vr, rtol=1e-12)


@pytest.mark.parametrize("T,block", [(1, 4), (4, 4), (5, 4), (16, 4), (37, 8), (37, 64), (64, 16)])
@pytest.mark.parametrize("H,KV", [(2, 2), (4, 2), (3, 1)])
def test_flash_equals_plain(T, block, H, KV):
    B, D = 2, 8
    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    o, c = kernels.attention_forward(q, k, v, np)
    of, cf = attention.flash_attention_forward(q, k, v, np, block=block)
    np.testing.assert_allclose(of, o, rtol=1e-11, atol=1e-12)
    # the cache is only q, k, v, o, lse: nothing T x T
    assert max(a.size for a in (cf.q, cf.k, cf.v, cf.o, cf.lse)) == B * H * T * D
    s = (q.reshape(B, KV, H // KV, T, D) @ k[:, :, None].swapaxes(-1, -2)).reshape(B, H, T, T)
    s = s / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    np.testing.assert_allclose(cf.lse, lse, rtol=1e-12)
    do = rand(*o.shape)
    for a, b in zip(attention.flash_attention_backward(do, cf, np, block),
                    kernels.attention_backward(do, c, np)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11)


def test_flash_batch_groups_equal():
    """One sequence per group, two, or all (a device's group) give the same bits."""
    B, H, KV, T, D = 3, 4, 2, 13, 4
    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    do = rand(B, H, T, D)
    tile = H * 4 * 4 * 8  # one sequence's (H, block, block) fp64 score tile
    assert attention._batch_groups(B, H, 4, 8, tile) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert attention._batch_groups(B, H, 4, 8, 2 * tile) == [slice(0, 2), slice(2, 3)]
    assert attention._batch_groups(B, H, 4, 8, attention.DEVICE_GROUP_BYTES) == [slice(0, 3)]
    o, c = attention.flash_attention_forward(q, k, v, np, block=4, group_bytes=tile)
    ref = attention.flash_attention_backward(do, c, np, 4, group_bytes=tile)
    for group in (2 * tile, attention.DEVICE_GROUP_BYTES):
        o1, c1 = attention.flash_attention_forward(q, k, v, np, block=4, group_bytes=group)
        np.testing.assert_array_equal(o1, o)
        for a, b in zip(attention.flash_attention_backward(do, c1, np, 4, group), ref):
            np.testing.assert_array_equal(a, b)


def test_flash_fd_and_strided_out():
    B, H, KV, T, D = 1, 4, 2, 11, 4
    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    o, c = attention.flash_attention_forward(q, k, v, np, block=4)
    r = rand(*o.shape)
    grads = attention.flash_attention_backward(r, c, np, 4)
    fd_check(lambda q, k, v: float((attention.flash_attention_forward(q, k, v, np, block=4)[0] * r).sum()),
             [q, k, v], grads)
    buf = np.empty((B, T, H, D))  # token-major output, as the layers use it
    attention.flash_attention_forward(q, k, v, np, block=4, out=buf.transpose(0, 2, 1, 3))
    np.testing.assert_allclose(buf.transpose(0, 2, 1, 3), o, rtol=1e-13)


def test_flash_fp32_close_to_fp64():
    B, H, KV, T, D = 2, 4, 2, 40, 16
    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    o, _ = kernels.attention_forward(q, k, v, np)
    of, cf = attention.flash_attention_forward(*(a.astype(np.float32) for a in (q, k, v)), np,
                                               block=16)
    assert of.dtype == np.float32 and cf.lse.dtype == np.float32
    np.testing.assert_allclose(of, o, rtol=1e-4, atol=1e-5)


def test_swiglu_and_mlp_fd():
    g, u = rand(3, 7), rand(3, 7)
    r = rand(3, 7)
    a, c = kernels.swiglu_forward(g, u, np)
    np.testing.assert_allclose(a, g / (1 + np.exp(-g)) * u, rtol=1e-13)
    dg, du = kernels.swiglu_backward(r, c, np)
    fd_check(lambda g, u: float((kernels.swiglu_forward(g, u, np)[0] * r).sum()), [g, u], [dg, du])
    # into given buffers, with the activation on the way: the same values
    out = (np.empty_like(g), np.empty_like(u))
    dg2, du2, act = kernels.swiglu_backward(r, c, np, out=out, with_act=True)
    assert dg2 is out[0] and du2 is out[1]
    np.testing.assert_array_equal(dg2, dg)
    np.testing.assert_array_equal(du2, du)
    np.testing.assert_allclose(act, a, rtol=1e-13)
    x, wg, wu, wd = rand(2, 3, 5), rand(6, 5), rand(6, 5), rand(5, 6)
    y, c = kernels.mlp_forward(x, wg, wu, wd, np)
    r = rand(*y.shape)
    grads = kernels.mlp_backward(r, c, np)
    fd_check(lambda *a: float((kernels.mlp_forward(*a, np)[0] * r).sum()), [x, wg, wu, wd], grads)


def test_cross_entropy_fd_and_stable():
    z = rand(6, 5)
    t = np.array([0, 4, 2, 2, 1, 3])
    loss, c = kernels.cross_entropy_forward(z, t, np)
    ref = np.mean(np.log(np.exp(z).sum(-1)) - z[np.arange(6), t])
    np.testing.assert_allclose(loss, ref, rtol=1e-13)
    dz = kernels.cross_entropy_backward(0.7, c, np)
    fd_check(lambda z: 0.7 * float(kernels.cross_entropy_forward(z, t, np)[0]), [z], [dz])
    big, _ = kernels.cross_entropy_forward((z * 1e4).astype(np.float32), t, np)
    assert np.isfinite(big) and big.dtype == np.float32


# ------------------------------------------------------------------------------------------
# GEMM
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, kernels.BF16])
def test_cross_entropy_rows_with_grad_write_the_rows_gradient_rounded_once(dtype):
    """`grad` (the head computed once): the rows' lse and losses as without it, in fp32 for
    16-bit logits, and the logits overwritten by cross_entropy_grad of the whole rows from
    their fp32 values, rounded once into their dtype."""
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((6, 33)) * 4).astype(dtype)
    t = rng.integers(0, 33, 6)
    z32 = z.astype(np.float32)
    lse, losses = kernels.cross_entropy_rows(z32, t, np)
    want = kernels.cross_entropy_grad(z32.copy(), t, lse, 0.75, np).astype(dtype)
    got = z.copy()
    glse, glosses = kernels.cross_entropy_rows(got, t, np, grad=0.75)
    assert glse.dtype == glosses.dtype == np.float32
    np.testing.assert_array_equal(glse, lse)
    np.testing.assert_array_equal(glosses, losses)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_gemm_fp32_is_matmul():
    a = rand(5, 7).astype(np.float32)
    b = rand(4, 7).astype(np.float32)
    np.testing.assert_array_equal(matmul(a, b.T), a @ b.T)


@pytest.mark.parametrize("which", ["a", "b", "both"])
def test_gemm_fp16_tiled_accumulates_in_fp32(which):
    a = rand(3, 33, 40).astype(np.float16)
    b = rand(40, 29).astype(np.float16)
    a_ = a if which in ("a", "both") else a.astype(np.float32)
    b_ = b.T.copy().T if which in ("b", "both") else b.astype(np.float32)  # an F-ordered view
    led = Ledger()
    # a tiny scratch forces many row and column panels
    y = matmul(a_, b_, ledger=led, scratch_bytes=4 * 40 * 5)
    assert y.dtype == np.float32 and y.shape == (3, 33, 29)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert led.in_use(SCRATCH_TAG) == 0 and 0 < led.peak_by_tag()[SCRATCH_TAG] <= 4 * 40 * 5
    out = np.empty((3, 33, 29), np.float16)
    matmul(a_, b_, out=out, scratch_bytes=1 << 20)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("half", [np.float16, kernels.BF16])
def test_a_16_bit_out_is_the_references_result_rounded_once(half):
    """Handed a 16-bit `out` (as a device's 16-bit layout hands the reference where its kernels
    write 16 bits), a reference computes in fp32 and rounds once into it (`kernels.rounds_once`):
    the bits of casting what it returns without `out`, where writing its intermediate steps
    into the 16-bit array would round each."""
    x = RNG.standard_normal((4, 24)).astype(np.float32)
    w = RNG.standard_normal(24).astype(np.float32)
    y, (_, rstd, _) = kernels.rmsnorm_forward(x, w, 1e-5, np)
    out = np.empty(x.shape, half)
    got, (_, rstd16, _) = kernels.rmsnorm_forward(x, w, 1e-5, np, out)
    assert got is out
    np.testing.assert_array_equal(out.view(np.uint16), y.astype(half).view(np.uint16))
    np.testing.assert_array_equal(rstd16, rstd)
    copy = np.empty(x.shape, half)  # x's copy from the same call, rounded once
    kernels.rmsnorm_forward(x, w, 1e-5, np, x_copy=copy)
    np.testing.assert_array_equal(copy.view(np.uint16), x.astype(half).view(np.uint16))
    dy, res = (RNG.standard_normal(x.shape).astype(np.float32) for _ in range(2))
    dx, dw = kernels.rmsnorm_backward(dy, (x, rstd, w), np)
    out, copy = np.empty(x.shape, np.float32), np.empty(x.shape, half)
    got, dw2 = kernels.rmsnorm_backward(dy, (x, rstd, w), np, res.astype(half), out, copy)
    assert got is out
    np.testing.assert_array_equal(dw2, dw)
    np.testing.assert_array_equal(out, dx + res.astype(half).astype(np.float32))
    np.testing.assert_array_equal(copy.view(np.uint16), out.astype(half).view(np.uint16))
    cos, sin = kernels.rope_tables(4, 6, 10000.0)
    q = RNG.standard_normal((2, 4, 3, 6)).astype(np.float32)
    out = np.empty((2, 3, 4, 6), half).transpose(0, 2, 1, 3)  # head-major, as the layers write
    kernels.rope_forward(q, cos[:, None], sin[:, None], np, out)
    want = kernels.rope_forward(q, cos[:, None], sin[:, None], np)[0]
    np.testing.assert_array_equal(out.view(np.uint16), want.astype(half).view(np.uint16))
    g, u, da = (RNG.standard_normal((5, 7)).astype(np.float32) * 3 for _ in range(3))
    outs = tuple(np.empty((5, 7), half) for _ in range(3))
    got = kernels.swiglu_backward(da, (g, u), np, outs, with_act=True)
    assert all(a is b for a, b in zip(got, outs))
    for o, want in zip(outs, kernels.swiglu_backward(da, (g, u), np, with_act=True)):
        np.testing.assert_array_equal(o.view(np.uint16), want.astype(half).view(np.uint16))
    direct = np.empty((5, 7), half)  # what writing the steps into 16 bits would give
    a = np.negative(g, out=direct)
    np.exp(a, out=a)
    a += 1.0
    np.divide(g, a, out=a)
    a *= u
    act = kernels.swiglu_forward(g, u, np, np.empty((5, 7), half))[0]
    assert not np.array_equal(act.view(np.uint16), direct.view(np.uint16))
    np.testing.assert_array_equal(act.view(np.uint16), kernels.swiglu_forward(g, u, np)[0]
                                  .astype(half).view(np.uint16))
