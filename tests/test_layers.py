"""Block kernels: the fast layer against a composition of plain kernels, finite differences on a
whole layer (fp64), recompute choices bitwise equal, fp16 close to fp32, threads, and transformers."""

from __future__ import annotations

import numpy as np
import pytest

from ratrain.config import ModelConfig
from ratrain.exec import kernels
from ratrain.exec import head, layers
from ratrain.exec.attention import TiledAttention
from ratrain.exec.backends import kernel_table
from ratrain.exec.context import ExecContext
from ratrain.exec.spec import model_blocks
from ratrain.shim.ledger import Ledger
from tests._prereq import need

M = ModelConfig(vocab_size=40, hidden=16, layers=2, heads=4, kv_heads=2, ffn_hidden=24,
                seq_len=9, rope_theta=500.0)


def tiled(precision, tile=4, **kw):
    """An ExecContext of M whose attention runs tiles of `tile` (several a sequence)."""
    table = kernel_table(np, precision, attention=TiledAttention(tile))
    return ExecContext(M, precision, kernels=table, **kw)


def make_params(m, dtype=np.float64, seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    out = []
    for b in model_blocks(m):
        d = {}
        for q in b.params:
            base = 1.0 if q.init == "ones" else 0.0
            d[q.local] = (base + scale * rng.standard_normal(q.shape)).astype(dtype)
        out.append(d)
    return out  # [embed, layers..., head]


def zeros_like(p, dtype=np.float64):
    return {k: np.zeros(v.shape, dtype) for k, v in p.items()}


def ref_layer(x, p, m):
    """The layer composed from plain kernels (reference attention, no fusion, no threads)."""
    B, T, C = x.shape
    H, KV, D = m.heads, m.kv_heads, m.head_dim
    cos, sin = kernels.rope_tables(T, D, m.rope_theta, np, x.dtype)
    xn, _ = kernels.rmsnorm_forward(x, p["attn_norm"], m.norm_eps, np)
    q = (xn @ p["attn.wq"].T).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    k = (xn @ p["attn.wk"].T).reshape(B, T, KV, D).transpose(0, 2, 1, 3)
    v = (xn @ p["attn.wv"].T).reshape(B, T, KV, D).transpose(0, 2, 1, 3)
    q, _ = kernels.rope_forward(q, cos, sin, np)
    k, _ = kernels.rope_forward(k, cos, sin, np)
    o, _ = kernels.attention_forward(q, k, v, np)
    h = x + o.transpose(0, 2, 1, 3).reshape(B, T, H * D) @ p["attn.wo"].T
    hn, _ = kernels.rmsnorm_forward(h, p["mlp_norm"], m.norm_eps, np)
    y, _ = kernels.mlp_forward(hn, p["mlp.w_gate"], p["mlp.w_up"], p["mlp.w_down"], np)
    return h + y


def run_layer(ctx, x, p, dy, recompute="none"):
    g = zeros_like(p, np.float64 if ctx.dtype == np.float64 else np.float32)
    y, cache = layers.layer_forward(x, p, ctx, recompute)
    dx = layers.layer_backward(dy, cache, p, g, ctx)
    return y, dx, g, cache


@pytest.mark.parametrize("threads", [1, 2])
def test_layer_matches_plain_reference(threads):
    P = make_params(M)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, M.seq_len, M.hidden))
    with tiled("fp64", threads=threads) as ctx:
        y, _ = layers.layer_forward(x, P[1], ctx)
    np.testing.assert_allclose(y, ref_layer(x, P[1], M), rtol=1e-12, atol=1e-12)


def test_layer_finite_differences():
    P = make_params(M)
    p = P[1]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, M.seq_len, M.hidden))
    r = rng.standard_normal(x.shape)
    with tiled("fp64", threads=2) as ctx:
        _, dx, g, _ = run_layer(ctx, x, p, r)

        def loss():
            return float((layers.layer_forward(x, p, ctx)[0] * r).sum())

        checks = [(x, dx)] + [(p[k], g[k]) for k in p]
        for arr, grad in checks:
            flat, gflat = arr.reshape(-1), grad.reshape(-1)
            for i in rng.choice(flat.size, 4, replace=False):
                old = flat[i]
                flat[i] = old + 1e-6
                lp = loss()
                flat[i] = old - 1e-6
                lm = loss()
                flat[i] = old
                num = (lp - lm) / 2e-6
                assert abs(num - gflat[i]) <= 1e-6 + 1e-5 * abs(num), (num, gflat[i])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_recompute_choices_give_bitwise_equal_gradients(precision, threads):
    dt = np.float16 if precision == "fp16" else np.float32
    P = make_params(M, dt)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, M.seq_len, M.hidden)).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    with tiled(precision, threads=threads) as ctx:
        y0, dx0, g0, c0 = run_layer(ctx, x, P[1], dy, "none")
        sizes = {"none": layers.cache_nbytes(c0)}
        for rc in ("selective", "full"):
            y, dx, g, c = run_layer(ctx, x, P[1], dy, rc)
            sizes[rc] = layers.cache_nbytes(c)
            assert y.dtype == dt and dx.dtype == dt
            np.testing.assert_array_equal(y, y0)
            np.testing.assert_array_equal(dx, dx0)
            for k in g0:
                assert g[k].dtype == np.float32
                np.testing.assert_array_equal(g[k], g0[k], err_msg=f"{rc} {k}")
    assert sizes["full"] == x.nbytes < sizes["selective"] < sizes["none"]


def test_fp16_close_to_fp32_and_threads_deterministic():
    P32 = make_params(M, np.float32, scale=0.1)
    P16 = [{k: v.astype(np.float16) for k, v in b.items()} for b in P32]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, M.seq_len, M.hidden)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    res = {}
    for precision, P in (("fp32", P32), ("fp16", P16)):
        for threads in (1, 2):
            with tiled(precision, threads=threads) as ctx:
                dt = ctx.dtype
                res[precision, threads] = run_layer(ctx, x.astype(dt), P[1], dy.astype(dt))
    with tiled("fp32", threads=2) as ctx:  # same threads: same bits
        again = run_layer(ctx, x, P32[1], dy)
    np.testing.assert_array_equal(again[1], res["fp32", 2][1])
    y32, dx32, g32, _ = res["fp32", 1]
    y, dx, g, _ = res["fp32", 2]
    np.testing.assert_allclose(y, y32, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx32, rtol=1e-4, atol=1e-4)
    for precision, threads in (("fp16", 1), ("fp16", 2)):
        y, dx, g, _ = res[precision, threads]
        assert y.dtype == np.float16
        rel = lambda a, b: np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b)  # noqa: E731
        assert rel(y, y32) < 5e-3
        assert rel(dx, dx32) < 1e-2
        for k in g:
            assert rel(g[k], g32[k]) < 2e-2, k


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("batch", [1, 3, 4, 6])
def test_threads_give_bitwise_the_same_layer_and_head(precision, batch):
    # the batch's chunks and every reduction order depend on the batch alone (run.threads 1, 2,
    # 3, 4 and 8 give the same bits), as a run's losses must
    dt = np.float16 if precision == "fp16" else np.float32
    P = [{k: v.astype(dt) for k, v in b.items()} for b in make_params(M, np.float32, scale=0.1)]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, M.seq_len, M.hidden)).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    t = rng.integers(0, M.vocab_size, (batch, M.seq_len))
    out = []
    for threads in (1, 2, 3, 4, 8):
        with tiled(precision, threads=threads) as ctx:
            y, dx, g, _ = run_layer(ctx, x, P[1], dy)
            loss, cache = head.head_forward(x, t, P[-1], ctx)
            gh = zeros_like(P[-1], np.float32)
            dxh = head.head_backward(0.5, cache, P[-1], gh, ctx)
            out.append([y, dx, *g.values(), loss, dxh, *gh.values()])
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert np.array_equal(a, b)


def test_head_matches_reference_fd_and_chunks():
    P = make_params(M)
    p = P[-1]
    rng = np.random.default_rng(5)
    B, T = 5, M.seq_len  # batch chunks of 1, 1, 1 and 2 sequences
    x = rng.standard_normal((B, T, M.hidden))
    t = rng.integers(0, M.vocab_size, (B, T))
    xn, _ = kernels.rmsnorm_forward(x, p["norm"], M.norm_eps, np)
    ref, _ = kernels.cross_entropy_forward((xn @ p["weight"].T).reshape(B * T, -1), t.reshape(-1), np)
    results = []
    # one logits chunk; in the backward (at most 18 rows a batch chunk) chunks of 13 columns
    # of 40 (the last one 1 wide), of 3 (the last 1 wide), one column at a time
    for chunk in (1 << 20, 3 * 8 * M.vocab_size, 4 * 9 * 7, 4 * 9):
        with ExecContext(M, "fp64", threads=2, head_chunk_bytes=chunk) as ctx:
            loss, cache = head.head_forward(x, t, p, ctx)
            g = zeros_like(p)
            dx = head.head_backward(0.5, cache, p, g, ctx)
            results.append((loss, dx, g))
            np.testing.assert_allclose(loss, ref, rtol=1e-12)
    for other in results[1:]:
        np.testing.assert_allclose(other[1], results[0][1], rtol=1e-12)
        for k in ("norm", "weight"):
            np.testing.assert_allclose(other[2][k], results[0][2][k], rtol=1e-12, atol=1e-15)
    loss, dx, g = results[0]
    with ExecContext(M, "fp64", threads=1) as ctx:
        f = lambda: 0.5 * float(head.head_forward(x, t, p, ctx)[0])  # noqa: E731
        for arr, grad in ((x, dx), (p["norm"], g["norm"]), (p["weight"], g["weight"])):
            flat, gflat = arr.reshape(-1), grad.reshape(-1)
            for i in rng.choice(flat.size, 5, replace=False):
                old = flat[i]
                flat[i] = old + 1e-6
                lp = f()
                flat[i] = old - 1e-6
                lm = f()
                flat[i] = old
                assert abs((lp - lm) / 2e-6 - gflat[i]) <= 1e-8 + 1e-6 * abs(gflat[i])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_head_and_embed_dtypes(precision):
    dt = np.float16 if precision == "fp16" else np.float32
    P = make_params(M, dt, scale=0.1)
    rng = np.random.default_rng(6)
    ids = rng.integers(0, M.vocab_size, (2, M.seq_len))
    with ExecContext(M, precision, threads=2) as ctx:
        x, ce = layers.embed_forward(ids, P[0], ctx)
        assert x.dtype == dt and np.array_equal(x, P[0]["weight"][ids])
        loss, ch = head.head_forward(x, ids, P[-1], ctx)
        assert loss.dtype == np.float32 and loss.shape == ()
        g = zeros_like(P[-1], np.float32)
        dx = head.head_backward(1.0, ch, P[-1], g, ctx)
        assert dx.dtype == dt and g["weight"].dtype == np.float32
        ge = {"weight": np.zeros(P[0]["weight"].shape, np.float32)}
        layers.embed_backward(dx, ce, P[0], ge, ctx)
        ref = np.zeros_like(ge["weight"])
        np.add.at(ref, ids.reshape(-1), dx.reshape(-1, M.hidden).astype(np.float32))
        np.testing.assert_allclose(ge["weight"], ref, rtol=1e-6)


def test_ledger_scratch_and_cache_tracking():
    P = make_params(M, np.float16, scale=0.1)
    led = Ledger()
    x = np.random.default_rng(7).standard_normal((2, M.seq_len, M.hidden)).astype(np.float16)
    with ExecContext(M, "fp16", ledger=led, threads=2) as ctx:
        y, cache = layers.layer_forward(x, P[1], ctx, "none")
        assert led.current == 0  # scratch released
        peaks = led.peak_by_tag()
        n_w = sum(v.size for k, v in P[1].items() if "norm" not in k)
        assert peaks["scratch.gemm"] == 4 * n_w  # the fp32 copies of the weight views
        assert peaks[layers.WORK_TAG] == layers.layer_workspace_nbytes(ctx, 2, M.seq_len)
        led.reset_peak()
        n = led.track("activations.mb0.layers.0", *layers.cache_arrays(cache))
        assert n == layers.cache_nbytes(cache) > x.nbytes
        g = zeros_like(P[1], np.float32)
        layers.layer_backward(y, cache, P[1], g, ctx)
        led.free(*layers.cache_arrays(cache))
        assert led.current == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("backward", [False, True])
def test_head_workspace_is_reserved_and_near_what_numpy_allocates(precision, backward):
    """The head reserves its workspace estimate under scratch.exec while it runs, and the
    estimate is within -10% / +30% of what numpy allocates (tracemalloc) beyond the weights'
    fp32 copy, which is scratch.gemm's."""
    import tracemalloc

    m = ModelConfig(vocab_size=512, hidden=64, layers=1, heads=4, kv_heads=4, ffn_hidden=128,
                    seq_len=32)
    rng = np.random.default_rng(3)
    dt = kernels.DTYPES[precision]
    B = 4
    x = rng.standard_normal((B, m.seq_len, m.hidden)).astype(dt)
    t = rng.integers(0, m.vocab_size, (B, m.seq_len))
    p = {"norm": np.ones(m.hidden, dt), "weight": (0.1 * rng.standard_normal(
        (m.vocab_size, m.hidden))).astype(dt)}
    g = {k: np.zeros(v.shape, np.float32) for k, v in p.items()}
    led = Ledger()
    for chunk in (1 << 16, 1 << 20):
        with ExecContext(m, precision, ledger=led, threads=1, head_chunk_bytes=chunk) as ctx:
            est = head.head_workspace_nbytes(ctx, B, m.seq_len, backward)
            head.head_backward(1.0, head.head_forward(x, t, p, ctx)[1], p, g, ctx)  # warm
            led.reset_peak()
            tracemalloc.start()
            try:
                loss, cache = head.head_forward(x, t, p, ctx)
                base = 0
                if backward:
                    base = tracemalloc.get_traced_memory()[0]
                    tracemalloc.reset_peak()
                    head.head_backward(1.0, cache, p, g, ctx)
                used = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
            used -= led.peak_by_tag().get("scratch.gemm", 0)
            assert led.peak_by_tag()[layers.WORK_TAG] == est
            assert 0.9 * used <= est <= 1.3 * used, (chunk, est, used)
            assert led.current == 0


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_against_transformers_llama(dtype):
    """Loss and every gradient of a 2-layer GQA LlamaForCausalLM against our blocks."""
    torch = need("torch")
    transformers = need("transformers")
    tdt = getattr(torch, dtype)
    cfg = transformers.LlamaConfig(
        vocab_size=M.vocab_size, hidden_size=M.hidden, intermediate_size=M.ffn_hidden,
        num_hidden_layers=M.layers, num_attention_heads=M.heads, num_key_value_heads=M.kv_heads,
        max_position_embeddings=M.seq_len, rope_theta=M.rope_theta, rms_norm_eps=M.norm_eps,
        tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(tdt)
    P = make_params(M, np.float64, scale=0.2)
    sd = {}
    for b, pb in zip(model_blocks(M), P):
        for q in b.params:
            sd[q.hf_name] = torch.tensor(pb[q.local], dtype=tdt)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    rng = np.random.default_rng(8)
    B, T = 2, M.seq_len
    ids = rng.integers(0, M.vocab_size, (B, T))
    tg = rng.integers(0, M.vocab_size, (B, T))
    logits = model(input_ids=torch.tensor(ids)).logits
    tloss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1).float() if dtype == "float32"
                                              else logits.reshape(B * T, -1),
                                              torch.tensor(tg).reshape(-1))
    tloss.backward()
    tgrad = {n: p.grad.double().numpy() for n, p in model.named_parameters()}

    npdt = np.float64 if dtype == "float64" else np.float32
    precision = "fp64" if dtype == "float64" else "fp32"
    Pn = [{k: v.astype(npdt) for k, v in b.items()} for b in P]
    G = [zeros_like(b, npdt) for b in Pn]
    with tiled(precision, threads=2) as ctx:
        x, ce = layers.embed_forward(ids, Pn[0], ctx)
        caches = []
        for i in range(M.layers):
            x, c = layers.layer_forward(x, Pn[1 + i], ctx)
            caches.append(c)
        loss, ch = head.head_forward(x, tg, Pn[-1], ctx)
        dx = head.head_backward(1.0, ch, Pn[-1], G[-1], ctx)
        for i in reversed(range(M.layers)):
            dx = layers.layer_backward(dx, caches[i], Pn[1 + i], G[1 + i], ctx)
        layers.embed_backward(dx, ce, Pn[0], G[0], ctx)
    # LlamaRMSNorm computes in float32 even in a float64 model: float64 agrees to ~1e-8 only
    tol = 1e-6 if dtype == "float64" else 2e-5
    np.testing.assert_allclose(float(loss), tloss.item(), rtol=tol)
    for b, gb in zip(model_blocks(M), G):
        for q in b.params:
            ref = tgrad[q.hf_name]
            err = np.abs(gb[q.local] - ref).max() / (np.abs(ref).max() + 1e-30)
            assert err < (1e-5 if dtype == "float64" else 1e-4), (q.name, err)
