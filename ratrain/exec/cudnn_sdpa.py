"""Causal grouped-query attention fused by cuDNN: its SDPA graphs through the
`nvidia-cudnn-frontend` Python API, for a GPU rank (the scores never reach memory).

    sdpa = CudnnSdpa()                          # one per rank: a cuDNN handle on the current card
    o, lse = sdpa.forward(q, k, v, out=o)       # q (B, H, T, D), k, v (B, KV, T, D), fp16 or bf16
    dq, dk, dv = sdpa.backward(q, k, v, o, do, lse)
    sdpa.workspace_nbytes(spec)                 # exact, from the built graph (the ledger's share)
    workspace_bound(spec)                       # before any card: what a graph may ask, at most

The arithmetic is `kernels.flash_attention_*`'s: scores q k^T scaled by 1/sqrt(D), a causal
mask (query i sees keys 0..i), query head h reading kv head h // (H / KV), fp16 or bf16
operands with fp32 intermediates and compute. `lse` (B, H, T) fp32 is the tiled path's lse: the
natural-log log-sum-exp of each query row's scaled, masked scores. cuDNN's Stats (B, H, T, 1)
fp32 are the same numbers (max + log(sum exp(s - max)), natural log: `stats_use_log2` is left
off), so lse is Stats without its last axis (a view, no copy) and a forward of one path feeds
a backward of the other. `o` (and `out`, `do`) may be strided views, e.g. the layer's
token-major (B, T, H, D) buffer seen as (B, H, T, D): the innermost stride must be 1. Outputs
come back in the operands' dtype; dq (B, H, T, D), dk, dv (B, KV, T, D) are new contiguous
arrays unless `out` is given.

Graphs are built once per `SdpaSpec` (kind, shape, dtype, every operand's strides, causal, the
backward's dP-workspace limit) and kept in the object's cache (`graphs`): validate, lower,
plan (heuristics A then FALLBACK), check support, build, workspace size. A call executes the
cached graph with plain integer device pointers (`int(a.data.ptr)`: no DLPack, so cupy's bf16
needs only its dtype) on cupy's current stream (`cudnn.set_stream`, once per stream change).
The workspace is the caller's (`workspace=`: a device byte buffer of `workspace_nbytes`, from
the DDR ledger), else a cupy array from the pool.

The backward is deterministic (`use_deterministic_algorithm=True`: the same bytes on every run
with the same shapes, card and software). On Hopper with cuDNN >= 9.25 (ORDERED_MIN_VERSION;
older ones take the dP path whatever the limit) the frontend serves it two ways, chosen when
the graph is built by `CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT`, which `dp_workspace_limit`
sets around the build (and restores): a dP workspace of B * H * ceil64(T) * ceil128(T) * 2
bytes while that fits the limit (None: no limit), else an ordered dQ accumulation with
workspace linear in T (0: always). The default, DP_WORKSPACE_LIMIT (256 MiB, the frontend's
old cap: the dP path at the 124M model's 192 MiB, the ordered one from T 2048 at that width)
stands: the one card measured (an H200 with cuDNN 9.19) has no ordered engine, so the two
settings could not be timed against each other. Which engine serves a graph is recorded
(`SdpaGraph.engine`): cuDNN's own, unless the frontend's Python (CuTe DSL) engines are
installed and claim it.

Without a card (CI): `describe(spec)` builds and validate()s a graph: frontend 1.32's
Python-native rules (shapes, head counts, head size, attributes); the C++ checks (stride
alignment, support on the card) run at lowering, which needs a GPU and libcudnn. libcudnn
is the `nvidia-cudnn-cu12` / `-cu13` wheel's (PyTorch installs one), found by the frontend or
on sys.path (`load`). Bad shapes or dtypes are a ValueError of one line before any cuDNN call;
a graph cuDNN cannot serve on this card is a `CudnnUnavailable` of one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import math
import os
import sys
import sysconfig
from dataclasses import dataclass

import numpy as np

DTYPES = ("float16", "bfloat16")
ROLES = {"forward": ("q", "k", "v", "o"), "backward": ("q", "k", "v", "o", "do", "dq", "dk", "dv")}
KV_ROLES = ("k", "v", "dk", "dv")  # operands with KV heads
MAX_HEAD_DIM = 256  # cuDNN 9's fp16/bf16 SDPA, forward and backward
DP_LIMIT_ENV = "CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT"
DP_WORKSPACE_LIMIT = 256 << 20  # the frontend's historical cap: dP path up to 256 MiB of it
# the first cuDNN whose Hopper backward has the ordered (linear-workspace) engine that the limit
# selects; 9.19 took the dP path at every limit (gpu-check on an H200, 2026-11-28: 201,720,064
# bytes of workspace for the 124M model's backward under the default limit and under 0)
ORDERED_MIN_VERSION = 92500
ALIGN = 16  # bytes: every operand's address and outer strides (2-byte elements)


class CudnnUnavailable(RuntimeError):
    """cuDNN's fused attention cannot run here (one line: what is missing and the fix)."""


def row_major(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


@dataclass(frozen=True)
class SdpaSpec:
    """What one graph is built for, and its cache key. `strides`: each operand's element
    strides in ROLES[kind] order (empty: all contiguous); `dp_workspace_limit` only matters to
    a backward (see the module)."""

    kind: str  # "forward" | "backward"
    B: int
    H: int
    KV: int
    T: int
    D: int
    dtype: str  # one of DTYPES
    causal: bool = True
    strides: tuple = ()
    dp_workspace_limit: int | None = None

    def __post_init__(self):
        if self.kind not in ROLES:
            raise ValueError(f"cuDNN SDPA: kind {self.kind!r} is not one of {', '.join(ROLES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"cuDNN SDPA: dtype {self.dtype} is not supported; give float16 or "
                             "bfloat16 operands (fp32 attention runs the tiled path)")
        dims = dict(B=self.B, H=self.H, KV=self.KV, T=self.T, D=self.D)
        bad = [f"{k}={v}" for k, v in dims.items() if not (isinstance(v, int) and v >= 1)]
        if bad:
            raise ValueError(f"cuDNN SDPA: {', '.join(bad)}: every dimension must be a positive "
                             "integer")
        if self.H % self.KV:
            raise ValueError(f"cuDNN SDPA: {self.H} query heads is not a multiple of {self.KV} "
                             "kv heads")
        if self.D % 8 or self.D > MAX_HEAD_DIM:
            raise ValueError(f"cuDNN SDPA: head size {self.D} must be a multiple of 8 and at "
                             f"most {MAX_HEAD_DIM}; use the tiled attention")
        if not self.strides:
            object.__setattr__(self, "strides", tuple(row_major(self.shape(r))
                                                      for r in ROLES[self.kind]))
        if len(self.strides) != len(ROLES[self.kind]):
            raise ValueError(f"cuDNN SDPA: {len(self.strides)} stride tuples for the "
                             f"{len(ROLES[self.kind])} operands of a {self.kind}")
        for role, st in zip(ROLES[self.kind], self.strides):
            if len(st) != 4 or st[-1] != 1 or min(st) < 1:
                raise ValueError(f"cuDNN SDPA: {role} strides {tuple(st)}: four positive "
                                 "element strides with the innermost 1 (head dim contiguous)")
            if any(s % (ALIGN // 2) for s, n in zip(st[:3], self.shape(role)[:3]) if n > 1):
                raise ValueError(f"cuDNN SDPA: {role} strides {tuple(st)}: the outer strides "
                                 f"must be multiples of {ALIGN // 2} elements ({ALIGN} bytes)")
        if self.dp_workspace_limit is not None and self.dp_workspace_limit < 0:
            raise ValueError(f"cuDNN SDPA: dp_workspace_limit {self.dp_workspace_limit} must be "
                             "a byte count >= 0, or None for no limit")

    def shape(self, role: str) -> tuple[int, int, int, int]:
        return (self.B, self.KV if role in KV_ROLES else self.H, self.T, self.D)

    def stride(self, role: str) -> tuple[int, ...]:
        return tuple(self.strides[ROLES[self.kind].index(role)])

    def describe(self) -> str:
        return (f"{self.kind} B={self.B} H={self.H} KV={self.KV} T={self.T} D={self.D} "
                f"{self.dtype}{' causal' if self.causal else ''}")


def dtype_name(a) -> str:
    return np.dtype(a.dtype).name


def spec_of(kind: str, arrays: dict, causal: bool = True,
            dp_workspace_limit: int | None = None) -> SdpaSpec:
    """The spec of `arrays` ({role: array} for every role of ROLES[kind]; host or device arrays,
    only their shapes, dtypes and strides are read); a ValueError of one
    line naming the operand whose shape or dtype does not fit q's."""
    q = arrays["q"]
    if q.ndim != 4 or arrays["k"].ndim != 4:
        raise ValueError(f"cuDNN SDPA: q {tuple(q.shape)} and k {tuple(arrays['k'].shape)} must "
                         "be 4-D: (B, H, T, D) and (B, KV, T, D)")
    B, H, T, D = q.shape
    KV = arrays["k"].shape[1]
    dt = dtype_name(q)
    strides = []
    for role in ROLES[kind]:
        a = arrays[role]
        want = (B, KV if role in KV_ROLES else H, T, D)
        if tuple(a.shape) != want or dtype_name(a) != dt:
            raise ValueError(f"cuDNN SDPA: {role} is {tuple(a.shape)} {dtype_name(a)}; q "
                             f"{tuple(q.shape)} {dt} needs {want} {dt}")
        strides.append(tuple(s // a.itemsize for s in a.strides))
    return SdpaSpec(kind, B, H, KV, T, D, dt, causal, tuple(strides),
                    dp_workspace_limit if kind == "backward" else None)


def workspace_bound(spec: SdpaSpec, cudnn_version: int | None = None) -> int:
    """The most workspace a graph of `spec` asks for (bytes), before any card: for the
    backward the frontend's own tensors (fp32 dQ accumulator and softmax sums, fp32 full-head
    dK/dV under GQA) plus the dP workspace where the dP path can run (the limit lets it, or
    `cudnn_version` predates the ordered engine, or is unknown: None), and 1 MiB for the
    engine's own. Checked against `workspace_nbytes` on a GPU (tests/test_cudnn_sdpa.py)."""
    slack = 1 << 20
    if spec.kind == "forward":
        return slack
    B, H, T, D = spec.B, spec.H, spec.T, spec.D
    own = B * H * T * D * 4 + B * H * T * 4 + (2 * B * H * T * D * 4 if spec.KV != spec.H else 0)
    dp = B * H * (-(-T // 64) * 64) * (-(-T // 128) * 128) * 2
    limit = spec.dp_workspace_limit
    ordered = cudnn_version is not None and cudnn_version >= ORDERED_MIN_VERSION
    return own + (dp if not ordered or limit is None or dp <= limit else 0) + slack


# --------------------------------------------------------------------------------------------
# The frontend and libcudnn
# --------------------------------------------------------------------------------------------


def frontend():
    """The `cudnn` module (nvidia-cudnn-frontend); CudnnUnavailable naming it when missing."""
    try:
        # optional: only GPU hosts (the gpu extras) and the tests need nvidia-cudnn-frontend
        import cudnn
    except ImportError as e:
        raise CudnnUnavailable(f"cuDNN attention needs nvidia-cudnn-frontend (pip install "
                               f"'ratrain[gpu]'), which does not import here ({e})") from None
    return cudnn


WHEEL_LIB_DIRS = ("nvidia/cudnn/lib", "nvidia/cu13/lib", "nvidia/cu12/lib")  # libcudnn wheels


def _libcudnn_on_path() -> str | None:
    """A wheel's libcudnn.so.9 on sys.path where the frontend's own search misses it (it looks
    in LD_LIBRARY_PATH and purelib's nvidia/cudnn/lib, then loads "libcudnn.so.9" by name,
    which finds a library loaded before): a venv over system packages, --target installs, the
    CUDA 13 wheels' nvidia/cu13/lib. None when the frontend finds one itself."""
    if sys.platform != "linux":
        return None
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and glob.glob(os.path.join(d, "libcudnn.so*")):
            return None
    purelib = sysconfig.get_path("purelib")
    if glob.glob(os.path.join(purelib, WHEEL_LIB_DIRS[0], "libcudnn.so.*[0-9]")):
        return None
    for d in sys.path:
        for lib in WHEEL_LIB_DIRS:
            path = os.path.join(d or ".", lib, "libcudnn.so.9")
            if os.path.exists(path):
                return path
    return None


@functools.cache
def load():
    """(the cudnn module, cuDNN's version) with libcudnn loaded, once; CudnnUnavailable of
    one line when the frontend or libcudnn is missing."""
    path = _libcudnn_on_path()
    if path is not None:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    cudnn = frontend()
    try:
        version = int(cudnn.backend_version())
    except Exception as e:  # noqa: BLE001 - the binding raises RuntimeError without libcudnn
        raise CudnnUnavailable(f"cuDNN attention needs libcudnn 9 (pip install nvidia-cudnn-cu13 "
                               f"or -cu12, as PyTorch does), which was not found ({e})") from None
    return cudnn, version


@contextlib.contextmanager
def _dp_limit(limit: int | None):
    """CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT as `limit` (None: unset) for the block, then as
    it was: the frontend reads it while it builds a backward graph."""
    before = os.environ.get(DP_LIMIT_ENV)
    if limit is None:
        os.environ.pop(DP_LIMIT_ENV, None)
    else:
        os.environ[DP_LIMIT_ENV] = str(int(limit))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DP_LIMIT_ENV, None)
        else:
            os.environ[DP_LIMIT_ENV] = before


# --------------------------------------------------------------------------------------------
# Graphs
# --------------------------------------------------------------------------------------------


def describe(spec: SdpaSpec, handle=None):
    """(graph, {role: tensor}) of `spec`, validated: the frontend's checks, no card needed.
    Roles: ROLES[spec.kind] and "stats" ((B, H, T, 1) fp32, contiguous)."""
    cudnn = frontend()
    dt = cudnn.data_type.HALF if spec.dtype == "float16" else cudnn.data_type.BFLOAT16
    f32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    B, H, T = spec.B, spec.H, spec.T
    stats_dim, stats_stride = [B, H, T, 1], [H * T, T, 1, 1]
    scale = 1.0 / math.sqrt(spec.D)
    t = {}

    def operand(role):
        t[role] = g.tensor(name=role, dim=list(spec.shape(role)), stride=list(spec.stride(role)),
                           data_type=dt)
        return t[role]

    def output(role, tensor, dim, stride, data_type):
        tensor.set_output(True).set_dim(list(dim)).set_stride(list(stride))
        tensor.set_data_type(data_type)
        t[role] = tensor

    try:
        if spec.kind == "forward":
            o, stats = g.sdpa(name="sdpa", q=operand("q"), k=operand("k"), v=operand("v"),
                              generate_stats=True, attn_scale=scale, use_causal_mask=spec.causal)
            output("o", o, spec.shape("o"), spec.stride("o"), dt)
            output("stats", stats, stats_dim, stats_stride, f32)
        else:
            args = {r: operand(r) for r in ("q", "k", "v", "o", "do")}
            t["stats"] = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=f32)
            grads = g.sdpa_backward(name="sdpa_backward", q=args["q"], k=args["k"], v=args["v"],
                                    o=args["o"], dO=args["do"], stats=t["stats"],
                                    attn_scale=scale, use_causal_mask=spec.causal,
                                    use_deterministic_algorithm=True)
            for role, tensor in zip(("dq", "dk", "dv"), grads):
                output(role, tensor, spec.shape(role), spec.stride(role), dt)
        g.validate()
    except (ValueError, cudnn.cudnnGraphNotSupportedError) as e:
        raise CudnnUnavailable(f"cuDNN SDPA refuses the {spec.describe()} graph: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return g, t


@dataclass
class SdpaGraph:
    """A built graph of `spec`: its tensors by role, workspace bytes, and who serves it."""

    spec: SdpaSpec
    graph: object
    tensors: dict
    workspace_nbytes: int
    engine: str  # "cuDNN backend", or the frontend's own (python) engine's name


def build(spec: SdpaSpec, handle) -> SdpaGraph:
    """`describe(spec)` lowered, planned and built on the handle's card (a GPU)."""
    cudnn, _ = load()
    limit = spec.dp_workspace_limit if spec.kind == "backward" else None
    with _dp_limit(limit) if spec.kind == "backward" else contextlib.nullcontext():
        g, tensors = describe(spec, handle)
        try:
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except cudnn.cudnnGraphNotSupportedError as e:
            raise CudnnUnavailable(f"cuDNN SDPA cannot run the {spec.describe()} graph on this "
                                   f"card ({str(e).splitlines()[0]}); use the tiled attention"
                                   ) from None
    eng = g.selected_engine
    return SdpaGraph(spec, g, tensors, int(g.get_workspace_size()),
                     "cuDNN backend" if eng is None else eng.name)


# --------------------------------------------------------------------------------------------
# Execution on a card
# --------------------------------------------------------------------------------------------


def _ptr(a, role) -> int:
    p = int(a.data.ptr)
    if p % ALIGN:
        raise ValueError(f"cuDNN SDPA: {role} starts at {p:#x}, not {ALIGN}-byte aligned; pass "
                         "a view that starts on an aligned element")
    return p


class CudnnSdpa:
    """cuDNN's fused causal GQA attention for one rank's card (see the module): a handle made
    on the current cupy device, and the graphs built so far, by spec (`graphs`)."""

    def __init__(self, dp_workspace_limit: int | None = DP_WORKSPACE_LIMIT, causal: bool = True):
        import cupy  # a GPU rank's array module: this class runs only there

        self.dp_workspace_limit, self.causal = dp_workspace_limit, causal
        self.cudnn, self.version = load()
        self.xp = cupy
        self.handle = self.cudnn.create_handle()
        self.graphs: dict[SdpaSpec, SdpaGraph] = {}

    def graph(self, spec: SdpaSpec) -> SdpaGraph:
        """The built graph of `spec`, from the cache or built now."""
        g = self.graphs.get(spec)
        if g is None:
            g = self.graphs[spec] = build(spec, self.handle)
        return g

    def workspace_nbytes(self, spec: SdpaSpec) -> int:
        return self.graph(spec).workspace_nbytes

    def _run(self, spec, arrays, workspace):
        g = self.graph(spec)
        need = g.workspace_nbytes
        if workspace is None:
            workspace = self.xp.empty(max(need, 1), self.xp.uint8)
        elif workspace.nbytes < need:
            raise ValueError(f"cuDNN SDPA: workspace of {workspace.nbytes} bytes; the "
                             f"{spec.describe()} graph needs {need}")
        pack = {g.tensors[role]: _ptr(a, role) for role, a in arrays.items()}
        self.cudnn.set_stream(self.handle, self.xp.cuda.get_current_stream().ptr)
        g.graph.execute(pack, _ptr(workspace, "workspace"), handle=self.handle)

    def _lse(self, spec, lse):
        want = (spec.B, spec.H, spec.T)
        if lse is None:
            return self.xp.empty(want, self.xp.float32)
        if (tuple(lse.shape) != want or lse.dtype != np.float32
                or not lse.flags.c_contiguous):
            raise ValueError(f"cuDNN SDPA: lse is {tuple(lse.shape)} {lse.dtype}; it must be a "
                             f"contiguous {want} float32 array")
        return lse

    def forward(self, q, k, v, out=None, lse=None, workspace=None):
        """-> (o (B, H, T, D) in q's dtype, written into `out` when given; lse (B, H, T) fp32,
        into `lse` when given)."""
        o = self.xp.empty(q.shape, q.dtype) if out is None else out
        spec = spec_of("forward", dict(q=q, k=k, v=v, o=o), self.causal)
        lse = self._lse(spec, lse)
        self._run(spec, dict(q=q, k=k, v=v, o=o, stats=lse), workspace)
        return o, lse

    def backward(self, q, k, v, o, do, lse, out=None, workspace=None):
        """-> (dq (B, H, T, D), dk, dv (B, KV, T, D)) in q's dtype, written into `out` (three
        arrays) when given. Deterministic (see the module)."""
        if out is None:
            out = (self.xp.empty(q.shape, q.dtype), self.xp.empty(k.shape, q.dtype),
                   self.xp.empty(v.shape, q.dtype))
        arrays = dict(q=q, k=k, v=v, o=o, do=do, dq=out[0], dk=out[1], dv=out[2])
        spec = spec_of("backward", arrays, self.causal, self.dp_workspace_limit)
        arrays["stats"] = self._lse(spec, lse)
        self._run(spec, arrays, workspace)
        return out

    def close(self):
        """Free the handle (the graphs with it)."""
        self.graphs.clear()
        if self.handle is not None:
            self.cudnn.destroy_handle(self.handle)
            self.handle = None


__all__ = ["DP_WORKSPACE_LIMIT", "DTYPES", "ORDERED_MIN_VERSION", "ROLES", "CudnnSdpa",
           "CudnnUnavailable", "SdpaGraph", "SdpaSpec", "build", "describe", "frontend", "load",
           "row_major", "spec_of", "workspace_bound"]
