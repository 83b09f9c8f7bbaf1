"""cuDNN's fused attention (`ratrain.exec.cudnn_sdpa`).

Everywhere (CI has no GPU): both graphs, forward and backward, built and validate()d by the
frontend for fp16 and bf16, causal, GQA, the 124M model's shapes (B 8, H 12, T 1024, D 64)
and a tiny one, the output as the layer's token-major view; bad shapes, dtypes and strides
refused in one line before any cuDNN call. nvidia-cudnn-frontend is a prerequisite (scripts/
test.sh installs it): missing, these fail under CI.

On a GPU (scripts/gpu-check.sh runs this file there) the graphs also run: forward and
backward against the tiled path in fp32 on the same rounded operands, relative L2 error within
1e-3 (fp16, the issue's target) / 4e-3 (bf16: see TOL); the tiled path's lse fed to the fused
backward; the backward run twice gives the same bytes; the workspace of both dP-workspace
settings within `workspace_bound`. Without a GPU those tests skip, saying so.
"""

import os
import types
from dataclasses import replace

import numpy as np
import pytest

from tests._attention_ref import rel_err, tiled_fp32
from tests._devices import GPU
from tests._prereq import need

SHAPES = {"tiny-gqa": (2, 4, 2, 80, 32), "124M": (8, 12, 12, 1024, 64)}  # B, H, KV, T, D
# Relative L2 error against the tiled path in fp32. bf16 cannot hold the 2e-3: rounding
# the exact outputs to bf16 alone (unit roundoff 2^-8) is 1.6e-3, and a flash kernel also rounds
# P and dS to bf16 for its tensor-core GEMMs; a numpy emulation of those roundings (T 512, D 64)
# gives 2.3e-3 (o) to 2.7e-3 (dq), fp16 2.8e-4 to 3.2e-4. benchmarks/gpu.py attention reports the
# measured figure beside that floor and PyTorch's own error.
TOL = {"float16": 1e-3, "bfloat16": 4e-3}
RNG = np.random.default_rng(29)


@pytest.fixture(scope="module")
def cs():
    need("cudnn", "cuDNN's fused attention graphs (pip install nvidia-cudnn-frontend)")
    from ratrain.exec import cudnn_sdpa

    return cudnn_sdpa


def token_major(B, H, T, D):
    """Element strides of a (B, T, H, D) buffer seen as (B, H, T, D): the layer's o and do."""
    return (T * H * D, D, H * D, 1)


def layouts(cs, kind, B, H, KV, T, D):
    row = cs.row_major
    s = {r: row((B, KV if r in cs.KV_ROLES else H, T, D)) for r in cs.ROLES[kind]}
    s["o"] = token_major(B, H, T, D)
    if kind == "backward":
        s["do"] = token_major(B, H, T, D)
    return tuple(s[r] for r in cs.ROLES[kind])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_graphs_validate(cs, kind, shape, dtype):
    B, H, KV, T, D = SHAPES[shape]
    spec = cs.SdpaSpec(kind, B, H, KV, T, D, dtype, strides=layouts(cs, kind, B, H, KV, T, D))
    g, t = cs.describe(spec)
    assert set(t) == {*cs.ROLES[kind], "stats"}
    assert list(t["stats"].get_dim()) == [B, H, T, 1]
    assert list(t["stats"].get_stride()) == [H * T, T, 1, 1]
    for role in cs.ROLES[kind]:
        assert tuple(t[role].get_dim()) == spec.shape(role)
        assert tuple(t[role].get_stride()) == spec.stride(role)
    assert list(t["o"].get_stride()) == list(token_major(B, H, T, D))
    node = g.nodes[0]
    assert node.params["use_causal_mask"] is True
    assert node.params["attn_scale"] == pytest.approx(1 / np.sqrt(D))
    if kind == "backward":
        assert node.params["use_deterministic_algorithm"] is True
    else:
        assert node.params["generate_stats"] is True


BAD = [  # (spec arguments, words the one-line error must name)
    (dict(dtype="float32"), "float32"),
    (dict(D=60), "head size 60"),
    (dict(D=512), "head size 512"),
    (dict(KV=3), "4 query heads is not a multiple of 3"),
    (dict(T=0), "T=0"),
    (dict(strides=((64, 64, 1, 64),) * 4), "innermost 1"),
    (dict(strides=((4 * 16 * 68, 16 * 68, 68, 1),) * 4, D=64), "multiples of 8"),
    (dict(kind="backward", dp_workspace_limit=-1), "dp_workspace_limit -1"),
]


@pytest.mark.parametrize("bad,words", BAD)
def test_bad_spec_refused_in_one_line(cs, bad, words):
    args = dict(kind="forward", B=2, H=4, KV=2, T=16, D=64, dtype="float16") | bad
    with pytest.raises(ValueError) as e:
        cs.SdpaSpec(**args)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_operands_refused_by_name(cs):
    q, k = np.zeros((2, 4, 16, 64), np.float16), np.zeros((2, 2, 16, 64), np.float16)
    with pytest.raises(ValueError, match=r"^cuDNN SDPA: v is \(2, 2, 16, 64\) float32"):
        cs.spec_of("forward", dict(q=q, k=k, v=k.astype(np.float32), o=q))
    with pytest.raises(ValueError, match=r"^cuDNN SDPA: o is \(2, 4, 16, 32\)"):
        cs.spec_of("forward", dict(q=q, k=k, v=k, o=q[..., :32]))
    o = np.zeros((2, 16, 4, 64), np.float16).transpose(0, 2, 1, 3)  # the layer's view
    spec = cs.spec_of("forward", dict(q=q, k=k, v=k, o=o))
    assert spec.stride("o") == token_major(2, 4, 16, 64) and spec.KV == 2


def test_dp_workspace_limit_is_set_only_while_building(cs, monkeypatch):
    monkeypatch.setenv(cs.DP_LIMIT_ENV, "7")
    with cs._dp_limit(0):
        assert os.environ[cs.DP_LIMIT_ENV] == "0"
    with cs._dp_limit(None):
        assert cs.DP_LIMIT_ENV not in os.environ
    assert os.environ[cs.DP_LIMIT_ENV] == "7"


def test_workspace_bound_follows_the_dp_limit(cs):
    """The dP workspace (B H ceil64(T) ceil128(T) 2 bytes) is counted only where the limit
    lets the frontend take the dP path: the 124M model's 192 MiB under the default 256 MiB,
    not at T 2048 (768 MiB), never at limit 0; at any limit where cuDNN predates the ordered
    engine or its version is not known."""
    def bound(T, limit, version=cs.ORDERED_MIN_VERSION):
        return cs.workspace_bound(cs.SdpaSpec("backward", 8, 12, 12, T, 64, "bfloat16",
                                              dp_workspace_limit=limit), version)
    for old in (cs.ORDERED_MIN_VERSION - 100, None):
        assert bound(2048, 0, old) == bound(2048, None)
        assert bound(1024, 0, old) == bound(1024, cs.DP_WORKSPACE_LIMIT)
    dp = 8 * 12 * 1024 * 1024 * 2
    assert bound(1024, cs.DP_WORKSPACE_LIMIT) - bound(1024, 0) == dp
    assert bound(1024, None) == bound(1024, cs.DP_WORKSPACE_LIMIT)
    assert bound(2048, cs.DP_WORKSPACE_LIMIT) == bound(2048, 0)
    assert bound(2048, None) - bound(2048, 0) == 4 * dp


def test_libcudnn_found_on_sys_path_where_the_frontend_misses_it(cs, tmp_path, monkeypatch):
    """A cuDNN wheel outside the interpreter's purelib (a --target install, the CUDA 13 wheels'
    nvidia/cu13/lib) is found on sys.path, for `load` to open before the frontend looks."""
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudnn.so.9").touch()
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(cs.sysconfig, "get_path", lambda name: str(tmp_path / "purelib"))
    monkeypatch.setattr(cs.sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path / "site")])
    assert cs._libcudnn_on_path() == str(lib / "libcudnn.so.9")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))  # the frontend's first place: left to it
    assert cs._libcudnn_on_path() is None


# --------------------------------------------------------------------------------------------
# On a GPU: the graphs run
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def card(cs):
    if GPU is None:
        pytest.skip("no GPU here: cuDNN's graphs are built and validated above, not run")
    half = {"float16": np.dtype(np.float16)}
    try:
        import ml_dtypes  # cupy's bfloat16 is ml_dtypes'

        half["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        pass
    sdpa = {limit: cs.CudnnSdpa(dp_workspace_limit=limit) for limit in (None, 0)}
    yield GPU.xp, half, sdpa
    for s in sdpa.values():
        s.close()


def operands(xp, half, dtype, B, H, KV, T, D):
    """q, k, v (B, H|KV, T, D) and do, o as the layer's token-major views, in `dtype`."""
    if dtype not in half:
        need("ml_dtypes", "bfloat16 arrays on cupy")

    def rand(*shape):
        return xp.asarray(RNG.standard_normal(shape, dtype=np.float32)).astype(half[dtype])

    q, k, v = rand(B, H, T, D), rand(B, KV, T, D), rand(B, KV, T, D)
    do = rand(B, T, H, D).transpose(0, 2, 1, 3)
    o = xp.empty((B, T, H, D), half[dtype]).transpose(0, 2, 1, 3)
    return q, k, v, do, o


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_the_tiled_path(cs, card, shape, dtype):
    xp, half, sdpa = card
    q, k, v, do, o = operands(xp, half, dtype, *SHAPES[shape])
    ref = tiled_fp32(q, k, v, do, xp)
    fused = sdpa[None]
    o, lse = fused.forward(q, k, v, out=o)
    got = (o, lse, *fused.backward(q, k, v, o, do, lse))
    errs = {n: rel_err(a, r, xp) for n, a, r in zip(("o", "lse", "dq", "dk", "dv"), got, ref)}
    assert max(errs.values()) < TOL[dtype], errs
    again = fused.backward(q, k, v, o, do, ref[1])  # the tiled path's lse: the same statistics
    errs = {n: rel_err(a, r, xp) for n, a, r in zip(("dq", "dk", "dv"), again, ref[2:])}
    assert max(errs.values()) < TOL[dtype], errs


@pytest.mark.parametrize("limit", [None, 0])
def test_backward_is_deterministic_and_within_its_workspace_bound(cs, card, limit):
    xp, half, sdpa = card
    B, H, KV, T, D = SHAPES["124M"]
    q, k, v, do, o = operands(xp, half, "float16", B, H, 4, T, D)  # GQA: kv heads summed too
    s = sdpa[limit]
    o, lse = s.forward(q, k, v, out=o)
    first = [a.copy() for a in s.backward(q, k, v, o, do, lse)]
    second = s.backward(q, k, v, o, do, lse)
    for a, b in zip(first, second):
        assert bool(xp.array_equal(a.view(xp.uint16), b.view(xp.uint16)))
    for spec, g in s.graphs.items():
        assert g.workspace_nbytes <= cs.workspace_bound(spec, s.version), (spec.describe(),
                                                                             g.engine, s.version)


# --------------------------------------------------------------------------------------------
# The `cudnn` attention backend (exec.attention.CudnnAttention), everywhere up to execution
# --------------------------------------------------------------------------------------------


@pytest.fixture()
def backends(cs, monkeypatch):
    """exec.backends with cuDNN's libraries reported loaded (CI has none): what a GPU rank with
    the frontend and libcudnn sees, up to the card."""
    from ratrain.exec import backends

    class Uncarded:  # a CudnnSdpa whose graphs are validated where a card would build them
        def __init__(self, dp_workspace_limit):
            self.graph = cs.describe

    monkeypatch.setattr(cs, "load", lambda: (cs.frontend(), 92700))
    monkeypatch.setattr(cs, "CudnnSdpa", Uncarded)
    return backends


def test_the_backend_validates_a_models_graphs_and_refuses_in_one_line(cs):
    from ratrain.exec.attention import CudnnAttention
    from ratrain.exec.kernels import BF16
    from tests._executor_util import MODEL

    attn = CudnnAttention()
    assert attn.refuses(MODEL, BF16) == "" and attn.refuses(MODEL, np.float16) == ""
    fwd, bwd = attn.specs(MODEL, BF16, 2, MODEL.seq_len)  # the layer's layout
    assert fwd.stride("o") == token_major(2, 4, 16, 8) and bwd.stride("do") == fwd.stride("o")
    assert bwd.dp_workspace_limit == cs.DP_WORKSPACE_LIMIT and bwd.dtype == "bfloat16"
    for model, words in ((replace(MODEL, hidden=16), "head size 4"),
                         (replace(MODEL, hidden=2048, heads=4, kv_heads=2), "head size 512")):
        why = attn.refuses(model, BF16)
        assert words in why and "\n" not in why
    assert "float32" in attn.refuses(MODEL, np.float32)


def test_auto_takes_cudnn_on_a_gpu_at_16_bits_else_the_tiled_path_saying_why(backends):
    from tests._executor_util import MODEL

    attn, passed = backends.choose_attention("auto", "gpu", "bf16", MODEL)
    assert attn.name == "cudnn" and attn.on_card and passed == {}
    assert backends.AUTO["gpu"] == ["cudnn", "tiled-1024"] and "cudnn" not in backends.AUTO["cpu"]
    attn, passed = backends.choose_attention("auto", "gpu", "fp32", MODEL)
    assert attn.name == "tiled-1024" and passed == {"cudnn": "fp16 and bf16 only, not fp32"}
    attn, passed = backends.choose_attention("auto", "gpu", "fp16", replace(MODEL, hidden=16))
    assert attn.name == "tiled-1024" and "head size 4" in passed["cudnn"]
    for device in ("cpu", "standin"):
        assert backends.choose_attention("auto", device, "bf16", MODEL)[1] == {}


def test_auto_falls_back_when_libcudnn_does_not_load_and_the_banner_says_so(cs, monkeypatch):
    from ratrain.exec import backends
    from tests._executor_util import MODEL

    def missing():
        raise cs.CudnnUnavailable("cuDNN attention needs libcudnn 9, which was not found")

    monkeypatch.setattr(cs, "load", missing)
    gpu = types.ModuleType("cupy")  # any array module but numpy and the stand-in: a GPU's
    table = backends.kernel_table(gpu, "bf16", devkernels_mode="off", model=MODEL)
    assert table.names["attention"] == "tiled-1024"
    assert table.describe().endswith("attention tiled-1024 (passed over cudnn: cuDNN attention "
                                      "needs libcudnn 9, which was not found)")
    with pytest.raises(backends.BackendError, match=r"^run.attention=cudnn: cuDNN attention "
                       r"needs libcudnn 9, which was not found$"):
        backends.kernel_table(gpu, "bf16", devkernels_mode="off", attention="cudnn")


@pytest.mark.parametrize("device,precision,words", [
    ("standin", "bf16", "run.attention=cudnn runs on a GPU rank (run.device=gpu), not on "
                        "run.device=standin: set run.attention=auto"),
    ("cpu", "fp16", "run.attention=cudnn runs on a GPU rank"),
    ("gpu", "fp32", "run.attention=cudnn computes in fp16 or bf16, not precision=fp32: set "
                    "precision=bf16 (or fp16), or run.attention=auto (the tiled path)"),
])
def test_cudnn_asked_for_where_it_cannot_run_is_one_line_naming_the_key(backends, device,
                                                                        precision, words):
    with pytest.raises(backends.BackendError) as e:
        backends.attention_backend("cudnn", device, precision)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)
    from tests._executor_util import MODEL

    with pytest.raises(backends.BackendError, match=r"^run.attention=cudnn: cuDNN SDPA: head "
                       r"size 4 must be a multiple of 8 .*; set run.attention=auto$"):
        backends.attention_backend("cudnn", "gpu", "bf16", replace(MODEL, hidden=16))


class RecordingSdpa:
    """CudnnSdpa's calls without a card: each spec checked against the backend's canonical
    one (whose graph the backend asked for) and validated by the frontend, the workspace held
    to the graph's bound and taken from the ledger, the arithmetic done by the tiled path in
    fp32 and rounded to the operands' dtype as cuDNN returns it."""

    def __init__(self, cs, attn, ctx):
        self.cs, self.attn, self.ctx = cs, attn, ctx
        self.specs, self.calls = set(), []

    def workspace_nbytes(self, spec):
        self.cs.describe(spec)
        self.specs.add(spec)
        return self.cs.workspace_bound(spec)

    def _check(self, kind, arrays, workspace):
        limit = self.attn.dp_workspace_limit if kind == "backward" else None
        spec = self.cs.spec_of(kind, arrays, True, limit)
        B, _, T, _ = arrays["q"].shape
        assert spec == self.attn.specs(self.ctx.model, arrays["q"].dtype, B, T)[kind == "backward"]
        assert spec in self.specs  # the backend asked for its workspace first
        assert workspace.nbytes >= self.cs.workspace_bound(spec)
        assert self.ctx.ledger.in_use("scratch.attention") == workspace.nbytes
        self.calls.append(kind)

    def forward(self, q, k, v, out=None, lse=None, workspace=None):
        from ratrain.exec.attention import flash_attention_forward

        self._check("forward", dict(q=q, k=k, v=v, o=out), workspace)
        f32 = np.float32
        o, cache = flash_attention_forward(q.astype(f32), k.astype(f32), v.astype(f32),
                                           self.ctx.xp, 64)
        out[...] = o.astype(q.dtype)
        return out, cache.lse

    def backward(self, q, k, v, o, do, lse, out=None, workspace=None):
        from ratrain.exec.attention import AttentionCache, flash_attention_backward

        self._check("backward", dict(q=q, k=k, v=v, o=o, do=do, dq=out[0], dk=out[1],
                                     dv=out[2]), workspace)
        f32 = np.float32
        cache = AttentionCache(q.astype(f32), k.astype(f32), v.astype(f32), o.astype(f32), lse)
        for dst, g in zip(out, flash_attention_backward(do.astype(f32), cache, self.ctx.xp, 64)):
            dst[...] = g.astype(q.dtype)
        return out


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_the_layers_hand_cudnn_its_graphs_operands_and_ledger_workspace(cs, recompute):
    """Training steps in bf16 on the stand-in through the cudnn backend with its card calls
    recorded (RecordingSdpa): the layers hand it q, k, v and o, do, dq, dk, dv in exactly the
    layout of the graphs it validated, its workspace comes from the ledger, and the steps
    track the tiled path's (the outputs are rounded to bf16, as cuDNN's are)."""
    from ratrain.exec.attention import CudnnAttention
    from ratrain.exec.backends import register_attention, unregister_attention
    from tests._executor_util import tiny_config, train

    class Recorded(CudnnAttention):
        def _on(self, ctx):
            if self._sdpa is None:
                self._sdpa = RecordingSdpa(cs, self, ctx)

        def forward(self, q, k, v, ctx, out=None):
            self._on(ctx)
            return super().forward(q, k, v, ctx, out)

        def backward(self, do, cache, ctx):
            self._on(ctx)
            return super().backward(do, cache, ctx)

        def workspace_nbytes(self, ctx, batch, seq_len, backward=False):
            self._on(ctx)
            return super().workspace_nbytes(ctx, batch, seq_len, backward)

    made = []
    register_attention("cudnn-recorded", lambda device, precision: made.append(Recorded())
                       or made[-1], "cudnn with its card calls recorded (a test)")
    try:
        base = tiny_config(m=2, precision="bf16", steps=2, recompute=recompute)
        # eager: the recording computes with cupy's matmul, which a graph's capture refuses
        base = replace(base, run=replace(base.run, device="standin", graphs="off"))
        ref, _, _ = train(base)
        got, _, ex = train(replace(base, run=replace(base.run, attention="cudnn-recorded")))
    finally:
        unregister_attention("cudnn-recorded")
    rec = made[-1]._sdpa
    n = base.model.layers * base.parallel.num_micro_batches * 2  # layers x micro-batches x steps
    assert rec.calls.count("backward") == n
    assert rec.calls.count("forward") >= n * (2 if recompute == "selective" else 1)
    assert ex.ctx.kernels.names["attention"] == "cudnn"
    assert ex.ledger.peak_by_tag().get("scratch.attention", 0) > 0
    assert "scratch.attention" not in ex.ledger.by_tag()  # freed after each call
    np.testing.assert_allclose([r.loss for r in got], [r.loss for r in ref], rtol=5e-3)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_training_steps_through_cudnn_track_the_tiled_path_on_a_card(cs, card, precision):
    """On a GPU: `run.attention: auto` takes cudnn at 16 bits; three steps track the tiled
    path's; the layers' calls hit the graphs built for the layer's layout (one forward and one
    backward graph per shape: the start-up check's one sequence, the micro-batch), and the
    workspace the ledger held is the built graph's."""
    from tests._executor_util import MODEL, tiny_config, train

    model = replace(MODEL, hidden=64)  # head size 16
    out = {}
    for attention in ("auto", "tiled-1024"):
        cfg = tiny_config(m=2, precision=precision, steps=3, model=model)
        cfg = replace(cfg, run=replace(cfg.run, device="gpu", attention=attention))
        res, _, ex = train(cfg)
        out[attention] = [r.loss for r in res]
        if attention == "auto":
            attn = ex.ctx.kernels.attention
            assert attn.name == "cudnn", ex.ctx.kernels.describe()
            assert sorted(s.B for s in attn.sdpa.graphs) == [1, 1, 2, 2], list(attn.sdpa.graphs)
            ws = max(g.workspace_nbytes for g in attn.sdpa.graphs.values() if g.spec.B == 2)
            assert ex.ledger.peak_by_tag().get("scratch.attention", 0) == ws
    np.testing.assert_allclose(out["auto"], out["tiled-1024"], rtol=1e-2)
