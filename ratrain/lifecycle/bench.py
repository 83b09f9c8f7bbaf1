"""Look at and time the lifecycle policies.

    python -m ratrain.lifecycle.bench grid --pp 4 --m 6 --policy ratrain [--dp 2]  # step x rank grid
    python -m ratrain.lifecycle.bench memory --config jobs/llama2-7b.yaml --pp 8 --m 16 --dp 64
    mpirun -n 4 python -m ratrain.lifecycle.bench time --pp 2 --dp 2 --bandwidth 2e8

`grid` prints the schedule (one step after a previous one, so deferred work shows). `memory`
prints the memory model's peak per stage and policy (activation sizes from shapes); `--dp`
gives `ratrain` its sharded optimizer state (the other policies keep whole state). `time` trains
a small model for a few steps under each policy in the same session, the link throttled through
the shim (`--bandwidth` B/s, `--latency` s) and compute paced to `--compute-flops` per rank (so
timings hold with more ranks than cores), and prints the median step time per policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ratrain.lifecycle.grid import grid
from ratrain.lifecycle.policies import POLICIES, Policy, StageInfo
from ratrain.lifecycle.validate import policy_steps, validate_policy


def _infos(model, pp, m, precision, layers_per_stage=None, shards=1):
    from ratrain.exec.spec import stage_blocks

    out = []
    for s in range(pp):
        blocks = stage_blocks(model, pp, s, layers_per_stage)
        out.append(StageInfo(pp, s, m, tuple(b.name for b in blocks),
                             tuple(4 * b.size for b in blocks), precision, shards))
    return out


def cmd_grid(args) -> None:
    from ratrain.config import ModelConfig

    model = ModelConfig(layers=args.layers)
    pol = Policy(args.policy, bucket_bytes=args.bucket_bytes)
    infos = _infos(model, args.pp, args.m, args.precision, shards=pol.shards(args.dp))
    validate_policy(pol, infos)
    lists = [policy_steps(pol, i, 2)[1] for i in infos]
    print(f"# {args.policy}, pp={args.pp}, dp={args.dp}, m={args.m}, {args.precision} "
          "(a step after a step)")
    print(grid(lists, [i.blocks for i in infos], f=1, b=args.b, lifecycle=not args.compute_only))


def cmd_memory(args) -> None:
    from ratrain.config import load_config
    from ratrain.exec.spec import stage_blocks
    from ratrain.plan.memory import (StageSizes, choose_recompute, layer_activation_bytes,
                                     simulate_peak)

    cfg = load_config(args.config, args.set)
    model, prec = cfg.model, cfg.precision
    mb = cfg.parallel.micro_batch
    item = 2 if prec == "fp16" else 4
    rows = []
    for policy in ("baseline-1f1b", "megatron-1f1b", "ratrain"):
        pol = Policy(policy)
        shards = pol.shards(args.dp, cfg.schedule.shard_optimizer)
        for s in range(args.pp):
            blocks = stage_blocks(model, args.pp, s)
            info = StageInfo(args.pp, s, args.m, tuple(b.name for b in blocks),
                             tuple(4 * b.size for b in blocks), prec, shards)
            act, full = {}, {}
            for b in blocks:
                if b.kind == "layer":
                    act[b.name] = {k: layer_activation_bytes(model, mb, prec, k)
                                   for k in ("all", "selective", "input")}
                elif b.kind == "head":  # input + fp32 statistics (logits are chunked)
                    act[b.name] = {"all": mb * model.seq_len * (model.hidden * item + 8)}
                else:
                    act[b.name] = {"all": mb * model.seq_len * 8}
                full[b.name] = act[b.name]["all"]
            sizes = StageSizes(prec, {b.name: b.size for b in blocks}, act, full,
                               mb * model.seq_len * model.hidden * item,
                               keep={b.name: args.keep for b in blocks if b.kind == "layer"},
                               shards=shards)
            peak = simulate_peak(policy_steps(pol, info, 2)[:2], info.blocks, sizes)
            row = {"policy": policy, "stage": s, "dp": args.dp, "shards": shards,
                   "peak_GiB": round(peak / 2**30, 3), "peak_MiB": round(peak / 2**20, 2)}
            if args.cap_gib:  # the fewest layers recomputed (keep=input) under the cap
                keep, kpeak = choose_recompute(int(args.cap_gib * 2**30), sizes,
                                               policy_steps(pol, info, 2)[:2], info.blocks)
                row["recomputed"] = sum(k == "input" for k in keep.values())
                row["layers"] = len(keep)
                row["auto_peak_GiB"] = round(kpeak / 2**30, 3)
            rows.append(row)
    for r in rows:
        print(json.dumps(r))


def _config(model, pp, dp, m, precision, policy, micro_batch):
    from ratrain.config import (Config, OptimConfig, ParallelConfig, RunConfig,
                                ScheduleConfig)

    return Config(model=model,
                  parallel=ParallelConfig(pp=pp, dp=dp, micro_batch=micro_batch,
                                          num_micro_batches=m),
                  precision=precision, schedule=ScheduleConfig(policy=policy),
                  optim=OptimConfig(lr=1e-3, grad_clip=1.0), run=RunConfig(steps=100, threads=1))


def _batch(cfg, step, replica):
    import numpy as np

    p, mc = cfg.parallel, cfg.model
    rng = np.random.default_rng(step)
    ids = rng.integers(0, mc.vocab_size, (p.dp * p.num_micro_batches, p.micro_batch, mc.seq_len + 1))
    ids = ids[replica * p.num_micro_batches:(replica + 1) * p.num_micro_batches]
    return ids[..., :-1].copy(), ids[..., 1:].copy()


def cmd_time(args) -> None:
    from mpi4py import MPI

    from ratrain.comm.engine import CommEngine
    from ratrain.comm.topology import Topology
    from ratrain.config import ModelConfig
    from ratrain.exec.context import ExecContext
    from ratrain.exec.params import StageState
    from ratrain.exec.spec import stage_blocks
    from ratrain.lifecycle.executor import Executor
    from ratrain.shim.ledger import Ledger
    from ratrain.shim.link import Link

    comm = MPI.COMM_WORLD
    model = ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=4,
                        kv_heads=4, ffn_hidden=int(args.hidden * 8 / 3) // 8 * 8,
                        seq_len=args.seq)
    out = {}
    for policy in args.policies.split(","):
        cfg = _config(model, args.pp, args.dp, args.m, args.precision, policy, args.micro_batch)
        topo = Topology(comm, args.pp, args.dp)
        link = Link(args.bandwidth, args.latency) if args.bandwidth else None
        engine = CommEngine(topo, watchdog_s=120, link=link)
        ledger = Ledger(None, comm.Get_rank())
        state = StageState(stage_blocks(model, args.pp, topo.stage), cfg.precision, ledger)
        ctx = ExecContext(model, cfg.precision, ledger=ledger, threads=1)
        pacer = None
        if args.compute_flops:
            from ratrain.shim.pacing import Pacer

            pacer = Pacer(compute_flops=args.compute_flops, enabled=True)
        ex = Executor(cfg, topo, state, ctx, engine, ledger, pacer=pacer)
        times = []
        for s in range(args.steps):
            comm.Barrier()  # benchmark only: start every step together
            res = ex.run_step(s, _batch(cfg, s, topo.replica))
            times.append(res.step_time_s)
        ex.flush()
        if args.trace:
            ex.write_trace(f"{args.trace}.{policy}.json")
        t = max(comm.allgather(statistics.median(times[1:] or times)))
        out[policy] = {"step_s": round(t, 4), "loss": res.loss,
                       "peak_ddr_MiB": round(res.peak_ddr_bytes / 2**20, 2)}
        engine.close()
        topo.free()
    if comm.Get_rank() == 0:
        base = out.get("baseline-1f1b", {}).get("step_s")
        for policy, r in out.items():
            if base:
                r["speedup_vs_baseline"] = round(base / r["step_s"], 3)
            print(json.dumps({"policy": policy, "pp": args.pp, "dp": args.dp, "m": args.m,
                              "bandwidth": args.bandwidth, **r}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.lifecycle.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid")
    g.add_argument("--pp", type=int, default=4)
    g.add_argument("--m", type=int, default=6)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--policy", choices=POLICIES, default="ratrain")
    g.add_argument("--dp", type=int, default=1, help="replicas (ratrain shards over them)")
    g.add_argument("--precision", choices=("fp32", "fp16"), default="fp16")
    g.add_argument("--bucket-bytes", type=int, default=2**20)
    g.add_argument("--b", type=int, default=1, help="ticks per backward")
    g.add_argument("--compute-only", action="store_true")
    mm = sub.add_parser("memory")
    mm.add_argument("--config", required=True)
    mm.add_argument("--set", action="append", default=[])
    mm.add_argument("--pp", type=int, default=4)
    mm.add_argument("--m", type=int, default=8)
    mm.add_argument("--keep", default="all", choices=("all", "selective", "input"))
    mm.add_argument("--dp", type=int, default=1, help="replicas (ratrain shards over them)")
    mm.add_argument("--cap-gib", type=float, default=0.0,
                    help="also choose the fewest layers to recompute under this cap (GiB)")
    t = sub.add_parser("time")
    for k, v in (("pp", 2), ("dp", 2), ("m", 4), ("hidden", 256), ("layers", 4), ("seq", 64),
                 ("micro_batch", 2), ("steps", 5)):
        t.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    t.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    t.add_argument("--bandwidth", type=float, default=0.0)
    t.add_argument("--latency", type=float, default=20e-6)
    t.add_argument("--compute-flops", type=float, default=0.0,
                   help="pace each block's compute to flops / this rate (0: host speed)")
    t.add_argument("--policies", default="baseline-1f1b,megatron-1f1b,ratrain")
    t.add_argument("--trace", default="")
    args = ap.parse_args(argv)
    {"grid": cmd_grid, "memory": cmd_memory, "time": cmd_time}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
