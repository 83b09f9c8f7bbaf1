"""A device's GEMM into fp32 (`exec.devgemm.gemm_ex`, cuBLAS's GemmEx on a card): 16-bit
operands in any of the layouts the layers pass (contiguous, transposed views, column slices of
a transposed view), beta 0 writes, beta 1 adds, one device operation on the stand-in; on a GPU
(scripts/gpu-check.sh runs these tests there) the card's result against cupy's fp32 GEMM of
the same values."""

import numpy as np
import pytest

from ratrain.device.standin import COUNTS
from ratrain.exec import devgemm
from ratrain.exec.kernels import BF16
from tests._devices import DEVICES, MODULES, host

RNG = np.random.default_rng(44)


def _layouts(xp, dt):
    """(a, b, c) triples: a (M, K) and b (K, N) as the layers pass them."""
    a = RNG.standard_normal((24, 40)).astype(dt)
    w = RNG.standard_normal((56, 40)).astype(dt)  # a weight (out, in): b = w.T
    dy = RNG.standard_normal((40, 70)).astype(dt)  # a gradient (tokens, out)
    x = RNG.standard_normal((40, 24)).astype(dt)
    A, W, DY, X = (xp.asarray(v) for v in (a, w, dy, x))
    return [("a @ w.T", A, W.T), ("dy[:, 8:40].T @ x", DY[:, 8:40].T, X),
            ("a @ w[8:24].T", A, W[8:24].T), ("x.T @ dy", X.T, DY)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [np.float16, BF16], ids=["fp16", "bf16"])
def test_gemm_ex_writes_and_adds_the_fp32_product(device, dt):
    xp = MODULES[device]
    for name, a, b in _layouts(xp, dt):
        want = host(a).astype(np.float64) @ host(b).astype(np.float64)
        c0 = RNG.standard_normal(want.shape).astype(np.float32)
        for beta, alpha in ((0.0, 1.0), (1.0, 1.0), (0.0, 0.375), (1.0, 2.0 ** -20)):
            c = xp.asarray(c0.copy())
            COUNTS.clear()
            assert devgemm.gemm_ex(a, b, c, xp, beta=beta, alpha=alpha) is c
            if device == "standin":
                assert COUNTS["ops"] == 1, name
            ref = alpha * want + (c0 if beta else 0)
            err = np.abs(host(c) - ref).max() / np.abs(ref).max()
            assert err < 1e-6, (name, beta, err)  # fp32 sums of exact products


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_ex_writes_into_a_view_and_leaves_the_rest(device):
    xp = MODULES[device]
    a = xp.asarray(RNG.standard_normal((6, 8)).astype(BF16))
    b = xp.asarray(RNG.standard_normal((8, 5)).astype(BF16))
    big = xp.zeros((10, 5), np.float32)
    devgemm.gemm_ex(a, b, big[2:8], xp, beta=1.0)
    got = host(big)
    np.testing.assert_allclose(got[2:8], host(a).astype(np.float32) @ host(b).astype(np.float32),
                               rtol=1e-6)
    assert not got[:2].any() and not got[8:].any()


def test_gemm_ex_refuses_in_one_line_before_any_work():
    xp = MODULES["standin"]
    a = xp.asarray(np.ones((4, 6), BF16))
    b = xp.asarray(np.ones((6, 3), BF16))
    c = xp.zeros((4, 3), np.float32)
    with pytest.raises(TypeError, match="16-bit a and b of one dtype and a float32 c"):
        devgemm.gemm_ex(a, xp.asarray(np.ones((6, 3), np.float16)), c, xp)
    with pytest.raises(ValueError, match=r"shapes \(4, 6\) @ \(6, 3\) into \(3, 4\) do not align"):
        devgemm.gemm_ex(a, b, xp.zeros((3, 4), np.float32), xp)
    with pytest.raises(ValueError, match="has no unit stride"):
        devgemm.gemm_ex(xp.asarray(np.ones((8, 12), BF16))[::2, ::2], b, c, xp)
    with pytest.raises(ValueError, match="c .* needs contiguous rows"):
        devgemm.gemm_ex(a, b, xp.zeros((3, 4), np.float32).T, xp)
    with pytest.raises(ValueError, match="beta=0.5: 0 .write. or 1 .add."):
        devgemm.gemm_ex(a, b, c, xp, beta=0.5)
    with pytest.raises(TypeError, match="gemm_ex runs on a device"):
        devgemm.gemm_ex(np.ones((4, 6), BF16), np.ones((6, 3), BF16), np.zeros((4, 3),
                                                                                np.float32), np)
    assert not host(c).any()


def test_the_gemm_entry_takes_gemm_ex_where_it_can_and_cupys_matmul_elsewhere():
    """`gemm.matmul` on a device: a 2-D product into fp32 (a new array, an `out`, an
    accumulation) is one GemmEx; an operand without a unit stride goes to cupy's matmul (its
    16-bit product, then fp32), the same values to 16-bit rounding."""
    from ratrain.exec.gemm import matmul

    xp = MODULES["standin"]
    a = xp.asarray(RNG.standard_normal((12, 16)).astype(np.float32))
    w = xp.asarray(RNG.standard_normal((10, 16)).astype(BF16))
    ref = host(a).astype(BF16).astype(np.float32) @ host(w).astype(np.float32).T
    COUNTS.clear()
    r = matmul(a, w.T, xp=xp, half=BF16)
    assert r.dtype == np.float32 and COUNTS["ops"] == 2  # the cast of a, the GEMM
    np.testing.assert_allclose(host(r), ref, rtol=1e-6)
    acc = xp.asarray(np.ones((12, 10), np.float32))
    matmul(a, w.T, out=acc, xp=xp, half=BF16, accumulate=True)
    np.testing.assert_allclose(host(acc), ref + 1, rtol=1e-6)
    COUNTS.clear()  # alpha (the head's seed) inside the same GemmEx
    matmul(a, w.T, out=acc, xp=xp, half=BF16, accumulate=True, alpha=0.25)
    np.testing.assert_allclose(host(acc), 1.25 * ref + 1, rtol=1e-6)
    assert COUNTS["ops"] == 2  # the cast of a, the GEMM
    a32 = host(a)  # the host's reference: the product scaled, then added or written
    np.testing.assert_allclose(matmul(a32, a32.T, alpha=0.5), 0.5 * (a32 @ a32.T), rtol=1e-6)
    strided = xp.asarray(RNG.standard_normal((24, 32)).astype(BF16))[::2, ::2]
    np.testing.assert_allclose(host(matmul(strided, w.T, xp=xp, half=BF16, alpha=3.0)),
                               3 * host(matmul(strided, w.T, xp=xp, half=BF16)), rtol=1e-6)
    r = matmul(strided, w.T, xp=xp, half=BF16)
    want = (host(strided).astype(np.float32) @ host(w).astype(np.float32).T).astype(BF16)
    np.testing.assert_array_equal(host(r), want.astype(np.float32))
