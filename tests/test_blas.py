"""The host's BLAS (`exec.blas`, `run.blas`). oneMKL's GEMM entry against the reference:
shapes, transposes, strides, odd sizes, 16-bit in and out, beta = 1, and the same bits at any
alignment. The choice, its banner and its refusals. The 16-bit layout on oneMKL: bitwise the
same over threads and recompute choices, close to OpenBLAS, no fp32 copy of a 16-bit weight.
A bf16 run trains with oneMKL forced, every policy bitwise equal. Where oneMKL does not load,
these tests fail under CI (scripts/test.sh installs the extra) and are skipped elsewhere."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from ratrain import bench
from ratrain.config import ConfigError, load_config
from ratrain.device.standin import COUNTS, standin
from ratrain.exec import blas, head, kernels, layers
from ratrain.exec.attention import TiledAttention
from ratrain.exec.backends import BackendError, choose_blas, kernel_table
from ratrain.exec.context import ExecContext
from ratrain.exec.gemm import matmul, mkl_entry
from ratrain.exec.kernels import BF16
from ratrain.runtime.rank import build_rank
from tests._executor_util import layer_weight_copy_nbytes, tiny_config, train
from tests._prereq import need_mkl
from tests.test_layers import M, make_params, run_layer, zeros_like

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
AMX = {"amx_bf16", "amx_tile"}


@pytest.fixture(scope="module")
def mkl():
    return need_mkl()


def exact(a, b):
    """a @ b in float64 from the operands' exact values (the reference of a GEMM with fp32
    accumulation)."""
    return a.astype(np.float64) @ b.astype(np.float64)


def operand(rng, shape, dtype, form):
    """A (rows, cols) operand of `dtype` in a layout: `c` contiguous, `t` a transposed view,
    `rows` every other row of a larger array (leading dimension > cols), `cols` columns of a
    wider array, `both` neither axis unit-strided (the entry copies it)."""
    r, c = shape
    if form == "t":
        return rng.standard_normal((c, r)).astype(dtype).T
    if form == "rows":
        return rng.standard_normal((2 * r, c)).astype(dtype)[::2]
    if form == "cols":
        return rng.standard_normal((r, c + 3)).astype(dtype)[:, 1 : c + 1]
    if form == "both":
        return rng.standard_normal((2 * r, 2 * c)).astype(dtype)[::2, ::2]
    return rng.standard_normal((r, c)).astype(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (3, 5, 7), (37, 53, 29), (130, 7, 300), (64, 128, 96)])
def test_the_entry_matches_the_reference(mkl, dtype, mkn):
    m, k, n = mkn
    gemm = mkl_entry(mkl, native=(BF16, F16))
    rng = np.random.default_rng(m * 1000 + n)
    for fa in ("c", "t", "rows", "cols", "both"):
        for fb in ("c", "t", "cols"):
            a, b = operand(rng, (m, k), dtype, fa), operand(rng, (k, n), dtype, fb)
            want = exact(a, b)
            got = gemm(a, b)
            assert got.dtype == F32 and got.shape == (m, n)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k),
                                       err_msg=f"{fa} {fb}")
            if dtype == F32:  # beside numpy's own sgemm
                np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5 * np.sqrt(k))
            # into a given fp32 out, a strided one (through the panel), a 16-bit one (rounded)
            out = np.full((m, n), np.nan, F32)
            assert gemm(a, b, out=out) is out and np.array_equal(out, got)
            wide = np.full((m, 2 * n), np.nan, F32)
            gemm(a, b, out=wide[:, ::2])
            assert np.array_equal(wide[:, ::2], got) and np.isnan(wide[:, 1::2]).all()
            if dtype != F32:
                o16 = np.empty((m, n), dtype)
                gemm(a, b, out=o16)
                assert np.array_equal(o16.view(np.uint16), got.astype(dtype).view(np.uint16))
            # beta = 1: the product added into out by the GEMM
            acc = rng.standard_normal((m, n)).astype(F32)
            start = acc.copy()
            gemm(a, b, out=acc, accumulate=True)
            np.testing.assert_allclose(acc, start + want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_leading_dimensions_half_and_the_reference_for_the_rest(mkl):
    gemm = mkl_entry(mkl, native=(BF16,))
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 5, 16)).astype(F32)  # (..., M, K): leading dimensions flattened
    b = rng.standard_normal((16, 7)).astype(F32)
    got = gemm(a, b)
    assert got.shape == (2, 5, 7)
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-5)
    # half: fp32 operands cast once to bf16, one bf16 GEMM (as a device takes them)
    h = gemm(a, b, half=BF16)
    np.testing.assert_array_equal(h, gemm(a.astype(BF16), b.astype(BF16)))
    # float64 and a batched right operand: the reference's own result
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.array_equal(gemm(a64, b64), matmul(a64, b64))
    bb = rng.standard_normal((2, 16, 7)).astype(F32)
    assert np.array_equal(gemm(a, bb), np.matmul(a, bb))
    with pytest.raises(ValueError, match="adds into an fp32 out"):
        gemm(a, b, out=np.empty((2, 5, 7), BF16), accumulate=True)
    with pytest.raises(ValueError, match="do not align"):
        gemm(a, b, out=np.empty((2, 5, 6), F32))


def test_sixteen_bits_it_does_not_take_go_by_fp32_tiles(mkl):
    """fp16 on a CPU without AMX-FP16: the reference's tiles, each an MKL sgemm."""
    gemm = mkl_entry(mkl, native=(BF16,))
    rng = np.random.default_rng(4)
    a = rng.standard_normal((37, 64)).astype(F16)
    b = rng.standard_normal((64, 29)).astype(F32)
    want = exact(a, b)
    for scratch in (8 << 20, 4 * 64 * 8):  # one tile; several each way
        got = gemm(a, b, scratch_bytes=scratch)
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got, matmul(a, b, scratch_bytes=scratch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_bits_do_not_depend_on_alignment(mkl, dtype):
    """Fixed shapes give fixed bits whatever the operands' and result's alignment (which the
    threads' allocations change): the one condition MKL's sequential GEMM needs for results
    independent of the thread count without its CNR mode (`exec.blas`)."""
    rng = np.random.default_rng(5)

    def at(x, off):  # a copy of x `off` elements past a 64-byte boundary
        buf = np.empty(x.size + 64, x.dtype)
        base = (-buf.ctypes.data % 64) // x.itemsize
        y = buf[base + off : base + off + x.size].reshape(x.shape)
        y[...] = x
        return y

    for m, k, n in ((512, 96, 200), (37, 53, 29), (3, 300, 5)):
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((n, k)).astype(dtype)
        seen = set()
        for off in range(8):
            c = at(np.zeros((m, n), F32), (3 * off) % 8)
            mkl.gemm(at(a, off), at(b, (off + 5) % 8).T, c)
            seen.add(c.tobytes())
        assert len(seen) == 1, (m, k, n)


def test_auto_takes_mkl_where_the_cpu_has_amx_only(mkl):
    assert choose_blas("auto", "cpu", set()) == choose_blas("auto", "cpu", {"avx512_bf16"})
    plain = choose_blas("auto", "cpu", {"avx512_bf16", "avx512f"})
    assert (plain.name, plain.why) == ("openblas", "auto: no AMX (amx_bf16) on this CPU")
    amx = choose_blas("auto", "cpu", AMX)
    assert (amx.name, amx.native, amx.why) == ("mkl", {BF16}, "auto: AMX")
    assert choose_blas("auto", "cpu", {*AMX, "amx_fp16"}).native == {BF16, F16}
    assert choose_blas("openblas", "cpu", AMX) == blas_of("openblas")
    forced = choose_blas("mkl", "cpu", set())  # anywhere it loads, bf16 native
    assert (forced.name, forced.native, forced.why) == ("mkl", {BF16}, "")
    assert choose_blas("auto", "standin") is None and choose_blas("openblas", "gpu") is None
    t = kernel_table(precision="bf16", blas="auto", cpu_flags=AMX)
    assert t.names["gemm"] == "mkl" and t.native(BF16) and not t.native(F16)
    assert f"blas mkl {mkl.version} (bf16 native; auto: AMX), " in t.describe()
    assert kernel_table(blas="auto", cpu_flags=set()).blas_label() == (
        "openblas (auto: no AMX (amx_bf16) on this CPU)")
    assert kernel_table(blas="mkl", cpu_flags={"amx_fp16"}).blas_label() == (
        f"mkl {mkl.version} (bf16/fp16 native)")


def blas_of(name):
    from ratrain.exec.backends import BlasChoice

    return BlasChoice(name)


def test_refusals_are_one_line_and_auto_says_why(monkeypatch):
    monkeypatch.setattr(blas, "_load", lambda: blas.BlasUnavailable(
        "oneMKL is not installed (the mkl wheel: pip install 'ratrain[mkl]')"))
    with pytest.raises(BackendError, match=r"^run.blas=mkl but oneMKL is not installed \(the mkl "
                       r"wheel: pip install 'ratrain\[mkl\]'\): install it, or set "
                       r"run.blas=auto$"):
        kernel_table(blas="mkl")
    t = kernel_table(blas="auto", cpu_flags=AMX)  # an AMX host without the extra
    assert t.names["gemm"] == "openblas" and t.gemm is matmul
    assert ("blas openblas (auto: oneMKL is not installed (the mkl wheel: pip install "
            "'ratrain[mkl]')), ") in t.describe()
    with pytest.raises(BackendError, match=r"^run.blas=mkl is a host's BLAS, but "
                       r"run.device=standin computes its GEMMs on the device: set "
                       r"run.blas=auto$"):
        choose_blas("mkl", "standin")
    with pytest.raises(BackendError, match=r"^run.blas='acml' is not a BLAS"):
        choose_blas("acml", "cpu")
    with pytest.raises(ConfigError, match=r"run.blas='acml' is not one of: auto, openblas, mkl$"):
        load_config(None, ["run.blas=acml"])


def contexts(precision, blas_mode, flags=None, threads=1):
    table = kernel_table(np, precision, attention=TiledAttention(4), blas=blas_mode,
                         cpu_flags=flags)
    return ExecContext(M, precision, kernels=table, threads=threads)


def layer_and_head(ctx, x, dy, t, P, recompute="none"):
    y, dx, g, _ = run_layer(ctx, x, P[1], dy, recompute)
    loss, cache = head.head_forward(x, t, P[-1], ctx)
    gh = zeros_like(P[-1], np.float32)
    dxh = head.head_backward(0.5, cache, P[-1], gh, ctx)
    return [y, dx, *g.values(), loss, dxh, *gh.values()]


@pytest.mark.parametrize("precision,flags", [("fp32", None), ("bf16", None),
                                             ("fp16", {"amx_fp16"}), ("fp16", None)])
def test_mkl_layers_are_bitwise_over_threads_and_recompute(mkl, precision, flags, monkeypatch):
    monkeypatch.setattr(layers, "GRAD_BLOCK_ROWS", 4)  # weight gradients in several row blocks
    dt = kernels.DTYPES[precision]
    P = [{k: v.astype(dt) for k, v in b.items()} for b in make_params(M, np.float32, scale=0.1)]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, M.seq_len, M.hidden)).astype(dt)  # 4 chunks of 1 or 2
    dy = rng.standard_normal(x.shape).astype(dt)
    t = rng.integers(0, M.vocab_size, x.shape[:2])
    native = precision == "bf16" or flags is not None
    with contexts(precision, "mkl", flags) as ctx:
        assert ctx.half_layout == native and (ctx.gemm_half is not None) == native
        if native:  # the GEMMs take the 16-bit weights: no fp32 copy of them
            assert {w.dtype for w in layers._gemm_weights(P[1], ctx).values()} == {dt}
        ref = layer_and_head(ctx, x, dy, t, P)
    for threads in (1, 2, 4):
        for recompute in ("none", "selective", "full"):
            with contexts(precision, "mkl", flags, threads) as ctx:
                got = layer_and_head(ctx, x, dy, t, P, recompute)
            for i, (a, b) in enumerate(zip(ref, got)):
                assert a.dtype == b.dtype and np.array_equal(a, b), (threads, recompute, i)
    # against OpenBLAS: the rounding of 16-bit activations before each GEMM, or sgemm's order
    with contexts(precision, "openblas") as ctx:
        other = layer_and_head(ctx, x, dy, t, P)
    tol = {"fp32": 1e-5, "fp16": 3e-3, "bf16": 2e-2}[precision]
    for i, (a, b) in enumerate(zip(ref, other)):
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), i


def _flat_grads(params):
    """Zeroed fp32 gradients of `params`, views of one flat buffer in their order."""
    flat = standin.zeros(sum(v.size for v in params.values()), np.float32)
    g, o = {}, 0
    for k, v in params.items():
        g[k] = flat[o : o + v.size].reshape(v.shape)
        o += v.size
    return g


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_layout_runs_on_a_device_with_its_bits(precision):
    """A device runs the 16-bit layout (its GEMMs into fp32 by GemmEx, `exec.devgemm`, the
    gradients of wq, wk, wv in one GEMM); there (the stand-in), with one batch chunk, it gives
    the bits of the path without it (fp32 partials added after each GEMM), in fewer device
    operations."""
    dt = kernels.DTYPES[precision]
    P = [{k: standin.asarray(v.astype(dt)) for k, v in b.items()}
         for b in make_params(M, np.float32, scale=0.1)]
    rng = np.random.default_rng(8)
    x, dy = (standin.asarray(rng.standard_normal((3, M.seq_len, M.hidden)).astype(dt))
             for _ in range(2))
    t = standin.asarray(rng.integers(0, M.vocab_size, (3, M.seq_len)))
    out, ops = {}, {}
    for layout in (False, True):
        table = kernel_table(standin, precision, attention=TiledAttention(4))
        with ExecContext(M, precision, xp=standin, kernels=table, head_chunk_bytes=4 * 27 * 9) \
                as ctx:
            assert ctx.gemm_half == dt and ctx.half_layout
            ctx.half_layout = layout
            COUNTS.clear()
            g = _flat_grads(P[1])  # as a block's: wq, wk, wv back to back (one GEMM)
            y, cache = layers.layer_forward(x, P[1], ctx)
            dx = layers.layer_backward(dy, cache, P[1], g, ctx)
            loss, hc = head.head_forward(x, t, P[-1], ctx)
            gh = {k: standin.zeros(v.shape, np.float32) for k, v in P[-1].items()}
            dxh = head.head_backward(0.5, hc, P[-1], gh, ctx)
            ops[layout] = COUNTS["ops"]
            out[layout] = [a.get() for a in (y, dx, *g.values(), loss, dxh, *gh.values())]
    for i, (a, b) in enumerate(zip(*out.values())):
        assert np.array_equal(a, b), i
    assert ops[True] < ops[False], ops


def test_a_bf16_run_trains_on_mkl_and_every_policy_agrees(mkl):
    ref = None
    for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain", "gpipe"):
        cfg = tiny_config(m=3, precision="bf16", policy=policy, steps=4)
        res, state, ex = train(replace(cfg, run=replace(cfg.run, blas="mkl")))
        assert ex.ctx.kernels.names["gemm"] == "mkl" and ex.ctx.half_layout
        losses = [r.loss for r in res] + [r.grad_norm for r in res]
        if ref is None:
            ref = (losses, state.master_buf.copy())
        else:
            assert losses == ref[0], policy
            assert np.array_equal(state.master_buf, ref[1]), policy
    assert all(np.isfinite(ref[0])) and ref[0][3] < ref[0][0]
    res, _, _ = train(tiny_config(m=3, precision="bf16", steps=4))  # auto: openblas here
    np.testing.assert_allclose(ref[0][:4], [r.loss for r in res], rtol=2e-2)
    # a rank's GEMMs take its bf16 views as they lie in the flat buffer: no copy at all
    rank = build_rank(replace(cfg, run=replace(cfg.run, blas="mkl")))
    try:
        assert layer_weight_copy_nbytes(rank) == 0
    finally:
        rank.close()


def test_bench_says_which_blas_each_contender_ran(mkl, tmp_path):
    out = tmp_path / "b.json"
    bench.main(["--no-torch", "--rounds", "1", "--warmup", "0", "--precisions", "fp32,bf16",
                "--blas", "openblas,mkl", "--set", "model.layers=1", "--set", "model.seq_len=32",
                "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["blas"] == {"ratrain_fp32_openblas": "openblas",
                         "ratrain_fp32_mkl": f"mkl {mkl.version} (bf16 native)",
                         "ratrain_bf16_openblas": "openblas",
                         "ratrain_bf16_mkl": f"mkl {mkl.version} (bf16 native)"}
    for k in ("fp32_mkl_time_over_openblas", "bf16_mkl_time_over_openblas",
              "bf16_time_over_fp32", "fp32_gflops_over_sgemm"):
        assert r[k] > 0
    bench.main(["--profile", "--rounds", "1", "--warmup", "0", "--precisions", "bf16",
                "--blas", "mkl", "--set", "model.layers=1", "--set", "model.seq_len=32",
                "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["bf16"]["blas"] == f"mkl {mkl.version} (bf16 native)" and "fp32" in r
    assert "gemm" in {k["category"] for k in r["bf16"]["kernels"]}
