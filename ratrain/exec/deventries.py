"""A device rank's kernel-table entries: for each call, whether it goes to a compiled kernel
(one or two launches) or to the array module's composition (the reference, `exec.kernels`).

    entries(k) -> {field: entry}   the table's fields for rmsnorm, rope, swiglu, the head's
                                   cross-entropy, AdamW and the gradient norm

`k` holds the kernels' public functions: `KERNELS`, numba-cuda's (`exec.devkernels`,
`exec.devloss`; on a GPU, or on the stand-in in numba-cuda's simulator, `run.devkernels: sim`),
or `exec.devcount`'s twins (the stand-in's `run.devkernels: count`: each call computed on the
host and counted as the launches a card's kernel makes). Both see the same decisions, made here
once: the kernels take float32, float16 and bfloat16 arrays (a bfloat16 one through its bits,
`devlaunch.ld`, `st`), the norms and the head's loss contiguous rows, SwiGLU 2-D views;
anything else goes to the reference. A 16-bit input is read as it is and a 16-bit `out` is
written by the kernel itself: no fp32 copy in, no cast out.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ratrain.exec import devkernels, devloss, kernels
from ratrain.exec.devlaunch import TAKES
from ratrain.exec.kernels import block_sq_norm
from ratrain.exec.profile import timed

# numba-cuda's kernels (compiled on first call)
KERNELS = SimpleNamespace(
    **{name: getattr(devkernels, name) for name in devkernels.LAUNCHES},
    cross_entropy_rows=devloss.cross_entropy_rows, cross_entropy_grad=devloss.cross_entropy_grad)


def _dk(*arrays) -> bool:
    return all(a is None or a.dtype in TAKES for a in arrays)


def _rows(*arrays) -> bool:
    """Whether every array given is C-contiguous (the norms' kernels take rows)."""
    return all(a is None or a.flags.c_contiguous for a in arrays)


def _ids(a) -> bool:
    return a.dtype.kind in "iu"


def entries(k) -> dict:
    """The table's device entries over the kernel functions `k` (see the module)."""

    @timed("rmsnorm")
    def rmsnorm_forward(x, w, eps, xp, out=None, x_copy=None):
        if _dk(x, w, out, x_copy) and _rows(x, out, x_copy):
            return k.rmsnorm_forward(x, w, eps, xp, out=out, x_copy=x_copy)
        return kernels.rmsnorm_forward(x, w, eps, xp, out, x_copy)

    @timed("rmsnorm")
    def rmsnorm_backward(dy, cache, xp, residual=None, out=None, copy_out=None):
        x, rstd, w = cache
        if _dk(x, dy, w, residual, out, copy_out) and _rows(x, dy, residual, out, copy_out):
            return k.rmsnorm_backward(dy, cache, xp, residual, out, copy_out)
        return kernels.rmsnorm_backward(dy, cache, xp, residual, out, copy_out)

    @timed("rmsnorm")
    def rmsnorm_recompute(x, rstd, w, xp, out=None):
        if _dk(x, rstd, w, out) and x.flags.c_contiguous:
            return k.rmsnorm_recompute(x, rstd, w, xp, out=out)
        return kernels.rmsnorm_recompute(x, rstd, w, xp, out)

    @timed("rope")
    def rope_forward(x, cos, sin, xp, out=None):
        if _dk(x, cos, sin, out):
            return k.rope_forward(x, cos, sin, xp, out=out)
        return kernels.rope_forward(x, cos, sin, xp, out)

    @timed("rope")
    def rope_backward(dy, cache, xp, out=None):
        if _dk(dy, *cache, out):
            return k.rope_backward(dy, cache, xp, out=out)
        return kernels.rope_backward(dy, cache, xp, out)

    @timed("swiglu")
    def swiglu_forward(gate, up, xp, out=None):
        if gate.ndim == 2 and _dk(gate, up, out):
            return k.swiglu_forward(gate, up, xp, out=out)
        return kernels.swiglu_forward(gate, up, xp, out)

    @timed("swiglu")
    def swiglu_backward(dact, cache, xp, out=None, with_act=False):
        if cache[0].ndim == 2 and _dk(dact, *cache, *(out or ())):
            return k.swiglu_backward(dact, cache, xp, out=out, with_act=with_act)
        return kernels.swiglu_backward(dact, cache, xp, out, with_act)

    @timed("head")
    def cross_entropy_rows(z, targets, xp, out=None, grad=None):
        if _dk(z) and z.flags.c_contiguous and _ids(targets) and \
                all(o.dtype == np.float32 and o.flags.c_contiguous for o in out or ()):
            return k.cross_entropy_rows(z, targets, xp, out=out, grad=grad)  # one launch
        return kernels.cross_entropy_rows(z, targets, xp, out, grad)

    @timed("head")
    def cross_entropy_grad(z, targets, lse, scale, xp, v0=0, out=None):
        if not (_dk(z, lse) and z.flags.c_contiguous and _ids(targets)):
            return kernels.cross_entropy_grad(z, targets, lse, scale, xp, v0, out)
        if out is None or (_dk(out) and out.flags.c_contiguous):  # a 16-bit out: cast fused
            return k.cross_entropy_grad(z, targets, lse, scale, xp, v0=v0, out=out)
        return kernels.cross_entropy_grad(z, targets, lse, scale, xp, v0, out)

    @timed("grad norm")
    def grad_norm(grad_flat, xp):
        if _dk(grad_flat):
            return k.sum_squares(grad_flat, xp)  # one fused reduction, fp64
        return block_sq_norm(grad_flat, xp)

    return dict(
        rmsnorm_forward=rmsnorm_forward, rmsnorm_backward=rmsnorm_backward,
        rmsnorm_recompute=rmsnorm_recompute,
        rope_forward=rope_forward, rope_backward=rope_backward, swiglu_forward=swiglu_forward,
        swiglu_backward=swiglu_backward, cross_entropy_rows=cross_entropy_rows,
        cross_entropy_grad=cross_entropy_grad, adamw=k.adamw, grad_norm=grad_norm)


__all__ = ["KERNELS", "entries"]
