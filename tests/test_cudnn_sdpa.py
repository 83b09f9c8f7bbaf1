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
    not at T 2048 (768 MiB), never at limit 0."""
    def bound(T, limit):
        return cs.workspace_bound(cs.SdpaSpec("backward", 8, 12, 12, T, 64, "bfloat16",
                                              dp_workspace_limit=limit))
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
        assert g.workspace_nbytes <= cs.workspace_bound(spec), (spec.describe(), g.engine)
