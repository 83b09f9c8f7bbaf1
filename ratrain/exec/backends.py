"""Kernel backends, chosen once per rank: the table from each op to its implementation.

When a rank is built, `kernels_for(cfg, xp)` (or `kernel_table(...)` without a config: tests,
benchmarks, `api`) decides, for this rank's device, precision and installed packages, which
implementation runs each op; the layers, the optimizer and the executor look the op up in the
table (`ctx.kernels.rmsnorm_forward(...)`), and nothing decides again per call or reads the
environment. The choice follows the config's switches (`run.fused`, `run.devkernels`,
`run.attention`, which `load_config` has already merged with their RATRAIN_* variables, and
`run.reference_ops`, the ops put back on their reference whatever the others give):

    op             host (cpu)                     gpu                    reference
    gemm           openblas (16-bit by fp32       cupy (16-bit cuBLAS)   gemm.matmul
                   tiles), or mkl (bf16 native)
    rmsnorm        fused (fp32 runs)              devkernels             kernels.rmsnorm_*
    rope, swiglu   fused                          devkernels             kernels.rope_*, swiglu_*
    attention      tiled-64                       cudnn (fp16, bf16),    kernels.attention_*
                                                  else tiled-1024
    cross_entropy  numpy                          devkernels (devloss)   kernels.cross_entropy_*
    adamw          fused                          devkernels             optim._adam_core
    grad_norm      numpy                          devkernels             kernels.block_sq_norm
    cast           fused                          cupy                   kernels.as_dtype

The host's GEMMs run on a BLAS library chosen by `run.blas` (`choose_blas`): `openblas`, numpy's
own BLAS and the reference, or `mkl`, oneMKL from the `mkl` extra (`exec.blas`, entry
`gemm.mkl_entry`), whose GEMMs take bf16 operands natively, and fp16 ones where the CPU has
AMX-FP16. `auto` takes mkl where the CPU has AMX (`amx_bf16` in /proc/cpuinfo), the one kind of
host where it was measured faster, for 16-bit GEMMs (5-7x) and for sgemm (1.2x). Elsewhere it
keeps openblas: on an AMD EPYC with AVX512-BF16 whole steps on oneMKL took 1.10x OpenBLAS's time
in fp32 and 1.23x in bf16 (docs/BENCHMARKS.md). The rule reads the CPU's flags and whether the extra loads, never a
timing, so a rank's choice, and its bits, never depend on a race. The banner says what ran and
why (`auto` without the extra on an AMX host says so there, once).

`fused` (numba, the fast extra) needs `run.fused` auto or on and numba importable; `devkernels`
(numba-cuda) needs `run.devkernels` auto or on and numba-cuda importable outside its simulator,
or, on `run.device: standin`, `run.devkernels: sim` and the simulator. The stand-in's
`run.devkernels: count` takes `devcount` (`exec.devcount`): the same calls go to the device
kernels (`exec.deventries` decides which, for both), each computed on the host and counted as
the launches a card's kernel makes, what `benchmarks/launches.py` counts. Otherwise, and always at
fp64 (tests), the reference runs, named after its array module (numpy, cupy or standin). A fast
entry hands what it does not take (float64, float16 weights, odd layouts) to the reference.
`on` for a package that does not import, `run.blas: mkl` where oneMKL does not load or on a
device, and an attention name nobody registered, are a `BackendError` (one line naming the
key), which start-up turns into exit 2.

Attention backends are registered by name (`register_attention`): the tiled kernels at tile 64
(`tiled-64`, the host's `auto`) and 1024 (`tiled-1024`, the stand-in's), and cuDNN's fused SDPA
(`cudnn`: a GPU's `auto` in fp16 and bf16 where nvidia-cudnn-frontend and libcudnn load and the
model's graphs validate; else `auto` falls back to `tiled-1024`, and the banner's clause says
why). A backend from outside the package is one call:

    register_attention("toy", lambda device, precision: ToyAttention(), about="a test's")
    # then run.attention: toy
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ratrain.config import is_half
from ratrain.device import kind_of
from ratrain.exec import blas as blaslib
from ratrain.exec import cudnn_sdpa, devcount, deventries, devlaunch, fused, kernels
from ratrain.exec.attention import (
    DEVICE_GROUP_BYTES,
    TILE_BYTES,
    AttentionBackend,
    CudnnAttention,
    TiledAttention,
)
from ratrain.exec.gemm import matmul, mkl_entry
from ratrain.exec.kernels import BF16, block_sq_norm

# each op (but attention, an object of its own) and the table's fields that implement it
ENTRIES = {"gemm": ("gemm",),
           "rmsnorm": ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_recompute"),
           "rope": ("rope_forward", "rope_backward"), "swiglu": ("swiglu_forward", "swiglu_backward"),
           "cross_entropy": ("cross_entropy_rows", "cross_entropy_grad"), "adamw": ("adamw",),
           "grad_norm": ("grad_norm",), "cast": ("cast", "assign")}
OPS = (*ENTRIES, "attention")
# the compilers, for the banner
ENGINES = {"fused": "numba", "devkernels": "numba-cuda",
           "devcount": "the device kernels' launches counted, computed on the host"}


class BackendError(ValueError):
    """A backend the config asks for cannot run on this rank (one line: the key and the fix);
    `reason`: the same in a few words, for the banner when `auto` passes the backend over."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


# --------------------------------------------------------------------------------------------
# Attention backends by name
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionEntry:
    """A registered attention backend: `make(device, precision)` returns the rank's backend
    (device: cpu, gpu or standin), or raises BackendError saying why it cannot run there."""

    name: str
    make: Callable[[str, str], AttentionBackend]
    about: str = ""


ATTENTION: dict[str, AttentionEntry] = {}
AUTO = {"cpu": ["tiled-64"], "gpu": ["tiled-1024"], "standin": ["tiled-1024"]}  # in order


def register_attention(name: str, make, about: str = "", auto=()) -> None:
    """Add an attention backend under `name` (`run.attention: name`); `auto`: the devices
    whose `run.attention: auto` tries it first (before the backends listed there already)."""
    if not name or name == "auto" or name in ATTENTION:
        raise ValueError(f"attention backend {name!r}: the name is empty, auto or taken")
    ATTENTION[name] = AttentionEntry(name, make, about)
    for device in auto:
        AUTO[device].insert(0, name)


def unregister_attention(name: str) -> None:
    """Remove a backend `register_attention` added (tests)."""
    ATTENTION.pop(name)
    for names in AUTO.values():
        if name in names:
            names.remove(name)


def _tiled(block: int):
    """A tiled backend's maker: groups of sequences within a core's L2 on the host, within
    `DEVICE_GROUP_BYTES` on a device (fewer launches)."""
    return lambda device, precision: TiledAttention(
        block, TILE_BYTES if device == "cpu" else DEVICE_GROUP_BYTES)


register_attention("tiled-64", _tiled(64),
                   "the tiled online softmax at tile 64: a CPU core's cache")
register_attention("tiled-1024", _tiled(1024),
                   "the tiled online softmax at tile 1024: a device's SMs (measured on an H100, "
                   "124M model, seq 1024: tile 64 0.71 s, 256 0.067 s, 1024 0.022 s a layer)")


def _half_on(name: str, want: str, device: str, precision: str) -> None:
    """One line unless the rank computes on `want` in fp16 or bf16 (cuDNN's attention)."""
    if device != want:
        where = {"gpu": "a GPU rank", "standin": "the stand-in"}[want]
        raise BackendError(f"run.attention={name} runs on {where} (run.device={want}), not on "
                           f"run.device={device}: set run.attention=auto", f"not on {device}")
    if not is_half(precision):
        raise BackendError(f"run.attention={name} computes in fp16 or bf16, not precision="
                           f"{precision}: set precision=bf16 (or fp16), or run.attention=auto "
                           "(the tiled path)", f"fp16 and bf16 only, not {precision}")


def _cudnn(device: str, precision: str) -> CudnnAttention:
    _half_on("cudnn", "gpu", device, precision)
    try:
        cudnn_sdpa.load()
    except cudnn_sdpa.CudnnUnavailable as e:
        raise BackendError(f"run.attention=cudnn: {e}", str(e)) from None
    return CudnnAttention(on_card=True)


def _cudnn_count(device: str, precision: str) -> CudnnAttention:
    _half_on("cudnn-count", "standin", device, precision)
    return CudnnAttention(sdpa=devcount.CountedSdpa(cudnn_sdpa.DP_WORKSPACE_LIMIT),
                          name="cudnn-count")


register_attention("cudnn", _cudnn, "cuDNN's fused SDPA (nvidia-cudnn-frontend), fp16 and bf16 "
                   "on a GPU: the scores never reach memory", auto=("gpu",))
register_attention("cudnn-count", _cudnn_count, "cuDNN's fused SDPA as the stand-in counts it "
                   "(fp16, bf16): each call one operation, a graph's execute, computed by the "
                   "tiled path on the host (benchmarks/launches.py)")


def attention_backend(name: str, device: str, precision: str, model=None) -> AttentionBackend:
    """The attention backend `run.attention: name` gives a rank (`auto`: the device's first
    that can run `model`)."""
    return choose_attention(name, device, precision, model)[0]


def choose_attention(name: str, device: str, precision: str, model=None):
    """(the backend `attention_backend` gives, {backend `auto` passed over: why})."""
    dtype = kernels.DTYPES[precision]
    if name != "auto":
        if name not in ATTENTION:
            raise BackendError(f"run.attention={name!r} is not a registered attention backend: "
                               f"use auto or one of {', '.join(sorted(ATTENTION))}")
        backend = ATTENTION[name].make(device, precision)
        why = backend.refuses(model, dtype) if model is not None else ""
        if why:
            raise BackendError(f"run.attention={name}: {why}; set run.attention=auto")
        return backend, {}
    passed = {}
    for candidate in AUTO[device]:
        try:
            backend = ATTENTION[candidate].make(device, precision)
        except BackendError as e:
            passed[candidate] = e.reason
            continue
        why = backend.refuses(model, dtype) if model is not None else ""
        if not why:
            return backend, passed
        passed[candidate] = why
    raise BackendError(f"run.attention=auto: no attention backend runs on {device}: "
                       + "; ".join(f"{k}: {v}" for k, v in passed.items()))


# --------------------------------------------------------------------------------------------
# The host's BLAS
# --------------------------------------------------------------------------------------------

BLAS = ("auto", "openblas", "mkl")  # run.blas


@dataclass(frozen=True)
class BlasChoice:
    """The BLAS a host rank's GEMMs run on (`choose_blas`): `name` openblas or mkl, `native`
    the 16-bit dtypes its GEMMs take natively, `why` what the banner adds (auto's reason)."""

    name: str
    native: frozenset = frozenset()
    why: str = ""
    lib: object = None  # exec.blas.Mkl for mkl


def choose_blas(mode: str, device: str, flags=None) -> BlasChoice | None:
    """The BLAS `run.blas: mode` gives a rank on `device` (None on a device: its GEMMs are its
    array module's); `flags`: the CPU's (None: this one's, `exec.blas.cpu_flags`)."""
    if mode not in BLAS:
        raise BackendError(f"run.blas={mode!r} is not a BLAS: use one of {', '.join(BLAS)}")
    if device != "cpu":
        if mode == "mkl":
            raise BackendError(f"run.blas=mkl is a host's BLAS, but run.device={device} "
                               "computes its GEMMs on the device: set run.blas=auto")
        return None
    flags = blaslib.cpu_flags() if flags is None else frozenset(flags)
    native = frozenset({BF16} | ({np.dtype(np.float16)} if "amx_fp16" in flags else set()))
    if mode == "openblas":
        return BlasChoice("openblas")
    if mode == "auto" and "amx_bf16" not in flags:
        return BlasChoice("openblas", why="auto: no AMX (amx_bf16) on this CPU")
    try:
        lib = blaslib.load_mkl()
    except blaslib.BlasUnavailable as e:
        if mode == "auto":
            return BlasChoice("openblas", why=f"auto: {e}")
        raise BackendError(f"run.blas=mkl but {e}: install it, or set run.blas=auto") from None
    return BlasChoice("mkl", native, "auto: AMX" if mode == "auto" else "", lib)


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """One rank's kernel table (see the module). Each entry has its reference's signature."""

    device: str  # cpu | gpu | standin
    names: Mapping[str, str]  # op -> the implementation chosen (OPS; the attention's name)
    gemm: Callable
    rmsnorm_forward: Callable
    rmsnorm_backward: Callable
    rmsnorm_recompute: Callable  # the forward's output again from its kept statistics
    rope_forward: Callable
    rope_backward: Callable
    swiglu_forward: Callable
    swiglu_backward: Callable
    cross_entropy_rows: Callable  # the head's forward: the rows' logsumexp and losses
    cross_entropy_grad: Callable  # the head's backward: a vocabulary chunk's dlogits
    adamw: Callable | None  # a flat-range update (fused.adamw's signature); None: the reference
    grad_norm: Callable  # (flat gradient, xp) -> sum of squares in float64
    cast: Callable  # (a, dtype) -> a in dtype (itself when it has it)
    assign: Callable  # (dst, src): dst[...] = src, cast
    attention: AttentionBackend
    passed_over: Mapping[str, str] = field(default_factory=dict)  # auto's attention: name -> why
    blas: BlasChoice | None = None  # the host's BLAS (None on a device)

    def native(self, dtype) -> bool:
        """Whether the GEMMs take operands of the 16-bit `dtype` natively: a device's always,
        a host's where its BLAS does (`BlasChoice.native`)."""
        return not self.host or (self.blas is not None and np.dtype(dtype) in self.blas.native)

    @property
    def host(self) -> bool:
        """Whether the rank computes on the host (numpy)."""
        return self.device == "cpu"

    def describe(self) -> str:
        """One clause for the banner: the kernels most ops run, the exceptions, the attention."""
        ops = {op: impl for op, impl in self.names.items() if op not in ("gemm", "attention")}
        main = Counter(ops.values()).most_common(1)[0][0]
        rest = ", ".join(f"{op.replace('_', '-')} {impl}" for op, impl in ops.items()
                         if impl != main)
        inner = "; ".join(x for x in (ENGINES.get(main, ""), rest) if x)
        passed = "; ".join(f"{k}: {v}" for k, v in self.passed_over.items())
        blas = f"blas {self.blas_label()}, " if self.blas is not None else ""
        return (f"kernels: {main}{f' ({inner})' if inner else ''}, {blas}"
                f"attention {self.names['attention']}"
                f"{f' (passed over {passed})' if passed else ''}")

    def blas_label(self) -> str:
        """The host's BLAS for the banner and `ratrain bench`: "mkl 2026.2 (bf16 native;
        auto: AMX)", "openblas (auto: no AMX (amx_bf16) on this CPU)"; "" on a device."""
        b = self.blas
        if b is None:
            return ""
        names = {v: k for k, v in kernels.DTYPES.items()}
        what = [] if b.lib is None else ["/".join(sorted(names[d] for d in b.native)) + " native"]
        inner = "; ".join([*what, *([b.why] if b.why else [])])
        version = f" {b.lib.version}" if b.lib is not None else ""
        return f"{b.name}{version}{f' ({inner})' if inner else ''}"


def kernels_for(cfg, xp=np) -> Kernels:
    """The table of a rank of `cfg` computing with `xp` (its `run.*` switches)."""
    r = cfg.run
    return kernel_table(xp, cfg.precision, r.fused, r.devkernels, r.attention, cfg.model,
                        r.reference_ops, r.blas)


def kernel_table(xp=np, precision: str = "fp32", fused_mode: str = "auto",
                 devkernels_mode: str = "auto", attention="auto", model=None,
                 reference_ops=(), blas: str = "auto", cpu_flags=None) -> Kernels:
    """The table for a rank computing with `xp` at `precision` (see the module); `attention`:
    a registered name, auto, or a backend object (tests: a tile of their own); `model`: the
    model's section, whose shapes an attention backend may refuse (None: not asked);
    `reference_ops`: ops (ENTRIES' names) that keep their reference whatever else is chosen;
    `blas`: run.blas; `cpu_flags`: the CPU's flags `choose_blas` reads (None: this CPU's)."""
    compiled = [op for op in ENTRIES if op != "gemm"]  # gemm has its reference alone
    bad = [op for op in reference_ops if op not in compiled]
    if bad:
        raise BackendError(f"run.reference_ops: {bad[0]!r} is not an op with a compiled kernel: "
                           f"use any of {', '.join(compiled)}")
    device = kind_of(xp)
    fast = _fast_kernels(device, precision, str(fused_mode), str(devkernels_mode))
    attn, passed = (attention, {}) if isinstance(attention, AttentionBackend) else \
        choose_attention(attention, device, precision, model)
    reference = {"cpu": "numpy", "gpu": "cupy", "standin": "standin"}[device]
    names = dict.fromkeys(ENTRIES, reference)
    if fast is not None:  # every op the compiled kernels cover
        names.update((op, fast) for op, fields in ENTRIES.items()
                     if all(f in _COMPILED[fast] for f in fields))
        if fast == "fused" and precision != "fp32":
            names["rmsnorm"] = reference  # fp16 runs: the norms' weights are fp16 views
    names.update(dict.fromkeys(reference_ops, reference))
    table = {f: _COMPILED.get(impl, _REFERENCE)[f] for op, impl in names.items()
             for f in ENTRIES[op]}
    chosen = choose_blas(str(blas), device, cpu_flags)
    if chosen is not None:
        names["gemm"] = chosen.name
        if chosen.lib is not None:
            table["gemm"] = mkl_entry(chosen.lib, chosen.native, table["cast"], table["assign"])
    return Kernels(device, {**names, "attention": attn.name}, attention=attn, passed_over=passed,
                   blas=chosen, **table)


@functools.cache
def default_kernels(xp=np, precision: str = "fp32", model=None) -> Kernels:
    """The `auto` table of `xp` (code without a config; one per module, precision and model:
    `auto`'s attention passes over a backend that refuses the model's shapes)."""
    return kernel_table(xp, precision, model=model)


def _fast_kernels(device: str, precision: str, fused_mode: str, dev_mode: str) -> str | None:
    """Which compiled kernels the rank runs: "fused", "devkernels", "devcount" (the stand-in's
    count of the device kernels) or None (the reference)."""
    if fused_mode == "on" and not fused.available():
        raise BackendError(f"run.fused=on but {fused.why_off()}: install it (pip install "
                           "'ratrain[fast]') or set run.fused=auto")
    if dev_mode in ("on", "sim") and devlaunch.why_off():
        raise BackendError(f"run.devkernels={dev_mode} but {devlaunch.why_off()}; or set "
                           "run.devkernels=auto")
    if dev_mode == "sim" and device == "gpu":
        raise BackendError("run.devkernels=sim runs the device kernels on run.device=standin, "
                           "in numba-cuda's simulator: on a GPU set run.devkernels=auto")
    if dev_mode == "count" and device == "gpu":
        raise BackendError("run.devkernels=count counts the device kernels' launches on "
                           "run.device=standin: on a GPU set run.devkernels=auto")
    if dev_mode == "sim" and device == "standin" and not devlaunch.simulated():
        raise BackendError("run.devkernels=sim but numba-cuda is not its simulator here: set "
                           "NUMBA_ENABLE_CUDASIM=1 before numba loads, or run.devkernels=auto")
    if dev_mode == "on" and device == "gpu" and devlaunch.simulated():
        raise BackendError("run.devkernels=on on a GPU but numba-cuda runs its simulator "
                           "(NUMBA_ENABLE_CUDASIM=1): unset it, or set run.devkernels=auto")
    if precision not in ("fp32", "fp16", "bf16"):
        return None  # fp64: the references (finite-difference tests)
    if device == "cpu":
        return "fused" if fused_mode != "off" and fused.available() else None
    if device == "standin":
        return {"sim": "devkernels", "count": "devcount"}.get(dev_mode)
    if dev_mode in ("auto", "on") and not devlaunch.why_off() and not devlaunch.simulated():
        return "devkernels"
    return None


# --------------------------------------------------------------------------------------------
# The entries
# --------------------------------------------------------------------------------------------


_REFERENCE = dict(
    gemm=matmul, rmsnorm_forward=kernels.rmsnorm_forward,
    rmsnorm_backward=kernels.rmsnorm_backward, rmsnorm_recompute=kernels.rmsnorm_recompute,
    rope_forward=kernels.rope_forward,
    rope_backward=kernels.rope_backward, swiglu_forward=kernels.swiglu_forward,
    swiglu_backward=kernels.swiglu_backward, cross_entropy_rows=kernels.cross_entropy_rows,
    cross_entropy_grad=kernels.cross_entropy_grad, adamw=None, grad_norm=block_sq_norm,
    cast=kernels.as_dtype, assign=kernels.assign)

_FUSED = dict(
    rmsnorm_forward=fused.rmsnorm_forward, rmsnorm_backward=fused.rmsnorm_backward,
    # two numpy passes on the host (its backward's normed inputs for the weight gradients)
    rmsnorm_recompute=kernels.rmsnorm_recompute,
    rope_forward=fused.rope_forward, rope_backward=fused.rope_backward,
    swiglu_forward=fused.swiglu_forward, swiglu_backward=fused.swiglu_backward,
    adamw=fused.adamw, cast=fused.cast, assign=fused.assign)

# the entries each compiler provides (the stand-in's `devcount`: the device kernels counted)
_COMPILED = {"fused": _FUSED, "devkernels": deventries.entries(deventries.KERNELS),
             "devcount": deventries.entries(devcount)}


__all__ = ["ATTENTION", "AUTO", "BLAS", "ENTRIES", "OPS", "AttentionEntry", "BackendError",
           "BlasChoice", "Kernels", "attention_backend", "choose_attention", "choose_blas",
           "default_kernels", "kernel_table",
           "kernels_for", "register_attention", "unregister_attention"]
