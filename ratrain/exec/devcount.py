"""The device kernels as the stand-in counts them (`run.devkernels: count`): each call computed
on the host and counted as the device operations the kernel queues on a card.

Each public function has the signature of its kernel in `exec.devkernels` or `exec.devloss`
(the kernel table's device entries, `exec.deventries`, call these in their place). It takes the
stand-in's arrays, computes on their storage with the kernel's host twin (the reference in
`exec.kernels`; AdamW's is `fused.adamw`, which numba compiles where it is installed), writes
outputs where the kernel writes them (its `out`, z for the head's gradient) and adds the
kernel's `LAUNCHES` to `device.standin.COUNTS["ops"]`. The twin's own numpy work is not
counted: it stands for one launch. So a whole step of the 124M model runs in about a minute
on the stand-in, counted as a card with the kernels would queue it
(`benchmarks/launches.py`), where numba-cuda's simulator (`run.devkernels: sim`, one Python
thread per CUDA thread) runs only gpu.py's tiny model in that time. That the counts are the
kernels' is tested in the simulator; the values are the references', so a run is checked
against the kernels only by the tests of `exec.devkernels`, not here.
"""

from __future__ import annotations

import functools
import types

import numpy as np

from ratrain.device import storage_of
from ratrain.device.standin import StandinArray, did
from ratrain.exec import cudnn_sdpa, devkernels, devloss, fused, kernels
from ratrain.exec.devlaunch import TAKES
from ratrain.exec.attention import (AttentionCache, flash_attention_backward,
                                    flash_attention_forward)

LAUNCHES = {**devkernels.LAUNCHES, **devloss.LAUNCHES}
# the references untimed (the table's entry, `exec.deventries`, times the call once)
_REF = types.SimpleNamespace(**{name: getattr(getattr(kernels, name), "__wrapped__",
                                               getattr(kernels, name))
                                for name in ("rmsnorm_forward", "rmsnorm_backward",
                                             "rmsnorm_recompute",
                                             "swiglu_forward", "swiglu_backward", "rope_forward",
                                             "rope_backward", "block_sq_norm",
                                             "cross_entropy_rows", "cross_entropy_grad")})


def _host(*arrays):
    """The numpy storage of stand-in arrays (refused: anything else, and a dtype the kernels do
    not take, as `devlaunch.check` refuses them)."""
    out = []
    for a in arrays:
        if type(a) is not StandinArray:
            raise TypeError(f"devcount computes the stand-in's arrays, not {type(a).__name__}: "
                            "run it on run.device=standin")
        out.append(storage_of(a))
    return out


def _checked(*arrays):
    host = _host(*arrays)
    for a in host:
        if a.dtype not in TAKES:
            raise TypeError(f"devkernels compute float32, float16 and bfloat16 arrays, not "
                            f"{a.dtype}")
    return host


def _f32(a):
    """A host array as float32 (itself when it is)."""
    return np.asarray(a, np.float32)


_PENDING = [0]  # the launches of the call in progress (`_kernel` hands them to `did`)


def _count(name: str, *arrays) -> None:
    if all(a.size for a in arrays):
        _PENDING[0] += LAUNCHES[name]


def _kernel(fn):
    """A twin as its kernel's call: its launches counted, and recorded while a graph is
    captured (`device.standin.did`: a replay calls it again on the same arrays)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _PENDING[0] = 0
        r = fn(*args, **kwargs)
        did(fn.__qualname__, (args, kwargs), r, _PENDING[0])
        return r
    return call


def _put(out, value, shape):
    """`value` (a host array) as the kernel's output: written into the stand-in array `out`
    (cast to its dtype) or a new one."""
    if out is None:
        return StandinArray(np.ascontiguousarray(value, np.float32))
    dst = _host(out)[0]
    if tuple(dst.shape) != tuple(shape):
        raise ValueError(f"out: shape {tuple(dst.shape)}, expected {tuple(shape)}")
    dst[...] = value
    return out


@_kernel
def rmsnorm_forward(x, w, eps, xp, out=None, x_copy=None, threads=None):
    hx, hw = _checked(x, w)
    y, (_, rstd, _) = _REF.rmsnorm_forward(_f32(hx), hw, eps, np)
    _count("rmsnorm_forward", hx)
    if x_copy is not None:
        _put(x_copy, hx, hx.shape)
    return _put(out, y, hx.shape), (x, StandinArray(rstd), w)


@_kernel
def rmsnorm_backward(dy, cache, xp, residual=None, out=None, copy_out=None, threads=None):
    x, rstd, w = cache
    hdy, hx, hr, hw = _checked(dy, x, rstd, w)
    res = None if residual is None else _f32(_checked(residual)[0])
    dx, dw = _REF.rmsnorm_backward(_f32(hdy), (_f32(hx), hr, hw), np, res)
    _count("rmsnorm_backward", hx)
    if copy_out is not None:
        _put(copy_out, dx, hx.shape)
    return _put(out, dx, hx.shape), StandinArray(np.asarray(dw, np.float32))


@_kernel
def rmsnorm_recompute(x, rstd, w, xp, out=None, threads=None):
    hx, hr, hw = _checked(x, rstd, w)
    y = _REF.rmsnorm_recompute(_f32(hx), hr, hw, np)
    _count("rmsnorm_recompute", hx)
    return _put(out, y, hx.shape)


@_kernel
def swiglu_forward(gate, up, xp, out=None, threads=None):
    hg, hu = _checked(gate, up)
    act, _ = _REF.swiglu_forward(_f32(hg), _f32(hu), np)
    _count("swiglu_forward", hg)
    return _put(out, act, hg.shape), (gate, up)


@_kernel
def swiglu_backward(dact, cache, xp, out=None, with_act=False, threads=None):
    gate, up = cache
    hda, hg, hu = _checked(dact, gate, up)
    r = _REF.swiglu_backward(_f32(hda), (_f32(hg), _f32(hu)), np, None, with_act)
    _count("swiglu_backward", hg)
    outs = tuple(out or ()) + (None,) * (3 - len(out or ()))
    grads = tuple(_put(o, v, hg.shape) for o, v in zip(outs, r[:2]))
    return (*grads, _put(outs[2], r[2], hg.shape)) if with_act else grads


@_kernel
def rope_forward(x, cos, sin, xp, out=None, threads=None):
    hx, hc, hs = _checked(x, cos, sin)
    y, _ = _REF.rope_forward(_f32(hx), hc, hs, np)
    _count("rope_forward", hx)
    return _put(out, y, hx.shape), (cos, sin)


@_kernel
def rope_backward(dy, cache, xp, out=None, threads=None):
    hdy, hc, hs = _checked(dy, *cache)
    dx = _REF.rope_backward(_f32(hdy), (hc, hs), np)
    _count("rope_backward", hdy)
    return _put(out, dx, hdy.shape)


@_kernel
def adamw(p, m, v, g, grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps, xp, threads=None):
    hp, hm, hv, hg = _checked(p, m, v, g)
    fused.adamw(hp, hm, hv, hg, grad_scale, keep, b1, b2, step_size, bc2_sqrt, eps, np)
    _count("adamw", hp)


@_kernel
def sum_squares(a, xp, threads=None):
    (ha,) = _checked(a)
    total = _REF.block_sq_norm(ha, np) if ha.size else 0.0
    _PENDING[0] += LAUNCHES["sum_squares"] if ha.size else 1  # the zeroed result
    return StandinArray(np.asarray(total, np.float64))


@_kernel
def cross_entropy_rows(z, targets, xp, out=None, grad=None, threads=None):
    hz, = _checked(z)
    if grad is not None and not hz.flags.c_contiguous:
        raise ValueError("cross_entropy_rows: grad writes over z, which must be C-contiguous")
    lse, losses = _REF.cross_entropy_rows(hz, _host(targets)[0], np, grad=grad)  # fp32 inside
    _count("cross_entropy_rows", hz)
    outs = out or (None, None)
    return tuple(_put(o, val, (hz.shape[0],)) for o, val in zip(outs, (lse, losses)))


@_kernel
def cross_entropy_grad(z, targets, lse, scale, xp, v0=0, out=None, threads=None):
    hz, hl = _checked(z, lse)
    if out is None and hz.dtype != np.float32:
        raise TypeError("cross_entropy_grad: z is written over, so float32 (or give out)")
    work = hz if out is None else np.array(hz, np.float32)  # z left as it was
    _REF.cross_entropy_grad(work, _host(targets)[0], hl, scale, np, v0)
    _count("cross_entropy_grad", hz)
    return z if out is None else _put(out, work, hz.shape)



class CountedSdpa:
    """cuDNN's fused attention (`exec.cudnn_sdpa.CudnnSdpa`'s interface) as the stand-in counts
    it: each call one operation (a graph's execute, which queues its kernels from one host
    call), computed on the host by the tiled path in fp32 (`attention.flash_attention_*`,
    one tile the sequence) and rounded into the 16-bit outputs. Each spec is validated by
    nvidia-cudnn-frontend as a card would build it (`cudnn_sdpa.describe`, no card needed), and
    its workspace is the bound cuDNN is known to ask for (`cudnn_sdpa.workspace_bound`)."""

    def __init__(self, dp_workspace_limit=None):
        self.cs, self.dp_workspace_limit = cudnn_sdpa, dp_workspace_limit
        self.valid: set = set()

    def graph(self, spec):
        if spec not in self.valid:
            self.cs.describe(spec)
            self.valid.add(spec)
        return spec

    def workspace_nbytes(self, spec) -> int:
        self.graph(spec)
        return self.cs.workspace_bound(spec)

    @_kernel
    def forward(self, q, k, v, out=None, lse=None, workspace=None):
        o = out if out is not None else StandinArray(np.empty(_host(q)[0].shape,
                                                               _host(q)[0].dtype))
        spec = self.cs.spec_of("forward", dict(q=q, k=k, v=v, o=o), True)
        self.graph(spec)
        hq, hk, hv = (_f32(a) for a in _host(q, k, v))
        o32, cache = flash_attention_forward(hq, hk, hv, np, block=hq.shape[2])
        _host(o)[0][...] = o32
        lse = _put(lse, cache.lse, cache.lse.shape)
        _PENDING[0] += 1
        return o, lse

    @_kernel
    def backward(self, q, k, v, o, do, lse, out=None, workspace=None):
        if out is None:
            out = tuple(StandinArray(np.empty(_host(a)[0].shape, _host(q)[0].dtype))
                        for a in (q, k, v))
        arrays = dict(q=q, k=k, v=v, o=o, do=do, dq=out[0], dk=out[1], dv=out[2])
        self.graph(self.cs.spec_of("backward", arrays, True, self.dp_workspace_limit))
        hq, hk, hv, ho, hdo, hl = (_f32(a) for a in _host(q, k, v, o, do, lse))
        grads = flash_attention_backward(hdo, AttentionCache(hq, hk, hv, ho, hl), np,
                                         block=hq.shape[2])
        for dst, g in zip(out, grads):
            _host(dst)[0][...] = g
        _PENDING[0] += 1
        return out

    def close(self):
        self.valid.clear()


__all__ = ["LAUNCHES", "CountedSdpa", "adamw", "cross_entropy_grad", "cross_entropy_rows",
           "rmsnorm_backward", "rmsnorm_forward", "rmsnorm_recompute", "rope_backward",
           "rope_forward", "sum_squares", "swiglu_backward", "swiglu_forward"]
