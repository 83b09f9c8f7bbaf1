"""Checkpoint save speed and memory vs writing the same bytes with plain h5py.

    .venv/bin/python benchmarks/bench_checkpoint.py [--reps 7] [--dir DIR] [--kills 20]

The benchmark model (vocab 256, hidden 512, 8 layers, 8 heads, ffn 1376: 25.6M parameters) on
one rank: master, m and v as one flat fp32 buffer each (307 MB in all), saved as a full
checkpoint (shard + fsync + rename + manifest + keep), against:

- `h5py`: h5py `create_dataset(data=...)` of the same datasets into one file, then fsync (the
  same durable bytes, no hash, no manifest);
- `h5py-nosync`: the same without fsync (page cache only);
- `save[plain writer]`: our save with the reference writer (h5py, then SHA-256 by reading the
  file back), to compare hashing after writing with hashing while writing.

Cases run interleaved, each on new files after `os.sync()` (no writeback left from the previous
case), the previous rep's files deleted outside the timing. Memory: tracemalloc peak (Python and numpy allocations) and the growth of the process's peak
RSS (VmHWM, reset through /proc/self/clear_refs) during one save, against one layer's worth
(master + m + v of one decoder layer). `--kills N` also runs the SIGKILL crash loop of
tests/test_checkpoint.py N times. Prints a table and one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc

import h5py
import numpy as np

from ratrain import checkpoint as ck
from ratrain.bench import proc_status_kib, reset_hwm
from ratrain.checkpoint.commit import remove_checkpoint
from ratrain.config import config_from_dict
from ratrain.exec.spec import model_blocks

MODEL = {"vocab_size": 256, "hidden": 512, "layers": 8, "heads": 8, "kv_heads": 8, "ffn_hidden": 1376}


def stage_state(cfg):
    """{"master"|"m"|"v": {name: view}} over one flat fp32 array per buffer, like StageState."""
    params = [p for b in model_blocks(cfg.model) for p in b.params]
    n = sum(p.size for p in params)
    rng = np.random.default_rng(0)
    out = {}
    for buf in ("master", "m", "v"):
        flat = rng.standard_normal(n, dtype=np.float32)  # (N,)
        views, off = {}, 0
        for p in params:
            views[p.name] = flat[off : off + p.size].reshape(p.shape)
            off += p.size
        out[buf] = views
    return out, n


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_h5py(path, tensors, sync=True):
    with h5py.File(path, "w") as f:
        for name in tensors["master"]:
            for buf, group in ck.BUFFER_GROUPS.items():
                f.create_dataset(f"{group}/{name}", data=tensors[buf][name])
    if sync:
        fsync_path(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under .)")
    ap.add_argument("--kills", type=int, default=0, help="also run the SIGKILL loop N times")
    args = ap.parse_args(argv)

    cfg = config_from_dict({"model": MODEL, "checkpoint": {"keep": 1}})
    tensors, n = stage_state(cfg)
    layer = sum(p.size for p in model_blocks(cfg.model)[1].params)
    one_layer = 3 * 4 * layer  # master + m + v of one decoder layer, bytes
    total = 3 * 4 * n
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir or ".")
    print(f"model {n / 1e6:.2f}M params, {total / 1e6:.1f} MB of master+m+v; one layer "
          f"{one_layer / 1e6:.1f} MB; dir {work}", flush=True)

    # Every case writes new files (no overwrite, no pruning inside the timing: keep is large);
    # the previous rep's files are deleted outside the timing.
    def ours(writer):
        root = os.path.join(work, f"ours-{writer}")

        def run(i):
            ck.save_checkpoint(root, i, cfg, tensors, {"data_position": i}, writer=writer,
                               keep=10**6, log=lambda m: None)

        def clean(i):
            shutil.rmtree(os.path.join(root, ck.checkpoint_name(i)))
        return run, clean

    def base(sync):
        def run(i):
            plain_h5py(os.path.join(work, f"plain-{int(sync)}-{i}.h5"), tensors, sync)

        def clean(i):
            os.remove(os.path.join(work, f"plain-{int(sync)}-{i}.h5"))
        return run, clean

    cases = {"save": ours("fast"), "h5py": base(True), "h5py-nosync": base(False),
             "save[plain writer]": ours("plain")}
    times = {k: [] for k in cases}
    cpu = {k: [] for k in cases}
    load0 = os.getloadavg()[0]
    try:
        for i in range(1, args.reps + 1):  # interleaved, so machine noise hits every case alike
            for name, (fn, clean) in cases.items():
                os.sync()  # no writeback left over from the previous case
                c0, t0 = time.process_time(), time.perf_counter()
                fn(i)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)  # all threads of the process
                clean(i)
        rows = []
        for name, ts in times.items():
            rows.append({"case": name, "median_s": statistics.median(ts), "min_s": min(ts),
                         "cpu_s": statistics.median(cpu[name]),
                         "MBps": total / 1e6 / statistics.median(ts), "reps": len(ts)})
        ref = {r["case"]: r for r in rows}["h5py"]
        print(f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        print(f"{'case':<20} {'median s':>9} {'min s':>7} {'cpu s':>6} {'MB/s':>6} {'ratio':>6} "
              f"{'ratio(min)':>10}")
        for r in rows:
            r["ratio_vs_h5py"] = r["median_s"] / ref["median_s"]
            r["ratio_min_vs_h5py_min"] = r["min_s"] / ref["min_s"]
            print(f"{r['case']:<20} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {r['cpu_s']:>6.3f} "
                  f"{r['MBps']:>6.0f} {r['ratio_vs_h5py']:>6.2f} {r['ratio_min_vs_h5py_min']:>10.2f}")

        # Removing an old checkpoint (keep), done after the new one is committed.
        root = os.path.join(work, "prune")
        old = ck.save_checkpoint(root, 1, cfg, tensors, {}, keep=1, log=lambda m: None)
        t0 = time.perf_counter()
        remove_checkpoint(old)  # what keep does to each old checkpoint
        t_remove = time.perf_counter() - t0
        print(f"removing one old checkpoint (keep, after the commit): {t_remove:.3f} s")

        # Memory of one save.
        root = os.path.join(work, "mem")
        ck.save_checkpoint(root, 1, cfg, tensors, {}, log=lambda m: None)  # warm imports
        have_hwm = reset_hwm()
        rss0 = proc_status_kib("VmRSS")
        tracemalloc.start()
        ck.save_checkpoint(root, 2, cfg, tensors, {}, log=lambda m: None)
        _, tm_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        hwm = proc_status_kib("VmHWM") if have_hwm else 0
        mem = {"case": "memory", "tracemalloc_peak_bytes": tm_peak,
               "rss_peak_growth_bytes": (hwm - rss0) * 1024 if have_hwm else None,
               "one_layer_bytes": one_layer, "checkpoint_bytes": total}
        print(f"memory: tracemalloc peak {tm_peak / 1e6:.2f} MB, peak RSS growth "
              f"{mem['rss_peak_growth_bytes'] / 1e6 if have_hwm else float('nan'):.2f} MB "
              f"(one layer = {one_layer / 1e6:.1f} MB)")

        # Load and verify.
        path = os.path.join(root, ck.checkpoint_name(2))
        t0 = time.perf_counter()
        problems = ck.verify_checkpoint(path)
        t_verify = time.perf_counter() - t0
        assert problems == [], problems
        t0 = time.perf_counter()
        got = ck.load_checkpoint(path, out=tensors)
        t_load = time.perf_counter() - t0
        assert got["step"] == 2
        print(f"verify (SHA-256 of every file) {t_verify:.3f} s; load into the flat buffers "
              f"{t_load:.3f} s")
        for r in rows + [mem, {"case": "remove_old", "time_s": t_remove}, {"case": "verify", "time_s": t_verify}, {"case": "load", "time_s": t_load}]:
            print(json.dumps(r))

        if args.kills:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from test_checkpoint import crash_loop

            croot = os.path.join(work, "crash")
            t0 = time.perf_counter()
            resumed, interrupted, in_save = crash_loop(croot, args.kills, seed=3, max_delay=0.5)
            print(f"crash loop: {args.kills} SIGKILLs, {in_save} inside a save call, {interrupted} "
                  "leaving a half-done save on disk; every "
                  f"restart resumed from the newest committed checkpoint (steps {resumed}); "
                  f"{time.perf_counter() - t0:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
