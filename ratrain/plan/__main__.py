"""`python -m ratrain.plan`: the best layouts of a model on N clusters, and how it scales.

    python -m ratrain.plan --config jobs/llama2-7b.yaml [--clusters 1024] [--policy all] [--top 5]
        [--global-batch SEQS] [--cap-gib 20] [--set platform.compute_flops=8e12 ...]
        [--calibrate RUN_DIR] [--match-tokens-per-s 112790] [--scaling 64,128,256,512,1024]
        [--memory-table] [--ranks-per-node K] [--placement pp|dp|both] [--mixed F] [--tier NAME]
        [--sync-periods 2,4,8]

Prints the platform rates with their sources, per policy the fastest layouts that fit the DDR
cap (step time, tokens/s, peak DDR vs cap, recomputed layers, exposed communication, bubble), a
weak-scaling table (tokens/s and efficiency relative to the smallest cluster count) comparing
the policies, and with `--memory-table` which pipeline depths fit under the cap.

`--ranks-per-node K` packs K clusters per node (consecutive ranks, sharing one network
interface of the profile's `link_bandwidth`; the profile's `ranks_per_node` by default, 4 for
mt3000); `--placement` says which grid axis stays inside a node (`both`, the default, plans
each layout with both and shows the better per policy, with its placement).

A config with `platform.classes` (a mixed cluster), or `--mixed F` (the first half of the ranks
at the profile's rate, the second half at F times it), is planned by `plan.hetero` instead: the
classes, the planner's partition (layout, placement, policy, layers per stage, micro-batches per
replica) beside the best symmetric plan on the same ranks, each with its predicted tokens/s, and
with `--mixed` beside a uniform cluster of the same total compute.

`--sync-periods 2,4,8` prints, for the config's own layout on its platform's link (e.g. `--set
platform.link_bandwidth=1.25e8`), full synchronization against partial synchronization
(`sync.mode: partial`) at each period H: step, tokens/s, the bytes a step all-reduces across the
replicas, the exposed communication and the speed-up over full (`plan.sync`), then stops.

A config that states a memory tier below the DDR (`platform.tier`, or `--tier NAME`: a tier of
the profile, mt3000's `host` or `nvme`) gets, after today's plan, the best plans with the tier
(`plan.tierplan`: each layer kept, recomputed or offloaded, the optimizer state kept or in the
tier), each with its bytes in the tier, its traffic per step and whether the simulator finds
it hidden, and the best beside today's best with the simulator's breakdown of both.

`--match-tokens-per-s X` fits the compute rate so that the config's own layout under `ratrain`
predicts X tokens/s at `--clusters` (a calibration, e.g. to a published figure); everything else
printed is then a prediction from that rate. `--calibrate RUN_DIR` fits it to a measured run.
"""

from __future__ import annotations

import argparse
import sys
import time

from ratrain.config import ConfigError, load_config
from ratrain.plan import hetero
from ratrain.plan.calibrate import calibrate, fit_compute_rate
from ratrain.plan.cost import CostModel, Rates
from ratrain.plan.search import (
    POLICY_NAMES,
    SCALING_CLUSTERS,
    Layout,
    cap_bytes,
    memory_table,
    plan_layout,
    scaling,
    search,
)
from ratrain.plan.simulate import config_classes
from ratrain.plan.sync import sync_table
from ratrain.plan.tierplan import report, tier_search
from ratrain.shim.platform import class_profile, resolve_platform

GIB = 2**30


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m ratrain.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a job YAML (jobs/llama2-7b.yaml, ...)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. platform.compute_flops=8e12")
    ap.add_argument("--clusters", type=int, default=None,
                    help="clusters to plan for (default: the config's pp * dp)")
    ap.add_argument("--policy", default="all",
                    help=f"one of {', '.join(POLICY_NAMES)} or all (default)")
    ap.add_argument("--top", type=int, default=5, help="layouts shown per policy")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step (default: the config's global batch)")
    ap.add_argument("--micro-batches", default="1,2", help="micro-batch sizes to try")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="DDR cap per cluster in GiB (default: the platform profile's)")
    ap.add_argument("--calibrate", metavar="RUN_DIR", default=None,
                    help="fit the compute rate to a measured run (metrics.jsonl, trace.json)")
    ap.add_argument("--match-tokens-per-s", type=float, default=None,
                    help="fit the compute rate so the config's layout predicts this throughput")
    ap.add_argument("--scaling", default=",".join(map(str, SCALING_CLUSTERS)),
                    help="cluster counts of the scaling table ('' for none)")
    ap.add_argument("--memory-table", action="store_true",
                    help="also print which pipeline depths fit under the cap")
    ap.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                    help="clusters per node, sharing its interface (default: the profile's)")
    ap.add_argument("--placement", default="both", choices=("pp", "dp", "both"),
                    help="which grid axis stays inside a node (default: plan both)")
    ap.add_argument("--sync-periods", default=None, metavar="H,H,...",
                    help="full against partial synchronization at these periods, for the "
                    "config's own layout and link (then stop)")
    ap.add_argument("--tier", default=None, metavar="NAME",
                    help="also plan with this memory tier of the profile (platform.tier: "
                    "mt3000's host or nvme)")
    ap.add_argument("--mixed", type=float, default=None, metavar="F",
                    help="plan a mixed cluster: the first half of the ranks at the profile's "
                    "compute rate, the second half at F times it, beside a uniform cluster of "
                    "the same total compute (a config with platform.classes is planned as one "
                    "without this flag)")
    args = ap.parse_args(argv)
    if args.mixed is not None and args.mixed <= 0:
        ap.error("--mixed must be > 0")
    if args.policy != "all" and args.policy not in POLICY_NAMES:
        ap.error(f"--policy {args.policy!r} is not one of {', '.join(POLICY_NAMES)}, all")
    if args.top < 1:
        ap.error("--top must be >= 1")
    if args.clusters is not None and args.clusters < 1:
        ap.error("--clusters must be >= 1")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        ap.error("--ranks-per-node must be >= 1")
    args.placements = ("pp", "dp") if args.placement == "both" else (args.placement,)
    try:
        args.mbs = tuple(int(x) for x in args.micro_batches.split(",") if x.strip())
        args.scale = tuple(int(x) for x in args.scaling.split(",") if x.strip())
        args.periods = tuple(int(x) for x in (args.sync_periods or "").split(",") if x.strip())
    except ValueError:
        ap.error("--micro-batches, --scaling and --sync-periods take comma-separated integers")
    if args.sync_periods is not None and (not args.periods or min(args.periods) < 1):
        ap.error("--sync-periods needs periods >= 1, e.g. 2,4,8")
    if not args.mbs or min(args.mbs) < 1:
        ap.error("--micro-batches needs positive integers")
    return args


def _gib(n) -> str:
    return f"{n / GIB:.2f}"


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, args.set + ([f"platform.tier={args.tier}"]
                                                   if args.tier else []))
        cost = CostModel.from_config(cfg)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ranks_per_node is not None:
        cost = cost.with_rates(cost.rates.with_("ranks_per_node", args.ranks_per_node,
                                                "--ranks-per-node"))
    t0 = time.perf_counter()
    if args.sync_periods is not None:
        return _print_sync(cfg, cost, args)
    if args.mixed is not None or cfg.platform.classes:
        code = _print_mixed(cfg, args)
        print(f"\n(planned in {time.perf_counter() - t0:.1f} s)")
        return code
    clusters = args.clusters or cfg.parallel.world_size
    cap = int(args.cap_gib * GIB) if args.cap_gib is not None else cap_bytes(cfg)
    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    m = cfg.model

    if args.calibrate:
        try:
            cal = calibrate(cfg, args.calibrate, cost)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot calibrate from {args.calibrate}: {e}", file=sys.stderr)
            return 2
        cost = cost.with_rates(cal.rates)
        print(f"calibrated ({cal.method}): measured step {cal.measured_step_s:.4g} s over "
              f"{cal.steps_used} steps, model {cal.predicted_step_s:.4g} s")
    if args.match_tokens_per_s:
        try:
            cost = _match_rate(cfg, cost, clusters, cap, args.match_tokens_per_s)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    print(f"model: {args.config}  {m.num_params() / 1e9:.2f}B parameters, {m.layers} layers, "
          f"seq {m.seq_len}, {cfg.precision}; {clusters} clusters, DDR cap "
          f"{_gib(cap) if cap else 'none'} GiB")
    _print_rates(cost.rates)

    plans = search(cfg, clusters, policies, cost, cap, args.global_batch, args.mbs,
                   placements=args.placements, top=args.top)
    _print_plans(plans, policies, clusters, m.layers, args.top)

    if args.scale:
        _print_scaling(cfg, plans, policies, args.scale, cost, cap)
    if args.memory_table:
        _print_memory(cfg, cap, clusters)
    if resolve_platform(cfg.platform).tier is not None:  # beside today's plan: with the tier
        tiered = tier_search(cfg, clusters, policies, cost, cap, args.global_batch, args.mbs,
                             placements=args.placements, top=args.top)
        print("\n".join(report(cfg, tiered, plans, cost, clusters, args.top)))
    print(f"\n(planned in {time.perf_counter() - t0:.1f} s)")
    return 0


def _print_sync(cfg, cost, args) -> int:
    """Full against partial synchronization on the config's layout and link (`plan.sync`)."""
    try:
        rows = sync_table(cfg, args.periods, cost)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p, m = cfg.parallel, cfg.model
    print(f"model: {args.config}  {m.num_params() / 1e9:.3f}B parameters, pp {p.pp} x dp "
          f"{p.dp} ({p.placement}), {cfg.precision}, policy {cfg.schedule.policy}"
          + (f"; in this host's time (platform.time_scale {cfg.platform.time_scale:g})"
             if cfg.platform.time_scale != 1 else ""))
    _print_rates(cost.rates)
    print("\n== data-parallel synchronization on this link (simulated; partial: a period's "
          "mean) ==")
    print(f"  {'':<30} {'step s':>9} {'tokens/s':>10} {'synced MB/step':>14} "
          f"{'exposed s':>9} {'speed-up':>8}")
    for r in rows:
        print(f"  {r.label:<30} {r.step_s:>9.4g} {r.tokens_per_s:>10.1f} "
              f"{r.synced_bytes / 1e6:>14.2f} {r.exposed_s:>9.3g} {r.speedup:>7.2f}x")
    print("  speed-up: in steps/s. Partial sync is not exact: the speed-up to a loss is this "
          "times\n  what a partial step is worth in full's (`ratrain.compare PARTIAL FULL --key "
          "eval_loss\n  --step-efficiency` on the job's eval curves, e.g. from "
          "`benchmarks/psync.py curves`).")
    return 0


def _mixed_row(label: str, cand, base: float | None = None) -> str:
    p = cand.cfg.parallel
    layers = hetero.runs(p.layers_per_stage) if p.layers_per_stage else "even"
    shares = hetero.runs(p.shares)
    vs = f"  ({cand.tokens_per_s / base:.3f}x)" if base else ""
    return (f"  {label:<22} pp {p.pp} x dp {p.dp} ({p.placement}), {cand.cfg.schedule.policy}, "
            f"layers per stage [{layers}], micro-batches per replica [{shares}]: "
            f"{cand.tokens_per_s:,.0f} tokens/s{vs}")


def _print_mixed(cfg, args) -> int:
    """A mixed cluster: the planner's partition beside the best symmetric plan (and, with
    `--mixed`, beside a uniform cluster of the same total compute), predicted by the simulator
    with each rank at its class's rates (`plan.hetero`)."""
    world = cfg.parallel.world_size
    if args.clusters not in (None, world):
        print(f"error: --clusters {args.clusters}: a mixed cluster is planned on the config's "
              f"parallel.pp x parallel.dp = {world} ranks", file=sys.stderr)
        return 2
    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    try:
        if args.mixed is not None:
            cfg = hetero.halves(cfg, args.mixed)
        classes = config_classes(cfg)  # by rank: no node is known here
        ranked = [c for c in hetero.candidates(cfg, classes, policies) if c.fits]
        uniform = hetero.uniform_like(cfg, classes) if args.mixed is not None else None
        uni = ([c for c in hetero.candidates(uniform, ("uniform",) * world, policies) if c.fits]
               if uniform is not None else None)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = cfg.model
    print(f"model: {args.config}  {m.num_params() / 1e9:.2f}B parameters, {m.layers} layers, "
          f"seq {m.seq_len}, {cfg.precision}; {world} clusters, global batch "
          f"{cfg.parallel.global_batch} sequences"
          + (f"; tokens/s in this host's time (platform.time_scale {cfg.platform.time_scale:g})"
             if cfg.platform.time_scale != 1 else ""))
    for c in cfg.platform.classes:
        prof = class_profile(cfg.platform, c.name)
        n = sum(1 for x in classes if x == c.name)
        print(f"  class {c.name}: {n} ranks, {prof.compute_flops:.4g} flop/s, DDR "
              f"{_gib(prof.ddr_bytes) if prof.ddr_bytes else 'no cap'} GiB")
    if not ranked:
        print("  nothing fits under the classes' DDR caps")
        return 1
    sym = next((c for c in ranked if c.symmetric), None)
    print("\n== the planner's partition beside the best symmetric plan (predicted) ==")
    print(_mixed_row("planner's choice:", ranked[0]))
    if sym is not None:
        print(_mixed_row("best symmetric:", sym))
        print(f"  choice / symmetric: {ranked[0].tokens_per_s / sym.tokens_per_s:.3f}x")
    if uni:
        rate = uniform.platform.classes[0].compute_flops
        print(f"\n== a uniform cluster of the same total compute ({world} ranks at "
              f"{rate:.4g} flop/s) ==")
        print(_mixed_row("its best plan:", uni[0]))
        print(f"  mixed / uniform: {ranked[0].tokens_per_s / uni[0].tokens_per_s:.3f}x")
    return 0


def _match_rate(cfg, cost: CostModel, clusters: int, cap, tokens_per_s: float) -> CostModel:
    """`cost` with the compute rate at which the config's own layout under `ratrain` predicts
    `tokens_per_s` on `clusters` (ValueError when that layout does not fit the cap)."""
    p, m = cfg.parallel, cfg.model
    lay = Layout(p.pp, clusters // p.pp, p.micro_batch, p.num_micro_batches,
                 placement=p.placement)

    def step_at(rate: float) -> float:
        c = cost.with_rates(cost.rates.with_("compute_flops", rate, "fit"))
        plans = plan_layout(cfg, lay, "ratrain", c, cap)
        best = max((q for q in plans if q.result), key=lambda q: q.tokens_per_s, default=None)
        if best is None:
            raise ValueError(f"the config's layout {lay} does not fit the cap")
        return lay.global_batch * m.seq_len / best.tokens_per_s

    rate = fit_compute_rate(step_at, lay.global_batch * m.seq_len / tokens_per_s, lo=1e9, hi=1e16)
    return cost.with_rates(cost.rates.with_(
        "compute_flops", rate,
        f"calibrated: the config's layout pp={lay.pp} dp={lay.dp} m={lay.num_micro_batches} "
        f"under ratrain predicts {tokens_per_s:,.0f} tokens/s on {clusters} clusters"))


def _print_plans(plans, policies, clusters: int, layers: int, top: int) -> None:
    for pol in policies:
        print(f"\n== {pol}: best layouts on {clusters} clusters ==")
        if not plans[pol]:
            print("  nothing fits under the cap")
            continue
        print(f"  {'pp':>3} {'dp':>4} {'mb':>2} {'m':>4} {'place':>5} {'step s':>8} "
              f"{'tokens/s':>9} {'peak GiB':>8} {'recompute':>16} {'exposed s':>9} "
              f"{'bubble s':>8}")
        for q in plans[pol][:top]:
            lay = q.layout
            print(f"  {lay.pp:>3} {lay.dp:>4} {lay.micro_batch:>2} {lay.num_micro_batches:>4} "
                  f"{lay.placement:>5} "
                  f"{q.step_s:>8.2f} {q.tokens_per_s:>9.0f} {_gib(q.peak_bytes):>8} "
                  f"{lay.describe(layers):>16} {q.result.comm_exposed_s:>9.3f} "
                  f"{q.result.bubble_s:>8.2f}")
    _print_placements(plans, policies)
    if len(policies) > 1 and plans.get("ratrain") and plans.get("baseline-1f1b"):
        r, b = plans["ratrain"][0], plans["baseline-1f1b"][0]
        print(f"\nratrain / baseline-1f1b (best of each): {r.tokens_per_s / b.tokens_per_s:.3f}x")


def _print_placements(plans, policies) -> None:
    """With both placements planned: per policy, the better one's best tokens/s over the other's."""
    for pol in policies:
        best = {}
        for q in plans[pol]:
            best.setdefault(q.layout.placement, q.tokens_per_s)
        if len(best) == 2:
            win = max(best, key=best.get)
            lose = next(k for k in best if k != win)
            print(f"placement ({pol}): {win} {best[win]:.0f} tok/s, {lose} {best[lose]:.0f} "
                  f"({best[win] / best[lose]:.4f}x)")


def _print_rates(rates: Rates) -> None:
    for key, unit in (("compute_flops", "flop/s"), ("link_bandwidth", "B/s"),
                      ("link_latency", "s"), ("intra_bandwidth", "B/s"), ("intra_latency", "s"),
                      ("ranks_per_node", "ranks"), ("mem_bandwidth", "B/s")):
        src = " ".join(rates.source(key).split())
        print(f"  {key} = {getattr(rates, key):.4g} {unit}  ({src})")


def _print_scaling(cfg, plans, policies, clusters, cost, cap) -> None:
    tables = {}
    for pol in policies:
        if plans[pol]:
            tables[pol] = scaling(cfg, plans[pol][0].layout, pol, clusters, cost, cap)
    if not tables:
        return
    print("\n== weak scaling (each policy's best layout; dp = clusters // pp; efficiency = "
          "tokens/s per cluster vs the smallest) ==")
    head = f"  {'clusters':>8}"
    for pol in tables:
        lay = tables[pol][0].plan.layout
        head += f" | {pol} (pp={lay.pp} m={lay.num_micro_batches})".ljust(34)
    print(head)
    for i, n in enumerate(clusters):
        line = f"  {n:>8}"
        for rows in tables.values():
            if i < len(rows):
                r = rows[i]
                line += f" | {r.plan.tokens_per_s:>10.0f} tok/s  eff {100 * r.efficiency:5.1f}%"
                line += " " * 6
        print(line)


def _print_memory(cfg, cap, clusters) -> None:
    layers = cfg.model.layers
    pps = sorted({p for p in (1, 2, 4, 8, 16, 20, 32, 40, 64, 80, cfg.parallel.pp)
                  if p <= layers})
    print(f"\n== which pipeline depths fit {_gib(cap) if cap else 'no'} GiB at {clusters} clusters "
          "(dp = clusters // pp, ratrain sharding its optimizer state over dp; micro_batch 1, "
          "m >= pp; peak of the fullest stage, GiB) ==")
    print(f"  {'pp':>3} | {'policy':>13} | {'none':>7} {'selective':>9} {'full':>7} | "
          "fewest layers recomputed")
    for pol in ("baseline-1f1b", "ratrain"):
        for r in memory_table(cfg, pps, pol, cap, clusters=clusters):
            rec = "does not fit" if r.recomputed is None else f"{r.recomputed}/{layers}"
            print(f"  {r.pp:>3} | {pol:>13} | {_gib(r.peak_none):>7} {_gib(r.peak_selective):>9} "
                  f"{_gib(r.peak_full):>7} | {rec}")


if __name__ == "__main__":
    sys.exit(main())
