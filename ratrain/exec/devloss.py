"""The head's cross-entropy on a device (numba-cuda): one launch where cupy's composition of the
references makes several.

    kernel              matches                     launch           replaces (cupy's)
    cross_entropy_rows  kernels.cross_entropy_rows  a block per row  the rows' logsumexp, a
                        (forward: lse, losses; with                  gather, a subtraction
                        `grad`, the rows' dlogits                    (with `grad`: the
                        written over the logits)                     gradient's as below)
    cross_entropy_grad  kernels.cross_entropy_grad  grid-stride      a subtraction, an exp,
                        (backward: the dlogits of                    the one-hot's indices and
                        a vocabulary chunk)                          scatter, a scale, a cast

The head (`exec.head`) calls them through the kernel table's `cross_entropy` op, on a GPU rank
and on the stand-in under the simulator (`run.devkernels: sim`). Computed once (`run.head`),
its forward writes each row's gradient over its 16-bit logits in the same launch as the loss.
In chunks, its forward keeps each row's log-sum-exp and no logits, and its backward recomputes
the logits a vocabulary chunk at a time, so the gradient kernel takes the kept statistics and
the chunk's first column `v0`, never a whole row.

Numerics are `exec.devkernels`' (inputs float32, float16 or bfloat16, computed in fp32, rounded
once on store; the row reductions are shared-memory trees, a few ulps from numpy's sums). The
gradient is rounded once into `out` when it is 16-bit, fusing the cast the head's 16-bit GEMMs
need.
A target outside the vocabulary makes its row's loss NaN and adds no one-hot: a kernel cannot
raise the reference's IndexError, and must not read out of bounds.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from ratrain.exec import devlaunch as dl
from ratrain.exec.devlaunch import F32, ld, st

# numba.cuda and its scalar type, set by `_kernels` from `load()`: module globals, as the
# simulator swaps the `cuda` global of a kernel's module for its per-thread stand-in
cuda = float32 = None

# device operations one call on non-empty arrays queues (`exec.devcount`'s count on the stand-in)
LAUNCHES = {"cross_entropy_rows": 1, "cross_entropy_grad": 1}
LONG_ROW_THREADS = 1024  # rows of V logits on a GPU: fewer rows in flight, so a row's second
# read hits L2 (8192 x 32000 fp32 logits: ~260 rows of 128 KiB in flight)


@functools.cache
def _kernels(TPB: int) -> SimpleNamespace:
    global cuda, float32
    cuda = dl.load()
    float32 = cuda.float32
    f = dl.device_functions(TPB)
    fexp, flog, fmax, block_reduce = f.fexp, f.flog, f.fmax, f.block_reduce
    inf = math.inf

    @cuda.jit
    def ce_rows(z, targets, lse, losses, grad, scale):
        """A block per row of z (N, V): lse = log(sum(exp(z - max))) + max, by two tree
        reductions; the row's loss lse - z[t] (NaN for a target outside [0, V)). `grad`
        (nonzero): then z = (exp(z - lse) - onehot) * scale, a third pass over the row."""
        sh = cuda.shared.array(TPB, float32)
        r, t = cuda.blockIdx.x, cuda.threadIdx.x
        V = z.shape[1]
        m = float32(-inf)
        for c in range(t, V, TPB):
            m = fmax(m, ld(z[r, c]))
        m = block_reduce(sh, t, m, True)
        acc = float32(0.0)
        for c in range(t, V, TPB):
            acc += fexp(ld(z[r, c]) - m)
        ls = flog(block_reduce(sh, t, acc, False)) + m
        tr = targets[r]
        if t == 0:
            zt = float32(math.nan)
            if 0 <= tr < V:
                zt = ld(z[r, tr])
            lse[r] = ls
            losses[r] = ls - zt
        if grad:
            cuda.syncthreads()  # z[r, tr] read before any thread writes over it
            for c in range(t, V, TPB):
                p = fexp(ld(z[r, c]) - ls)
                if c == tr:
                    p -= float32(1.0)
                st(z, (r, c), p * scale)

    @cuda.jit
    def ce_grad(z, targets, lse, scale, v0, d):
        """d = (exp(z - lse) - onehot) * scale over z (N, W), the vocabulary's columns v0...
        (grid-stride; d may be z: each element is read before it is written)."""
        W = z.shape[1]
        i, step = cuda.grid(1), cuda.gridsize(1)
        while i < z.shape[0] * W:
            r = i // W
            c = i - r * W
            p = fexp(ld(z[r, c]) - ld(lse[r]))
            if c + v0 == targets[r]:
                p -= float32(1.0)
            st(d, (r, c), p * scale)
            i += step

    return SimpleNamespace(ce_rows=ce_rows, ce_grad=ce_grad)


def _targets(z, targets):
    """One line on logits that are not (N, W) or targets that are not N token ids."""
    if z.ndim != 2 or tuple(targets.shape) != (z.shape[0],):
        raise ValueError(f"cross-entropy: logits (N, V) and targets (N,), got "
                         f"{tuple(z.shape)} and {tuple(targets.shape)}")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"cross-entropy: targets are token ids (integers), not {targets.dtype}")


def cross_entropy_rows(z, targets, xp, out=None, grad=None, threads=None):
    """Rows of logits z (N, V) and their targets (N,) -> (lse, losses), float32 (N,) each, or
    written into `out` = (lse, losses) (float32, contiguous; slices welcome):
    `kernels.cross_entropy_rows`. lse is each row's log-sum-exp, the max subtracted first, and
    losses = lse - z[n, t_n]. `grad` (a float): z (C-contiguous) is then written over by
    (softmax(z) - onehot(targets)) * grad in the same launch, rounded once into its dtype."""
    dl.check(xp, z)
    _targets(z, targets)
    tpb = dl.block_threads(threads, LONG_ROW_THREADS)
    N = z.shape[0]
    lse, losses = (dl.out_array(o, (N,), F32, xp) for o in (out or (None, None)))
    if lse.dtype != F32 or losses.dtype != F32:
        raise ValueError(f"out: float32 lse and losses, got {lse.dtype} and {losses.dtype}")
    if grad is not None and not z.flags.c_contiguous:
        raise ValueError("cross_entropy_rows: grad writes over z, which must be C-contiguous")
    if N:
        dl.launch(_kernels(tpb).ce_rows, N, tpb, xp, z, targets, lse, losses,
                  int(grad is not None), np.float32(0.0 if grad is None else grad))
    return lse, losses


def cross_entropy_grad(z, targets, lse, scale, xp, v0=0, out=None, threads=None):
    """dlogits of the vocabulary's columns [v0, v0 + W) from their logits z (N, W), the targets
    (N,) and the rows' lse (N,): (exp(z - lse) - onehot(targets - v0)) * scale, written over z
    and returned, or into `out` (float32, float16 or bfloat16, C-contiguous; z is then left as it
was):
    `kernels.cross_entropy_grad`."""
    dl.check(xp, z, lse)
    _targets(z, targets)
    tpb = dl.block_threads(threads)
    d = z if out is None else dl.out_array(out, z.shape, F32, xp)
    if not (z.flags.c_contiguous and d.flags.c_contiguous):
        raise ValueError("cross_entropy_grad: z and out must be C-contiguous")
    if z.size:
        dl.launch(_kernels(tpb).ce_grad, dl.grid(z.size, tpb), tpb, xp, z, targets, lse,
                  np.float32(scale), int(v0), d)
    return d


__all__ = ["LAUNCHES", "LONG_ROW_THREADS", "cross_entropy_grad", "cross_entropy_rows"]
