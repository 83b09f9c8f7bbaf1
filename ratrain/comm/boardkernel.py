"""The reduce board's compiled round (`comm.board`): numba's atomics, the yield, the fold.

Imported by `board` with the first board only (boards are off by default), so that a process
that never makes a board never imports numba (about 65 MiB of a rank's memory).

May import: `ratrain.fastpath` (where numba is imported), numba (the `fast` extra), numpy.
"""

from __future__ import annotations

import numpy as np

from ratrain.fastpath import load_numba

numba = load_numba()[0]
if numba is None:  # `board.enabled()` said yes, so numba imported: this cannot happen
    raise ImportError(f"the reduce board needs numba: {load_numba()[1]}")
from numba import types  # noqa: E402 - after numba is known to import
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402


@intrinsic
def _load_acquire(typingctx, arr, i):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)
    return types.int64(arr, types.intp), codegen


@intrinsic
def _store_release(typingctx, arr, i, v):
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
        builder.store_atomic(args[2], ptr, "release", 8)
        return context.get_dummy_value()
    return types.void(arr, types.intp, types.int64), codegen


_sched_yield = types.ExternalFunction("sched_yield", types.intc())


@numba.njit(nogil=True, cache=True, inline="always")
def _op(a, b, opcode):  # pragma: no cover - compiled
    """np.add, np.maximum or np.minimum of two elements, bit for bit: a NaN operand wins
    (the first), and of two equal values (0.0 and -0.0) the second."""
    if opcode == 0:
        return a + b
    if a != a or b != b:
        return a if a != a else b
    if opcode == 1:
        return a if a > b else b
    return a if a < b else b


@numba.njit(nogil=True, cache=True)
def run_round(counters, slots, r, t, x, opcode, post, spins):  # pragma: no cover - compiled
    """Post round t (when `post`), wait for every rank's post (at most `spins` yields:
    False when they ran out), then fold every rank's slot into x in the tree's order."""
    p = counters.shape[0]
    par = t & 1
    n = x.shape[0]
    if post:
        for j in range(n):
            slots[r, par, j] = x[j]
        _store_release(counters, r, t)
    k = 0
    while True:
        ready = True
        for q in range(p):
            if _load_acquire(counters, q) < t:
                ready = False
                break
        if ready:
            break
        if k >= spins:
            return False
        k += 1
        _sched_yield()
    m = 1
    while 2 * m <= p:
        m *= 2
    acc = np.empty(m, x.dtype)
    for j in range(n):
        for i in range(m):
            a = slots[i, par, j]
            if i < p - m:
                a = _op(a, slots[i + m, par, j], opcode)
            acc[i] = a
        w = m
        while w > 1:
            for i in range(0, w, 2):
                acc[i // 2] = _op(acc[i], acc[i + 1], opcode)
            w //= 2
        x[j] = acc[0]
    return True


__all__ = ["numba", "run_round", "types"]
