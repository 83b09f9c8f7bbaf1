"""Device ranks (`run.device`) without a GPU: the stand-in refuses what cupy refuses, every
host/device boundary of the runtime is explicit (batches in once a step, one host sync a step,
full state, checkpoints, eval, generation and export out), and a device run agrees with the
host's. The device tests run over every device this machine has (tests/_devices.py): the
stand-in always, a GPU when there is one (scripts/gpu-check.sh)."""

import numpy as np
import pytest

from ratrain import api
from ratrain.checkpoint import checkpoint_config, load_stage, save_checkpoint
from ratrain.config import ConfigError, ModelConfig, replace
from ratrain.data import write_tokens
from ratrain.device import (
    Device,
    DeviceError,
    HostStaging,
    host_floats,
    open_device,
    stacked_rows,
    to_device,
    to_host,
)
from ratrain.device.standin import COUNTS, StandinArray, standin
from ratrain.exec import devlaunch, head, kernels, layers
from ratrain.exec.backends import kernel_table, kernels_for
from ratrain.exec.context import ExecContext
from ratrain.runtime.rank import build_rank
from ratrain.plan.check import run_plan
from tests._devices import DEVICES, GPU, MODULES, host
from tests._executor_util import MODEL, global_batch, layer_weight_copy_nbytes, tiny_config
from tests._prereq import need
from tests.test_layers import M, make_params, zeros_like
from tests.test_train import job, train  # noqa: F401  (job: a pytest fixture)

xp = standin


# ---- the stand-in: cupy's rules ----------------------------------------------------------------


def test_standin_refuses_implicit_host_conversion():
    a = xp.arange(6, dtype=xp.float32).reshape(2, 3)
    h = np.ones(3, np.float32)
    for bad in (lambda: np.asarray(a), lambda: np.array(a), lambda: memoryview(a),
                lambda: a + h, lambda: h * a, lambda: np.add(a, h), lambda: xp.add(h, h),
                lambda: xp.concatenate([a, h[None]]), lambda: a.__setitem__(0, h),
                lambda: xp.matmul(a, h), lambda: a.tobytes()):
        with pytest.raises((TypeError, AttributeError)):
            bad()


def test_standin_allows_what_cupy_allows_and_counts_syncs():
    COUNTS.clear()
    a = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))  # an explicit upload
    assert COUNTS["uploads"] == 1 and isinstance(a, StandinArray)
    s = a.sum()
    assert isinstance(s, StandinArray) and s.shape == ()  # reductions stay on the device
    assert isinstance(np.sqrt(a), StandinArray)  # np.* on a device array runs on the device
    assert isinstance(np.concatenate([a, a]), StandinArray)
    assert COUNTS["syncs"] == 0
    assert float(s) == 15.0 and bool(s > 0) and s.item() == 15.0  # host syncs, counted
    assert COUNTS["syncs"] == 3
    np.testing.assert_array_equal(a.get(), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(xp.asnumpy(a[1]), [3, 4, 5])
    assert COUNTS["downloads"] == 2
    a[0] = xp.zeros(3, xp.float32)
    a += 1
    assert to_host(a).tolist() == [[1, 1, 1], [4, 5, 6]]
    idx = xp.asarray(np.array([0, 0, 1]))
    t = xp.zeros(2, xp.float32)
    xp.add.at(t, idx, 1.0)
    assert to_host(t).tolist() == [2.0, 1.0]


def test_standin_counts_device_operations_not_views():
    a = xp.zeros((4, 6), xp.float32)

    def ops(f) -> int:
        COUNTS.clear()
        f()
        return COUNTS["ops"]

    for none in (lambda: a.reshape(6, 4), lambda: a.T, lambda: a[1:3], lambda: xp.empty(3),
                 lambda: a.astype(np.float32, copy=False), lambda: xp.ascontiguousarray(a)):
        assert ops(none) == 0  # views, an allocation, no-op casts: no device work
    for one in (lambda: a + a, lambda: a.__iadd__(1.0), lambda: xp.exp(a), lambda: np.exp(a),
                lambda: a.sum(axis=0), lambda: a.astype(np.float16), lambda: a @ a.T,
                lambda: a.__setitem__(slice(0, 2), 1.0), lambda: xp.zeros(3),
                lambda: a.T.reshape(24), lambda: np.concatenate([a, a]), lambda: a.copy()):
        assert ops(one) == 1  # a kernel each (a reshape that copies is one)
    idx = xp.arange(2)
    assert ops(lambda: a[idx]) == 1  # a gather

    def add_into_rows():
        a[1:3] += 1.0  # the view's add; storing it back into itself is no work (cupy skips it)

    assert ops(add_into_rows) == 1
    assert ops(lambda: a.__setitem__(slice(1, 3), a[0:2])) == 1  # another view: a copy


def test_standin_counts_casts_among_its_operations():
    a, h = xp.zeros((4, 6), xp.float32), xp.zeros((4, 6), xp.float16)

    def casts(f) -> int:
        COUNTS.clear()
        f()
        return COUNTS["casts"]

    for one in (lambda: a.astype(np.float16), lambda: h.__setitem__(slice(0, 2), a[0:2]),
                lambda: xp.copyto(h, a)):
        assert casts(one) == 1
    for none in (lambda: a.astype(np.float32), lambda: a.copy(), lambda: xp.copyto(a, a + 1),
                 lambda: h.__setitem__(slice(0, 2), h[2:4]), lambda: a + a):
        assert casts(none) == 0


def test_transfers_and_staging():
    h = np.arange(4, dtype=np.float32)
    assert to_host(h) is h and to_device(np, h) is h  # the host: no copies
    d = to_device(xp, h)
    assert isinstance(d, StandinArray) and to_host(d).tolist() == h.tolist()
    COUNTS.clear()
    vals = [d.sum(), d.max(), (d * d).sum()]
    assert host_floats(xp, vals) == [6.0, 3.0, 14.0]
    assert COUNTS["downloads"] == 1  # one download for all of them
    assert host_floats(np, [np.float32(1.5), 2]) == [1.5, 2.0]
    st = HostStaging(xp)
    assert st.needed and not HostStaging(np).needed
    buf = st.download(d)
    assert isinstance(buf, np.ndarray) and buf.tolist() == h.tolist()
    buf *= 2
    st.upload(buf, d)
    st.give(buf)
    assert to_host(d).tolist() == [0, 2, 4, 6]
    assert st.take((4,), np.float32) is buf and st.nbytes == 16  # pooled, reused


def test_stacked_rows_are_views_on_host_and_device():
    for m in (np, standin):
        flat = to_device(m, np.arange(20, dtype=np.float32))
        a, b = flat[0:8].reshape(2, 4), flat[8:20].reshape(3, 4)
        s = stacked_rows([a, b])
        assert s.shape == (5, 4) and to_host(s)[2].tolist() == [8, 9, 10, 11]
        assert stacked_rows([b, a]) is None  # not back to back
        flat[8] = 100.0
        assert float(s[2, 0]) == 100.0  # a view, not a copy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_device_layers_copy_no_weights(device, precision):
    # the GEMM weights of a layer on a device are views of its parameter views (no copy per
    # call: wq|wk|wv and w_gate|w_up lie back to back in the flat buffers)
    rank = build_rank(tiny_config(precision=precision), None, cap=None,
                      device=open_device(device))
    try:
        assert layer_weight_copy_nbytes(rank) == 0
        half = {"fp16": np.dtype(np.float16), "bf16": kernels.BF16}.get(precision)
        assert rank.ctx.gemm_half == half  # the layers' GEMMs in 16 bits on a device
    finally:
        rank.close()


def test_open_device_and_its_refusals():
    assert open_device("cpu").xp is np and open_device("standin").xp is standin
    assert "standin" in open_device("standin").describe()
    with pytest.raises(DeviceError, match="run.device: 'tpu'"):
        open_device("tpu")
    with pytest.raises(ConfigError, match="run.device='tpu'"):
        replace(tiny_config(), run=replace(tiny_config().run, device="tpu"))
    if GPU is None:
        with pytest.raises(DeviceError) as e:
            open_device("gpu")
        assert "run.device: gpu" in str(e.value) and "\n" not in str(e.value)
    else:
        assert GPU.name and GPU.memory_bytes > 0


def test_device_memory_check_names_the_card():
    cfg = tiny_config()
    plan = run_plan(cfg, 0)
    card = Device("gpu", standin, "Test card", 0, plan.peaks[0] // 2, visible=1)
    with pytest.raises(ConfigError, match=r"Test card.*run.device: gpu"):
        plan.check_device(0, card)
    big = replace(card, memory_bytes=plan.peaks[0] * 3)
    plan.check_device(0, big, local_ranks=2)  # two ranks on one card: fits 3 peaks
    with pytest.raises(ConfigError, match="shared by 4 rank"):
        plan.check_device(0, big, local_ranks=4)
    assert replace(big, visible=2).sharing(4) == 2


# ---- kernels, layers, the optimizer and the executor on a device --------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_layer_embed_and_head_agree_with_the_host(device, precision):
    dxp = MODULES[device]
    dt = np.float16 if precision == "fp16" else np.float32
    P = [{k: v.astype(dt) for k, v in b.items()} for b in make_params(M, np.float32, scale=0.1)]
    rng = np.random.default_rng(3)
    ids = rng.integers(0, M.vocab_size, (2, M.seq_len))
    t = rng.integers(0, M.vocab_size, (2, M.seq_len))
    dy = rng.standard_normal((2, M.seq_len, M.hidden)).astype(dt)
    out = {}
    for name, m in (("host", np), ("device", dxp)):
        dev = lambda a, m=m: to_device(m, a)  # noqa: E731
        Pd = [{k: dev(v) for k, v in b.items()} for b in P]
        with ExecContext(M, precision, m, threads=1) as ctx:
            x, ec = layers.embed_forward(dev(ids), Pd[0], ctx)
            y, cache = layers.layer_forward(x, Pd[1], ctx)
            loss, hc = head.head_forward(y, dev(t), Pd[-1], ctx)
            gh = {k: dev(v) for k, v in zeros_like(P[-1], np.float32).items()}
            dxh = head.head_backward(0.5, hc, Pd[-1], gh, ctx)
            g = {k: dev(v) for k, v in zeros_like(P[1], np.float32).items()}
            dx = layers.layer_backward(dev(dy), cache, Pd[1], g, ctx)
            ge = {k: dev(v) for k, v in zeros_like(P[0], np.float32).items()}
            layers.embed_backward(dx, ec, Pd[0], ge, ctx)
        out[name] = [host(a) for a in (x, y, loss, dxh, dx, *gh.values(), *g.values(),
                                       *ge.values())]
    tol = 2e-2 if precision == "fp16" else 2e-5
    for a, b in zip(out["device"], out["host"]):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-30)


def test_head_chunk_is_the_devices_unless_the_config_gives_one():
    """cpu 16 MiB (a core's cache), a device 256 MiB (fewer, larger launches); the config's
    `run.head_chunk_mib` over both, as far as the rank's context; on the stand-in a smaller
    chunk is more device operations for the same loss and gradients."""
    from ratrain.exec.context import HEAD_CHUNK_BYTES

    assert HEAD_CHUNK_BYTES == {"cpu": 16 << 20, "gpu": 256 << 20, "standin": 256 << 20}
    assert ExecContext(M).head_chunk_bytes == 16 << 20
    assert ExecContext(M, xp=standin).head_chunk_bytes == 256 << 20
    assert ExecContext(M, head_chunk_bytes=3 << 20).head_chunk_bytes == 3 << 20
    cfg = tiny_config()
    for mib, want in ((0, 16 << 20), (3, 3 << 20)):
        c = replace(cfg, run=replace(cfg.run, head_chunk_mib=mib))
        assert ExecContext.from_config(c).head_chunk_bytes == want
        rank = build_rank(c, None, cap=None)
        try:
            assert rank.ctx.head_chunk_bytes == want
        finally:
            rank.close()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, M.seq_len, M.hidden)).astype(np.float32)
    t = rng.integers(0, M.vocab_size, (2, M.seq_len))
    P = {k: to_device(xp, v) for k, v in make_params(M, np.float32, scale=0.1)[-1].items()}
    res = {}
    for chunk in (4 * 5 * M.vocab_size, 256 << 20):  # 5 rows / columns at a time, or all
        with ExecContext(M, "fp32", xp, threads=1, head_chunk_bytes=chunk) as ctx:
            COUNTS.clear()
            loss, cache = head.head_forward(to_device(xp, x), to_device(xp, t), P, ctx)
            g = {k: xp.zeros(v.shape, xp.float32) for k, v in P.items()}
            dx = head.head_backward(1.0, cache, P, g, ctx)
            res[chunk] = COUNTS["ops"], [host(a) for a in (loss, dx, *g.values())]
    (small, a), (big, b) = res.values()
    assert small > 2 * big > 0, (small, big)
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_head_computed_once_is_the_chunked_head_to_16_bit_logits(precision):
    """`run.head`: on a device at fp16 and bf16 the head makes its logits once, in 16 bits, with
    their gradient written over them by the loss's kernel, and the backward runs two GEMMs:
    fewer device operations, the chunked head's loss and gradients to the rounding of 16-bit
    logits (its dlogits kept in the cache, for the backward). A forward with no backward to
    follow (eval) keeps nothing of that kind."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, M.seq_len, M.hidden)).astype(np.float32)
    t = rng.integers(0, M.vocab_size, (2, M.seq_len))
    P0 = make_params(M, np.float32, scale=0.1)[-1]
    res = {}
    for mode in ("chunks", "once"):
        with ExecContext(M, precision, xp, threads=1, head=mode) as ctx:
            assert ctx.head_once == (mode == "once")
            P = {k: to_device(xp, v.astype(ctx.dtype)) for k, v in P0.items()}
            xd, td = to_device(xp, x.astype(ctx.dtype)), to_device(xp, t)
            COUNTS.clear()
            loss, cache = head.head_forward(xd, td, P, ctx, backward=True)
            g = {k: xp.zeros(v.shape, xp.float32) for k, v in P.items()}
            dx = head.head_backward(3.0, cache, P, g, ctx)
            res[mode] = COUNTS["ops"], [host(a) for a in (loss, dx, *g.values())]
            kept = cache.parts[0].get("dlogits")
            if mode == "once":
                assert kept.dtype == ctx.dtype and kept.shape == (2 * M.seq_len, M.vocab_size)
            else:
                assert kept is None
            assert "dlogits" not in head.head_forward(xd, td, P, ctx)[1].parts[0]  # eval's
    (n_chunks, a), (n_once, b) = res["chunks"], res["once"]
    assert n_once < n_chunks, (n_once, n_chunks)
    tol = 2.0 ** -7 if precision == "bf16" else 2.0 ** -10
    for u, v in zip(a, b):
        u, v = u.astype(np.float64), v.astype(np.float64)
        assert np.linalg.norm(u - v) <= tol * np.linalg.norm(u)


def test_run_head_once_is_refused_in_one_line_where_it_cannot_run():
    cfg = tiny_config()
    for run, precision in (({"head": "once"}, "bf16"), ({"head": "once", "device": "standin"},
                                                        "fp32")):
        with pytest.raises(ConfigError, match=r"run.head=once .* set run.head=auto or chunks"):
            replace(cfg, precision=precision, run=replace(cfg.run, **run))
    with pytest.raises(ConfigError, match="run.head"):
        replace(cfg, run=replace(cfg.run, head="whole"))
    with pytest.raises(ValueError, match=r"run.head=once .* not cpu at fp16"):
        ExecContext(M, "fp16", head="once")
    assert not ExecContext(M, "bf16", xp, head="chunks").head_once
    assert ExecContext(M, "bf16", xp).head_once and not ExecContext(M, "bf16").head_once


SMALL = ModelConfig(vocab_size=16, hidden=8, layers=1, heads=2, kv_heads=1, ffn_hidden=16,
                    seq_len=4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_device_kernels_are_wired_where_a_gpu_takes_them(monkeypatch, precision):
    # what a GPU rank runs (exec.devkernels for RMSNorm, RoPE, SwiGLU, AdamW and the gradient
    # norm, exec.devloss for the head's cross-entropy), here on the stand-in in numba-cuda's
    # simulator: slow, so a model of one tiny layer, one step, against the host's numpy (the
    # GPU check runs every device test with these kernels on the card); in bf16 too, whose
    # norm weights are bf16 views the kernels read through their bits (they once went to
    # cupy's composition instead)
    need("numba.cuda")
    cfg = tiny_config(model=SMALL, m=1, micro_batch=1, precision=precision)
    if devlaunch.simulated():
        device = "standin"
        cfg = replace(cfg, run=replace(cfg.run, devkernels="sim"))
        # the simulator's cost is per block and per thread: one block per grid-stride kernel,
        # blocks of 8 threads (the kernels are correct at any grid; tests/test_devkernels.py
        # checks each at several)
        monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 1)
        monkeypatch.setattr(devlaunch, "SIM_THREADS", 8)
    else:  # the simulator off: a GPU (scripts/gpu-check.sh), where cupy ranks take them
        assert GPU is not None, "NUMBA_ENABLE_CUDASIM=0 but no GPU: set it to 1 on a CPU"
        device = "gpu"
    table = kernels_for(cfg, MODULES[device])
    assert table.names["rmsnorm"] == table.names["grad_norm"] == "devkernels", table.names
    assert kernels_for(cfg, MODULES["standin"] if device == "gpu" else np).names["rmsnorm"] != \
        "devkernels"  # the other device of this run does not take them
    (host_res, _), = _steps(cfg, "cpu", steps=1)[0]
    launched = []
    real = devlaunch.launch
    monkeypatch.setattr(devlaunch, "launch", lambda k, *a: launched.append(k) or real(k, *a))
    dev_steps, dev_params = _steps(cfg, device, steps=1)
    names = {getattr(getattr(k, "py_func", k), "__name__", "") for k in launched}
    once = {"ce_grad"} if precision == "fp32" else set()  # bf16: the head computed once
    assert {"rmsnorm_fwd", "rmsnorm_bwd", "rope", "swiglu_fwd", "ce_rows", "adamw",
            "sum_squares", *once} <= names, names
    # bf16: the device's GEMMs round their results to bf16, the host's stay fp32; a weight
    # whose gradient is near 0 may take AdamW's step (lr) either way
    rel, atol = (1e-6, 1e-6) if precision == "fp32" else (1e-2, 2.5 * cfg.optim.lr)
    assert dev_steps[0][0].loss == pytest.approx(host_res.loss, rel=rel)
    assert dev_steps[0][0].grad_norm == pytest.approx(host_res.grad_norm, rel=10 * rel)
    for name, w in _steps(cfg, "cpu", steps=1)[1].items():
        np.testing.assert_allclose(dev_params[name], w, rtol=0, atol=atol, err_msg=name)


def test_bf16_inputs_reach_the_device_kernels(monkeypatch):
    """bf16 inputs (a norm's weight, the fused attention's dq) go to the kernels, which read
    them through their bits, not to cupy's composition, with the reference's values (in
    numba-cuda's simulator on the stand-in; on a card under scripts/gpu-check.sh)."""
    need("numba.cuda")
    if devlaunch.simulated():
        dxp, mode = standin, "sim"
        monkeypatch.setattr(devlaunch, "MAX_BLOCKS", 1)
        monkeypatch.setattr(devlaunch, "SIM_THREADS", 8)
    else:
        assert GPU is not None, "NUMBA_ENABLE_CUDASIM=0 but no GPU: set it to 1 on a CPU"
        dxp, mode = GPU, "on"
    table = kernel_table(dxp, "bf16", devkernels_mode=mode)
    launched = []
    real = devlaunch.launch
    monkeypatch.setattr(devlaunch, "launch", lambda k, *a: launched.append(k) or real(k, *a))
    rng = np.random.default_rng(6)
    bf16 = kernels.BF16
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)  # (b, T, C)
    w = (1 + 0.1 * rng.standard_normal(8)).astype(bf16)
    dy = rng.standard_normal((2, 3, 8)).astype(np.float32)
    y, cache = table.rmsnorm_forward(to_device(dxp, x), to_device(dxp, w), 1e-5, dxp)
    dx, dw = table.rmsnorm_backward(to_device(dxp, dy), cache, dxp)
    ry, rcache = kernels.rmsnorm_forward(x, w, 1e-5, np)
    rdx, rdw = kernels.rmsnorm_backward(dy, rcache, np)
    cos, sin = kernels.rope_tables(3, 4, 10000.0)
    dq = rng.standard_normal((2, 3, 2, 4)).astype(bf16)  # (b, T, H, D), as cuDNN hands it
    dr = table.rope_backward(to_device(dxp, dq), (to_device(dxp, cos[:, None]),
                                                  to_device(dxp, sin[:, None])), dxp)
    rdr = kernels.rope_backward(dq, (cos[:, None], sin[:, None]), np)
    names = {getattr(getattr(k, "py_func", k), "__name__", "") for k in launched}
    assert {"rmsnorm_fwd", "rmsnorm_bwd", "rope"} <= names, names
    for got, ref in ((y, ry), (dx, rdx), (dw, rdw), (dr, rdr)):
        np.testing.assert_allclose(host(got), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_kernels_writing_16_bits_train_bitwise_as_casting_after(monkeypatch, precision):
    """A device's kernels write the 16-bit GEMM operands themselves (`ExecContext.out16`: the
    norms', RoPE's, SwiGLU's outputs, dgate|dup, dq|dk|dv) and read 16-bit inputs as they are;
    the same steps with fp32 outputs and a cast after each, and fp32 copies in, give the same
    bits, in more casts (counted on the stand-in)."""
    cfg = tiny_config(precision=precision, m=2)
    cfg = replace(cfg, run=replace(cfg.run, devkernels="count", attention="cudnn-count"))
    fused, fused_params = _steps(cfg, "standin", steps=2)
    init = ExecContext.__init__

    def cast_after(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.out16 = None

    monkeypatch.setattr(ExecContext, "__init__", cast_after)
    casts, casts_params = _steps(cfg, "standin", steps=2)
    assert [(r.loss, r.grad_norm) for r, _ in fused] == [(r.loss, r.grad_norm) for r, _ in casts]
    for name, w in casts_params.items():
        np.testing.assert_array_equal(fused_params[name], w, err_msg=name)
    assert fused[-1][1]["casts"] < casts[-1][1]["casts"] - 8 * MODEL.layers, \
        (fused[-1][1], casts[-1][1])


def _steps(cfg, device, steps=3):
    rank = build_rank(cfg, None, cap=None, device=open_device(device))
    COUNTS.clear()
    per_step = []
    try:
        for s in range(steps):
            before = dict(COUNTS)
            res = rank.executor.run_step(s, global_batch(cfg, s))
            per_step.append((res, {k: COUNTS[k] - before.get(k, 0) for k in COUNTS}))
        rank.executor.flush()
        return per_step, rank.executor.full_params()
    finally:
        rank.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_executor_on_a_device_matches_the_host_with_one_sync_a_step(device, precision):
    cfg = tiny_config(precision=precision, grad_clip=0.5)
    host_steps, host_params = _steps(cfg, "cpu")
    dev_steps, dev_params = _steps(cfg, device)
    tol = 2e-3 if precision == "fp16" else 1e-6
    for (h, _), (d, counts) in zip(host_steps, dev_steps):
        assert d.loss == pytest.approx(h.loss, rel=tol)
        assert d.grad_norm == pytest.approx(h.grad_norm, rel=100 * tol)
        assert d.skipped == h.skipped and d.lr == h.lr
        if device == "standin":  # exactly what crosses per step
            assert counts.get("syncs", 0) == 1, counts  # the step's facts: one download
            assert counts.get("uploads", 0) == 2, counts  # inputs and targets
    for name, w in host_params.items():
        assert isinstance(dev_params[name], np.ndarray)  # full state comes to the host
        np.testing.assert_allclose(dev_params[name], w, rtol=0, atol=50 * tol, err_msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_moves_between_host_and_device_bitwise(device, tmp_path):
    cfg = tiny_config()
    written = {}
    for src, dst in ((device, "cpu"), ("cpu", device)):
        rank = build_rank(cfg, None, cap=None, device=open_device(src))
        try:
            for s in range(2):
                rank.executor.run_step(s, global_batch(cfg, s))
            rank.executor.flush()
            path = save_checkpoint(str(tmp_path / f"from-{src}"), 2, cfg, rank.state.state_dict(),
                                   {"executor": rank.executor.state_dict()})
            written = {k: {n: to_host(a).copy() for n, a in d.items()}
                       for k, d in rank.state.state_dict().items()}
        finally:
            rank.close()
        other = build_rank(cfg, None, cap=None, device=open_device(dst),
                           load=lambda st, path=path: load_stage(st, path))
        try:
            got = other.state.state_dict()
            for k in written:
                for n, a in written[k].items():
                    assert np.array_equal(to_host(got[k][n]), a), (src, dst, k, n)
        finally:
            other.close()


# ---- the commands ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_train_eval_and_generate_on_a_device_then_resume_on_the_host(job, tmp_path, device):  # noqa: F811
    run = tmp_path / "run"
    write_tokens(job.parent / "val.bin", np.random.default_rng(1).integers(0, 64, 4000),
                 vocab_size=64)
    p = train(job, run, f"run.device={device}", "checkpoint.interval=2", "data.eval_interval=2")
    assert f"device {device}" in p.stdout and "eval loss" in p.stdout
    p = train(job, run, "run.device=cpu", "run.steps=6", "checkpoint.resume=auto")
    assert "step     6/6" in p.stdout
    ckpt = str(run / "checkpoints")
    with api.load(ckpt, device=device) as d, api.load(ckpt) as h:
        ids = np.arange(10) % 64
        np.testing.assert_allclose(d.logits(ids), h.logits(ids), rtol=1e-5, atol=1e-5)
        assert d.generate([1, 2, 3], 5, temperature=0) == h.generate([1, 2, 3], 5, temperature=0)
    path, cfg, _ = checkpoint_config(ckpt)  # the eval command's path, in this process
    losses = [api.evaluate(replace(cfg, run=replace(cfg.run, device=d)), None, path).loss
              for d in (device, "cpu")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_gpu_is_refused_in_one_line_before_any_work_without_one(job, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    p = train(job, run, "run.device=gpu", check=False)
    if GPU is None:
        assert p.returncode == 2, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "run.device: gpu" in lines[0], p.stderr
        assert not run.exists()
    else:
        assert p.returncode == 0 and f"device gpu {GPU.index}" in p.stdout, p.stderr
