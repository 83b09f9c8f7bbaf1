"""Device operations a training step queues, by category, counted on the CPU stand-in.

    python benchmarks/launches.py [--precision bf16] [--set KEY=VALUE ...] [--against KEY=VALUE ...]

On a card each cupy operation (a ufunc, an operator, a reduction, a cast, a copy, a gather) is a
kernel launch or two, and each costs the host some microseconds of Python and driver whatever
its size; a step of small launches is bound by the host, not the card. The stand-in
(`run.device: standin`) runs the device's code paths on numpy and counts each such operation
(`device.standin.COUNTS["ops"]`); this runs one whole training step of the 124M model (the one
`benchmarks/gpu.py speed` times: hidden 768, 12 layers, vocab 32000, seq 1024, micro-batch 8)
there and shares the count out by the profile's categories (`exec.profile.Profile(counter=)`).
`--against` counts a second configuration (the same model with those keys changed) beside it.
Last, one layer's tiled attention alone, its sequences grouped as a device groups them and as
the host does. `--smoke`: gpu.py's tiny model instead (2 layers, hidden 64), whose device
kernels do run in the simulator there, each launch counted: what the kernel table sends to
cupy's compositions rather than to a kernel shows there (slow: about 3 minutes a step in the
simulator, on an AMD EPYC core).

What it counts is what the device path queues on a card with its kernels: the kernel table's
device entries (`exec.deventries`) send the same calls to the device kernels as on a card, and
`run.devkernels: count` (`exec.devcount`) computes each on the host and counts the device
operations its kernel queues (one launch; two for RMSNorm's backward and for the gradient
norm), as numba-cuda's simulator counts them (tested). `--against
run.devkernels=off` counts the same step on cupy's compositions (every op of RMSNorm, RoPE,
SwiGLU, the head's cross-entropy, AdamW and the gradient norm a launch of its own). The
attention is what a card's `auto` runs: at fp16 and bf16 cuDNN's, as the stand-in counts it
(`run.attention: cudnn-count`, a graph's execute one operation), at fp32 the tiled path at tile
1024 (`--against run.attention=tiled-1024` counts a 16-bit step with it). With cuDNN's
attention each decoder layer's forward and backward is a device graph (`run.graphs: auto`,
`exec.graphs`): the step counted is the first that captures nothing (a block's first call runs
eagerly, its second is captured), a graph's launch one host launch and its operations the device's; the host
launches a step are reported beside the device operations (and the casts among them: an
`astype`, `copyto` or assignment across dtypes, `COUNTS["casts"]`), split into those of the
micro-batches' forward and backward calls (a micro-batch's: their sum over the micro-batches),
less the lifecycle hooks these run between blocks, and those once a step (the hooks' updates,
views, gradients and gradient norm, and the inputs' upload)
(`--against run.graphs=off` counts the eager step). The counts do not
depend on the host, its load or its threads (the stand-in computes in one thread, as a device
rank does).
Prints a table and, last, one JSON line (for `benchmarks/record.py`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BASE = ("run.devkernels=count",)
# the attention a card's `auto` runs: cuDNN's (counted) at 16 bits, the tiled path at fp32
ATTENTION = {"bf16": "cudnn-count", "fp16": "cudnn-count", "fp32": "tiled-1024"}
SMOKE = ("run.devkernels=sim", "run.attention=tiled-1024")  # numba-cuda's simulator
# at most this many steps before the one counted: where run.graphs is on (`exec.graphs`) a
# block's first call runs eagerly, its second is captured, and a block whose input came from an
# eager call is captured again once it comes from a graph; the counted step replays them all
WARM_STEPS = 6


def count(precision: str, sets, smoke: bool = False) -> dict:
    """One counted step (after the warm-up steps, `WARM_STEPS`) of the 124M model (`smoke`:
    gpu.py's tiny one, with the device kernels in numba-cuda's simulator, each launch counted)
    on the stand-in."""
    from ratrain.device import open_device
    from ratrain.device.standin import COUNTS

    if smoke:  # the simulator's cost is per block and thread; a launch counts once at any grid
        from ratrain.exec import devkernels, devlaunch

        devlaunch.MAX_BLOCKS, devkernels.ROW_GROUPS, devlaunch.SIM_THREADS = 1, 1, 8
    dev = open_device("standin")
    base = SMOKE if smoke else (*BASE, f"run.attention={ATTENTION[precision]}")
    from ratrain.runtime.compute import StageCompute

    # host launches inside the micro-batches' forward and backward calls, less those of the
    # lifecycle hooks they run between blocks (a block's update, its views: once a step)
    inside = [0]

    def counted(fn):
        sig = inspect.signature(fn)

        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            hook = bound.arguments.get("hook")
            if hook is not None:
                def outside(*a, **k):
                    before = COUNTS["ops"]
                    try:
                        return hook(*a, **k)
                    finally:
                        inside[0] -= COUNTS["ops"] - before
                bound.arguments["hook"] = outside
            before = COUNTS["ops"]
            try:
                return fn(*bound.args, **bound.kwargs)
            finally:
                inside[0] += COUNTS["ops"] - before
        return call

    # this count's own wrappers around the stage's calls (a second count wraps them afresh)
    originals = StageCompute.forward, StageCompute.backward
    StageCompute.forward, StageCompute.backward = (counted(f) for f in originals)
    try:
        return _count(precision, sets, smoke, dev, base, inside)
    finally:
        StageCompute.forward, StageCompute.backward = originals


def _count(precision, sets, smoke, dev, base, inside) -> dict:
    """`count`'s step, warm-ups and figures, with the stage's calls counted into `inside`."""
    from gpu import ratrain_contender

    from ratrain.device.standin import COUNTS
    from ratrain.exec.profile import Profile

    step, _, cfg, kernels = ratrain_contender(precision, dev, smoke, sets=(*base, *sets))
    for i in range(WARM_STEPS):  # until a step after the first captures no graph
        COUNTS.clear()
        step()
        if i and not COUNTS["captures"]:
            break
    COUNTS.clear()
    inside[0] = 0

    def device_ops():  # a graph's launch is one host launch, its operations the device's
        return COUNTS["ops"] - COUNTS["graphs"] + COUNTS["graph_ops"]

    with Profile(counter=device_ops) as prof:
        t0 = time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
    rows = [{"category": r["category"], "ops": r["count"], "calls": r["calls"]}
            for r in prof.rows()]
    total = device_ops()
    rows.append({"category": "(outside the categories)" if not COUNTS["graphs"] else
                 "(outside the categories: the blocks' graphs)", "calls": 0,
                 "ops": total - sum(r["ops"] for r in rows)})
    rows.sort(key=lambda r: -r["ops"])
    m = cfg.parallel.num_micro_batches
    return {"sets": list(sets), "kernels": kernels, "graphs": cfg.run.graphs, "ops": total,
            "casts": COUNTS["casts"],
            "host_launches": COUNTS["ops"], "graph_launches": COUNTS["graphs"],
            "host_launches_per_micro_batch": inside[0] / m, "micro_batches": m,
            "host_launches_once_a_step": COUNTS["ops"] - inside[0],
            "stand_in_seconds": seconds, "by_category": rows}


def attention_groups(precision: str) -> dict:
    """Device operations of one layer's tiled attention (tile 1024, forward and backward) at
    the 124M shapes on the stand-in: its sequences grouped as on a device (the micro-batch at
    once, `DEVICE_GROUP_BYTES`) and as on the host (`TILE_BYTES`: one at a time here)."""
    import numpy as np
    from gpu import MODEL_124M

    from ratrain.config import load_config
    from ratrain.device.standin import COUNTS, standin
    from ratrain.exec.attention import DEVICE_GROUP_BYTES, TILE_BYTES, TiledAttention
    from ratrain.exec.context import ExecContext
    from ratrain.exec.kernels import DTYPES

    cfg = load_config(None, [*MODEL_124M, f"precision={precision}"])
    m, B = cfg.model, cfg.parallel.micro_batch
    rng = np.random.default_rng(0)
    dt = DTYPES["fp32"]  # the tiled path computes in fp32 whatever the precision
    q = standin.asarray(rng.standard_normal((B, m.heads, m.seq_len, m.head_dim)).astype(dt))
    kv = standin.asarray(rng.standard_normal((B, m.kv_heads, m.seq_len, m.head_dim)).astype(dt))
    out = {}
    with ExecContext(m, "fp32", standin) as ctx:
        for name, group in (("device", DEVICE_GROUP_BYTES), ("host", TILE_BYTES)):
            attn = TiledAttention(1024, group)
            for _ in range(2):  # the first call makes the causal mask, kept for later calls
                COUNTS.clear()
                o, cache = attn.forward(q, kv, kv, ctx)
                attn.backward(o, cache, ctx)
            out[name] = COUNTS["ops"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--against", action="append", default=[], metavar="KEY=VALUE",
                    help="also count the model with these keys changed")
    ap.add_argument("--smoke", action="store_true",
                    help="gpu.py's tiny model, its device kernels run (and counted) in "
                         "numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1)")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    runs = {"this": count(a.precision, a.sets, a.smoke)}
    if a.against:
        runs["against"] = count(a.precision, [*a.sets, *a.against], a.smoke)
    groups = attention_groups(a.precision) if not a.smoke else {}
    for name, r in runs.items():
        print(f"== {name}: {' '.join(r['sets']) or '(defaults)'}  [{r['kernels']}]")
        print(f"   {r['ops']:,} device operations a step ({a.precision}; the stand-in took "
              f"{r['stand_in_seconds']:.1f} s), {r['casts']} of them casts; "
              f"{r['host_launches']:,} host launches "
              f"({r['graph_launches']} of them graphs): "
              f"{r['host_launches_per_micro_batch']:.1f} a micro-batch's forward and backward "
              f"(of {r['micro_batches']}), {r['host_launches_once_a_step']} once a step (the "
              "lifecycle's: the updates, views, gradients and their norm; the inputs)")
        for row in r["by_category"]:
            print(f"   {row['category']:26} {row['ops']:7,d} ops {row['calls']:6d} calls")
    if groups:
        print(f"== one layer's tiled attention (tile 1024), forward and backward: "
              f"{groups['device']:,} device operations with a device's groups (the micro-batch "
              f"at once), {groups['host']:,} with the host's (one sequence at a time)")
    out = {"case": "launches", "precision": a.precision, "model": "smoke" if a.smoke else "124M",
           "attention_layer_ops": groups,
           "ops": {k: r["ops"] for k, r in runs.items()},
           "host_launches": {k: r["host_launches"] for k, r in runs.items()},
           "host_launches_per_micro_batch": {k: r["host_launches_per_micro_batch"]
                                             for k, r in runs.items()},
           "graph_launches": {k: r["graph_launches"] for k, r in runs.items()},
           "casts": {k: r["casts"] for k, r in runs.items()},
           "host_launches_once_a_step": {k: r["host_launches_once_a_step"]
                                         for k, r in runs.items()},
           "by_category": {k: {row["category"]: row["ops"] for row in r["by_category"]}
                           for k, r in runs.items()},
           "sets": {k: r["sets"] for k, r in runs.items()}}
    if "against" in runs:
        out["against_over_this"] = runs["against"]["ops"] / runs["this"]["ops"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
