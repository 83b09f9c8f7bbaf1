"""The stand-in's count of the device kernels (`run.devkernels: count`, `exec.devcount`): each
twin counts the device operations its kernel queues (the kernel run in numba-cuda's simulator on
the same stand-in arrays, each launch counted) and gives the reference's values; a counted step
trains as the composition's step does, in fewer operations."""

import numpy as np
import pytest

from ratrain.device import open_device, to_host
from ratrain.device.standin import COUNTS, standin
from ratrain.exec import devcount, devlaunch, kernels
from ratrain.exec.backends import BackendError, _fast_kernels
from ratrain.config import replace
from ratrain.runtime.rank import build_rank
from tests._executor_util import global_batch, tiny_config
from tests.test_devkernels import dk  # noqa: F401  (a pytest fixture)

RNG = np.random.default_rng(23)
F16 = np.float16
TPB = 16


def rand(*shape, dtype=np.float32, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def _calls(dtype):
    """name -> (function of (module, arrays) making one call, its host inputs)."""
    x, w, dy = rand(2, 3, 40, dtype=dtype), rand(40, dtype=dtype), rand(2, 3, 40, dtype=dtype)
    gu, dact = rand(6, 2 * 20, dtype=dtype), rand(6, 20, dtype=dtype)
    q = rand(2, 5, 3, 8, dtype=dtype)  # (B, T, H, D), tables (T, 1, D)
    cos, sin = kernels.rope_tables(5, 8, 10000.0, np, np.float32)
    z, t = rand(4, 11, scale=2.0), RNG.integers(0, 11, 4)
    rstd = kernels.rmsnorm_forward(x.astype(np.float32), w, 1e-5, np)[1][1]
    p, m, v, g = (rand(50) for _ in range(4))
    v = np.abs(v)
    return {
        "rmsnorm_forward": (lambda k, a: k.rmsnorm_forward(a[0], a[1], 1e-5, standin,
                                                           threads=TPB), (x, w)),
        "rmsnorm_backward": (lambda k, a: k.rmsnorm_backward(a[0], (a[1], a[2], a[3]), standin,
                                                             threads=TPB),
                             (dy, x, rstd, w)),
        "rmsnorm_recompute": (lambda k, a: k.rmsnorm_recompute(a[0], a[1], a[2], standin,
                                                               threads=TPB), (x, rstd, w)),
        "swiglu_forward": (lambda k, a: k.swiglu_forward(a[0][:, :20], a[0][:, 20:], standin,
                                                         threads=TPB), (gu,)),
        "swiglu_backward": (lambda k, a: k.swiglu_backward(a[1], (a[0][:, :20], a[0][:, 20:]),
                                                           standin, with_act=True, threads=TPB),
                            (gu, dact)),
        "rope_forward": (lambda k, a: k.rope_forward(a[0], a[1][:, None], a[2][:, None],
                                                     standin, threads=TPB), (q, cos, sin)),
        "rope_backward": (lambda k, a: k.rope_backward(a[0], (a[1][:, None], a[2][:, None]),
                                                       standin, threads=TPB), (q, cos, sin)),
        "adamw": (lambda k, a: k.adamw(*a, 0.5, 0.99, 0.9, 0.95, 1e-3, 0.9, 1e-8, standin,
                                       threads=TPB) or (a[0], a[1], a[2]), (p, m, v, g)),
        "sum_squares": (lambda k, a: k.sum_squares(a[0], standin, threads=TPB), (g,)),
        "cross_entropy_rows": (lambda k, a: k.cross_entropy_rows(a[0], a[1], standin,
                                                                 threads=TPB), (z, t)),
        "cross_entropy_grad": (lambda k, a: k.cross_entropy_grad(
            a[0], a[1], a[2], 0.25, standin, v0=3, threads=TPB),
            (z[:, 3:9].copy(), t, kernels.cross_entropy_rows(z, t, np)[0])),
    }


def _flat(r):
    if isinstance(r, (tuple, list)):
        return [x for v in r for x in _flat(v)]
    return [to_host(r)] if hasattr(r, "dtype") else []


@pytest.fixture(scope="module")
def sim(dk):  # noqa: F811  (dk: test_devkernels' fixture, numba-cuda loaded)
    if not devlaunch.simulated():
        pytest.skip("numba-cuda runs on a GPU here (NUMBA_ENABLE_CUDASIM=0): the counts are "
                    "compared in its simulator, which the CPU suite runs")
    from ratrain.exec import deventries

    return deventries.KERNELS


FP32_ONLY = ("adamw", "sum_squares", "cross_entropy_rows", "cross_entropy_grad")  # flat
# fp32 state and gradients, the head's fp32 logits


@pytest.mark.parametrize("name,dtype", [(n, d) for n in sorted(devcount.LAUNCHES)
                                        for d in (np.float32, F16, kernels.BF16)
                                        if d == np.float32 or n not in FP32_ONLY])
def test_each_twin_counts_its_kernels_launches_and_gives_the_references_values(sim, name,
                                                                                 dtype):
    call, inputs = _calls(dtype)[name]
    got = {}
    for label, mod in (("kernel", sim), ("twin", devcount)):
        arrays = [standin.asarray(a.copy()) for a in inputs]
        COUNTS.clear()
        res = call(mod, arrays)
        got[label] = COUNTS["ops"], _flat(res)
    (k_ops, k_vals), (t_ops, t_vals) = got["kernel"], got["twin"]
    assert k_ops == t_ops == devcount.LAUNCHES[name], (name, k_ops, t_ops)
    assert len(k_vals) == len(t_vals)
    for a, b in zip(t_vals, k_vals):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        a, b = a.astype(np.float64), b.astype(np.float64)
        tol = 1e-6 * max(np.abs(b).max(), 1e-30)
        if dtype == F16 and a.size:  # a 16-bit output: one ulp apart at most
            tol = np.spacing(np.abs(b).max().astype(F16)).astype(np.float64)
        assert np.abs(a - b).max() <= tol, (name, np.abs(a - b).max())


def test_the_twins_write_where_the_kernels_write():
    """`out` (a strided view, a 16-bit one) filled in place; the head's gradient written over
    z without `out`, and z left as it was with one."""
    x = standin.asarray(rand(3, 2, 4, 8))  # (B, H, T, D) head-major
    cos, sin = kernels.rope_tables(4, 8, 10000.0, np, np.float32)
    dst = standin.zeros((3, 4, 2, 8), np.float32)
    y, _ = devcount.rope_forward(x, standin.asarray(cos), standin.asarray(sin), standin,
                                 out=dst.transpose(0, 2, 1, 3))
    want = kernels.rope_forward(to_host(x), cos, sin, np)[0]
    np.testing.assert_array_equal(to_host(dst).transpose(0, 2, 1, 3), want)
    z, t = rand(4, 6), np.array([0, 5, 2, 3])
    lse = kernels.cross_entropy_rows(z, t, np)[0]
    dz = standin.asarray(z.copy())
    r = devcount.cross_entropy_grad(dz, standin.asarray(t), standin.asarray(lse), 0.5, standin)
    want = kernels.cross_entropy_grad(z.copy(), t, lse, 0.5, np)
    assert r is dz
    np.testing.assert_array_equal(to_host(dz), want)
    dz = standin.asarray(z.copy())
    out = standin.empty(z.shape, F16)
    devcount.cross_entropy_grad(dz, standin.asarray(t), standin.asarray(lse), 0.5, standin,
                                out=out)
    np.testing.assert_array_equal(to_host(dz), z)
    np.testing.assert_array_equal(to_host(out), want.astype(F16))


def test_bad_input_is_one_line():
    with pytest.raises(TypeError, match="devcount computes the stand-in's arrays, not ndarray"):
        devcount.swiglu_forward(rand(2, 3), rand(2, 3), np)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16 arrays, not float64"):
        devcount.sum_squares(standin.asarray(np.zeros(3)), standin)
    with pytest.raises(BackendError, match="run.devkernels=count counts the device kernels' "
                       "launches on run.device=standin: on a GPU set run.devkernels=auto"):
        _fast_kernels("gpu", "bf16", "auto", "count")
    assert _fast_kernels("standin", "bf16", "auto", "count") == "devcount"
    assert _fast_kernels("standin", "fp64", "auto", "count") is None


def _steps(precision, mode, steps=2, attention="auto"):
    cfg = tiny_config(precision=precision)
    cfg = replace(cfg, run=replace(cfg.run, devkernels=mode, attention=attention))
    rank = build_rank(cfg, None, cap=None, device=open_device("standin"))
    COUNTS.clear()
    try:
        losses = [rank.executor.run_step(s, global_batch(cfg, s)).loss for s in range(steps)]
        rank.executor.flush()
    finally:
        rank.close()
    return COUNTS["ops"], losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_counted_step_trains_as_the_compositions_step_in_fewer_operations(precision):
    """Two steps of the tiny model on the stand-in, its kernels counted and on cupy's
    compositions: the same losses (the twins compute the references' arithmetic; AdamW's
    twin is the host's fused update, its arithmetic), and fewer device operations."""
    res = {mode: _steps(precision, mode) for mode in ("off", "count")}
    (off_ops, off_losses), (ops, losses) = res["off"], res["count"]
    np.testing.assert_allclose(losses, off_losses, rtol=1e-6)
    assert ops < off_ops, (ops, off_ops)


def test_cudnn_counted_trains_a_step_in_one_operation_a_call():
    """`run.attention: cudnn-count` on the stand-in: cuDNN's backend with each graph execute
    counted as one operation (the tiled path on the host computing it): the tiny model's steps
    track the tiled attention's within bf16's rounding, in fewer operations; refused in one
    line elsewhere and at fp32."""
    from ratrain.exec.backends import kernel_table

    res = {}
    for attn in ("tiled-1024", "cudnn-count"):
        ops, losses = _steps("bf16", "count", attention=attn)
        res[attn] = ops, losses
    (t_ops, t_losses), (c_ops, c_losses) = res["tiled-1024"], res["cudnn-count"]
    np.testing.assert_allclose(c_losses, t_losses, rtol=2e-2)
    assert c_ops < t_ops, (c_ops, t_ops)
    with pytest.raises(BackendError, match="run.attention=cudnn-count runs on the stand-in "
                       r"\(run.device=standin\), not on run.device=cpu"):
        kernel_table(np, "bf16", attention="cudnn-count")
    with pytest.raises(BackendError, match="run.attention=cudnn-count computes in fp16 or bf16, "
                       "not precision=fp32"):
        kernel_table(standin, "fp32", attention="cudnn-count")
