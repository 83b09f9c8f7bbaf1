"""Compile every device kernel (`exec.devkernels`, `exec.devloss`) to PTX for a Hopper card
(sm_90) without a card, as `tests/test_devcompile.py` runs it: numba-cuda's real compiler
(NVVM, and NVRTC for its float16 shims), not the simulator, at the argument types a run hands
them. So the compiled path of `devlaunch.ld` and `st` (bfloat16 through its bits, an overload
that only compiled kernels use) is typed and lowered here, where the simulator runs the plain
Python functions instead.

numba-cuda asks the current device for its compute capability when it types a device function
(`array.view` is one). There is no device here, so that question is answered with the
target's: the one stand-in this script makes, and only for compiling.

    NUMBA_ENABLE_CUDASIM=0 python tests/_devcompile.py     # prints one line per kernel
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
CC = (9, 0)  # H100 and H200


def main() -> int:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        print("error: NUMBA_ENABLE_CUDASIM is on: this compiles for a card, run it with =0")
        return 2
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    from numba.core import types as nt

    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=CC)
    from ratrain.exec import devkernels, devloss

    k, loss = devkernels._kernels(256), devloss._kernels(256)

    def a(t, nd):
        return nt.Array(t, nd, "A")

    f32, f16, u16, f64, i64 = nt.float32, nt.float16, nt.uint16, nt.float64, nt.int64
    # each kernel's arrays that a run may hand in 16 bits ("d": any of the three dtypes), the
    # rest fixed: all of them fp32, fp16 or bf16, and each alone in bf16 (its own load and
    # store path) with the others fp32
    kernels = {
        "rmsnorm_fwd": (k.rmsnorm_fwd, [("d", 2), ("d", 1), f32, ("d", 2), a(f32, 1), ("d", 2),
                                        nt.boolean]),
        "rmsnorm_bwd": (k.rmsnorm_bwd, [("d", 2), ("d", 2), a(f32, 1), ("d", 1), ("d", 2),
                                        ("d", 2), ("d", 2), a(f32, 2), nt.boolean, nt.boolean]),
        "rmsnorm_rec": (k.rmsnorm_rec, [("d", 2), a(f32, 1), ("d", 1), ("d", 2)]),
        "column_sum": (k.column_sum, [a(f32, 2), a(f32, 1)]),
        "swiglu_fwd": (k.swiglu_fwd, [("d", 2), ("d", 2), ("d", 2)]),
        "swiglu_bwd": (k.swiglu_bwd, [("d", 2), ("d", 2), ("d", 2), ("d", 2), ("d", 2),
                                      ("d", 2), nt.boolean]),
        "rope": (k.rope, [("d", 4), a(f32, 2), a(f32, 2), ("d", 4), i64]),
        "adamw": (k.adamw, [a(f32, 1)] * 4 + [f32] * 10),
        "sum_squares": (k.sum_squares, [a(f32, 1), a(f64, 1)]),
        "sum_parts": (k.sum_parts, [a(f64, 1), a(f64, 1)]),
        "ce_rows": (loss.ce_rows, [("d", 2), a(i64, 1), a(f32, 1), a(f32, 1), i64, f32]),
        "ce_grad": (loss.ce_grad, [("d", 2), a(i64, 1), a(f32, 1), f32, i64, ("d", 2)]),
    }
    failed = 0
    launched = {n for ns in (k, loss) for n, f in vars(ns).items()
                if not f.targetoptions.get("device")}  # kernels, not device functions
    for name in sorted(launched - set(kernels)):  # a kernel added, not listed
        failed += 1
        print(f"FAILED {name}: not compiled here (list its signature above)")
    for name, (kern, spec) in kernels.items():
        free = [i for i, s in enumerate(spec) if isinstance(s, tuple)]
        sigs = {tuple(a(f32, s[1]) if isinstance(s, tuple) else s for s in spec)}
        for i in free:  # one array in bf16, the others fp32
            sigs.add(tuple(a(u16 if j == i else f32, s[1]) if isinstance(s, tuple) else s
                           for j, s in enumerate(spec)))
        for t in (f16, u16):
            sigs.add(tuple(a(t, s[1]) if isinstance(s, tuple) else s for s in spec))
        for sig in sorted(sigs, key=str):
            try:
                cuda.compile_ptx(kern.py_func, sig, cc=CC)
            except Exception as e:  # noqa: BLE001 - each failure named, then the next
                failed += 1
                print(f"FAILED {name}{sig}: {type(e).__name__}: {str(e).splitlines()[0]}")
        print(f"ok {name}: {len(sigs)} signatures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
