"""The fused device kernels (ratrain.exec.devkernels, and the head's cross-entropy in
ratrain.exec.devloss) against the plain cupy composition of ratrain.exec.kernels / optim (the
references, which the kernel table replaces on a GPU rank), on one GPU, at the 124M model's
shapes (issue 19: hidden 768, 12 heads of 64, seq 1024, micro-batch 8, ffn 2048, vocab 32000;
124M parameters for AdamW and the gradient norm).

    .venv/bin/python benchmarks/devkernels.py                 # fp32 activations, a table
    .venv/bin/python benchmarks/devkernels.py --dtype fp16    # fp16 activations and logits
    .venv/bin/python benchmarks/record.py devkernels -- .venv/bin/python \\
        benchmarks/devkernels.py --json                       # a record (one JSON line a case)

Each figure is the median of `--repeats` (10) timed calls after `--warmup` (3), each call
between two device synchronisations; both sides run on cupy's current stream, interleaved call
by call. Each case also reports the largest |fused - cupy| / max |cupy| of its first output.
Refuses in one line (exit 2) without cupy, a GPU or numba-cuda, or under the simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/

B, T, C, H, D, F, V = 8, 1024, 768, 12, 64, 2048, 32000  # the 124M model, one micro-batch
PARAMS = 124_000_000  # AdamW, the gradient norm: the whole model's flat buffers
EPS = 1e-5


def refuse(why: str) -> None:
    print(f"devkernels benchmark: {why}", file=sys.stderr)
    sys.exit(2)


def device():
    """(cupy, devkernels, the card's name), or refuse."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        refuse("NUMBA_ENABLE_CUDASIM is on: a benchmark needs the GPU, not the simulator "
               "(NUMBA_ENABLE_CUDASIM=0)")
    try:
        import cupy
    except ImportError as e:
        refuse(f"cupy is not installed (the gpu extra): {e}")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            refuse("no GPU is visible")
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    except Exception as e:  # noqa: BLE001 - no driver, no device: one line either way
        refuse(f"no usable GPU ({type(e).__name__}: {e})")
    from ratrain.exec import devkernels, devlaunch

    try:
        devlaunch.load()
    except ImportError as e:
        refuse(str(e))
    return cupy, devkernels, props["name"].decode()


def cases(cp, dk, act):
    """name -> (cupy composition, fused call), each a no-argument function returning an array."""
    from ratrain.exec import devloss, kernels, optim

    rng = cp.random.default_rng(0)

    def rand(*shape, dtype=act, scale=1.0):
        return (rng.standard_normal(shape, dtype=cp.float32) * scale).astype(dtype)

    x, w, dy = rand(B, T, C), rand(C), rand(B, T, C)
    _, rcache = kernels.rmsnorm_forward(x, w, EPS, cp)
    _, dcache = dk.rmsnorm_forward(x, w, EPS, cp)
    gu, dact = rand(B * T, 2 * F), rand(B * T, F)
    gate, up = gu[:, :F], gu[:, F:]  # the layer's strided halves
    qkv = rand(B * T, 3 * H * D)
    xq = qkv[:, : H * D].reshape(B, T, H, D)  # token-major view, as the layer's
    cos, sin = kernels.rope_tables(T, D, 10000.0, cp)
    cos3, sin3 = cos[:, None], sin[:, None]
    qout = [cp.empty((B, H, T, D), cp.float32) for _ in range(2)]  # cupy's, the fused one's
    logits, targets = rand(B * T, V, scale=4.0), rng.integers(0, V, B * T)
    logits32 = logits.astype(cp.float32)
    lse, _ = kernels.cross_entropy_rows(logits32, targets, cp)
    dlogits = [cp.empty((B * T, V), cp.float32) for _ in range(2)]  # each side's scratch
    p, m, v, g = (rand(PARAMS, dtype=cp.float32, scale=s) for s in (1, 0.1, 0.01, 1))
    v = cp.abs(v)
    tmp = cp.empty_like(p)
    adam = (0.5, 0.9, 0.95, 1e-3 / (1 - 0.9**3), (1 - 0.95**3) ** 0.5, 1e-8)

    def ce_grad(module, k):  # the head's backward on one chunk of the whole vocabulary
        dlogits[k][...] = logits32
        return module.cross_entropy_grad(dlogits[k], targets, lse, 1.0 / (B * T), cp)

    def adam_ref():  # optim's reference update (fused.adamw's arithmetic) on the same buffers
        g2 = g * np.float32(0.5)
        optim._adam_core(cp, p, m, v, g2, tmp, 0.9, 0.95, adam[3], adam[4], 1e-8)
        return p

    def adam_dev():
        dk.adamw(p, m, v, g, *adam[:1], 1.0, *adam[1:], cp)
        return p

    return {
        "rmsnorm forward": (lambda: kernels.rmsnorm_forward(x, w, EPS, cp)[0],
                            lambda: dk.rmsnorm_forward(x, w, EPS, cp)[0]),
        "rmsnorm backward": (lambda: kernels.rmsnorm_backward(dy, rcache, cp)[0],
                             lambda: dk.rmsnorm_backward(dy, dcache, cp)[0]),
        "swiglu forward": (lambda: kernels.swiglu_forward(gate, up, cp)[0],
                           lambda: dk.swiglu_forward(gate, up, cp)[0]),
        "swiglu backward": (lambda: kernels.swiglu_backward(dact, (gate, up), cp)[0],
                            lambda: dk.swiglu_backward(dact, (gate, up), cp)[0]),
        "rope forward": (
            lambda: kernels.rope_forward(xq, cos3, sin3, cp, out=qout[0].transpose(0, 2, 1, 3))[0],
            lambda: dk.rope_forward(xq, cos3, sin3, cp, out=qout[1].transpose(0, 2, 1, 3))[0]),
        "rope backward": (lambda: kernels.rope_backward(xq, (cos3, sin3), cp),
                          lambda: dk.rope_backward(xq, (cos3, sin3), cp)),
        "cross-entropy lse + losses": (
            lambda: kernels.cross_entropy_rows(logits32, targets, cp)[1],
            lambda: devloss.cross_entropy_rows(logits32, targets, cp)[1]),
        "cross-entropy dlogits (+ copy)": (lambda: ce_grad(kernels, 0),
                                           lambda: ce_grad(devloss, 1)),
        "adamw (124M)": (adam_ref, adam_dev),
        "grad sum of squares (124M)": (lambda: cp.asarray(kernels.block_sq_norm(g, cp)),
                                       lambda: dk.sum_squares(g, cp)),
    }


def time_pair(cp, ref, dev, warmup, repeats):
    """(median ms of ref, median ms of dev), interleaved call by call."""
    times = ([], [])
    for i in range(warmup + repeats):
        for k, fn in enumerate((ref, dev)):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            if i >= warmup:
                times[k].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32",
                    help="activations, logits and scores (masters and moments stay fp32)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="one JSON object a case (record.py)")
    args = ap.parse_args(argv)
    cp, dk, card = device()
    act = cp.float16 if args.dtype == "fp16" else cp.float32
    rows = []
    for name, (ref, dev) in cases(cp, dk, act).items():
        a, b = ref(), dev()  # also compiles the kernel before its warm-up
        a, b = (cp.asarray(t, dtype=cp.float64) for t in (a, b))
        err = float(cp.abs(a - b).max() / max(float(cp.abs(a).max()), 1e-30))
        if name.startswith("adamw"):
            err = float("nan")  # both sides updated the same buffers in place: no comparison
        ms_ref, ms_dev = time_pair(cp, ref, dev, args.warmup, args.repeats)
        rows.append({"case": name, "dtype": args.dtype, "cupy_ms": ms_ref, "fused_ms": ms_dev,
                     "speedup": ms_ref / ms_dev, "max_rel_err": err, "card": card})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{card}, activations {args.dtype}; median of {args.repeats} after {args.warmup} "
          "warm-ups")
    print(f"{'kernel':32} {'cupy ms':>9} {'fused ms':>9} {'speed-up':>9} {'max rel err':>12}")
    for r in rows:
        print(f"{r['case']:32} {r['cupy_ms']:9.3f} {r['fused_ms']:9.3f} {r['speedup']:8.2f}x "
              f"{r['max_rel_err']:12.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
