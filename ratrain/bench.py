"""Single-rank training throughput and memory accounting (issue 2's benchmark).

    python -m ratrain.bench                       # fp32, fp16, PyTorch eager, sgemm; 2 threads
    python -m ratrain.bench --precisions fp32,bf16 --blas openblas,mkl --no-torch  # BLAS A/B
    python -m ratrain.bench --memory              # ledger peak vs measured peak memory growth
    python -m ratrain.bench --profile             # where a step's time goes, kernel by kernel
    python -m ratrain.bench --rounds 7 --json out.json
    python -m ratrain.bench --set model.vocab_size=32000   # the model changed, for every contender

A step is a whole training step through the runtime's own path (`lifecycle.Executor` with
pp = dp = 1): forward + backward of every block, global-norm clipping, AdamW on fp32 masters
(and, in fp16, loss scaling and the fp16 views). PyTorch eager runs the same step with
transformers' LlamaForCausalLM, `clip_grad_norm_` and `torch.optim.AdamW` at the same thread
count. Model: vocab 256, hidden 512, 8 layers, 8 heads, 8 kv heads, ffn 1376, seq 256,
micro-batch 8 (2048 tokens per step); flops per token from `ModelConfig.flops_per_token`.

ratrain's contenders are its precisions (`--precisions`) on each BLAS of `--blas` (`run.blas`:
auto by default, one contender a precision, named `ratrain_fp32`; with several, each named
after its BLAS, `ratrain_fp32_mkl`); `blas` in the output says which library each ran and why.
The contenders run in interleaved rounds (one sgemm, then one step of each) so that all see the
same machine load; figures are medians over rounds and ratios are medians of per-round ratios.
ratrain runs in this process with its host allocator settings (`ratrain.shim.allocator`, as
`python -m ratrain.train` runs); PyTorch runs in a child process of its own with the default
allocator, as a PyTorch user runs it (`--torch-malloc tuned` gives it ratrain's settings too, for
comparison; it then gains about 5%).

`--memory` checks the DDR ledger against the process: numpy reports its data buffers to
`tracemalloc`, so the traced peak over a step (minus what was traced before the runtime's
state existed) is the process's measured peak memory growth, compared with the ledger's peak
for the same step. The resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from ratrain.config import load_config
from ratrain.exec.context import sgemm_rate
from ratrain.exec.profile import Profile
from ratrain.fileio import atomic_write
from ratrain.runtime.rank import build_rank
from ratrain.shim import allocator

BENCH = [
    "model.vocab_size=256", "model.hidden=512", "model.layers=8", "model.heads=8",
    "model.kv_heads=8", "model.ffn_hidden=1376", "model.seq_len=256",
    "parallel.micro_batch=8", "parallel.num_micro_batches=1", "optim.grad_clip=1.0",
    "optim.lr=1e-4", "optim.warmup_steps=0", "optim.lr_schedule=constant", "run.steps=1000",
]


def bench_config(precision: str, threads: int, extra=()):
    return load_config(None, [*BENCH, f"precision={precision}", f"run.threads={threads}", *extra])


def runtime_step(cfg):
    """(step function, executor) for one rank of `cfg`, on a fixed random batch."""
    ex = build_rank(cfg).executor
    m, p = cfg.model, cfg.parallel
    rng = np.random.default_rng(0)
    shape = (p.num_micro_batches, p.micro_batch, m.seq_len)
    batch = (rng.integers(0, m.vocab_size, shape), rng.integers(0, m.vocab_size, shape))
    count = [0]

    def step():
        res = ex.run_step(count[0], batch)
        count[0] += 1
        return res

    return step, ex


def torch_step(cfg):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m, p = cfg.model, cfg.parallel
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        max_position_embeddings=m.seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=False)).float().train()
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    B = p.micro_batch * p.num_micro_batches
    ids = torch.randint(0, m.vocab_size, (B, m.seq_len))
    targets = torch.randint(0, m.vocab_size, (B, m.seq_len))

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, m.vocab_size), targets.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        return loss

    return step


def torch_worker(threads: int, sets=()) -> int:
    """The child process of `torch_remote`: one step per line read, its time printed."""
    step = torch_step(bench_config("fp32", threads, sets))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t = time.perf_counter()
        step()
        print(f"{time.perf_counter() - t!r}", flush=True)
    return 0


def torch_remote(threads: int, malloc: str, sets=()):
    """A step function that runs one PyTorch eager step in a child process (its own
    allocator: `malloc` = `default` or `tuned`; `sets`: config overrides of the benchmark
    model) and returns the child's own step time."""
    code = ("import sys; from ratrain.bench import torch_worker; "
            + ("from ratrain.shim import allocator; allocator.tune(); " if malloc == "tuned" else "")
            + f"sys.exit(torch_worker({threads}, {list(sets)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline().strip()
    if first != "ready":
        proc.kill()
        raise ImportError(f"the PyTorch worker did not start (exit {proc.wait()}): {first!r}")

    def step():
        proc.stdin.write("step\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    step.close = lambda: (proc.stdin.close(), proc.wait())
    return step


def sgemm_step(threads: int, n: int = 2048):
    """A step function returning one sgemm rate (GFLOP/s) of (n x n) @ (n x n)."""
    rate = sgemm_rate(threads, n)
    return lambda: rate() / 1e9


def contenders(a) -> list[tuple[str, str, str]]:
    """(name, precision, run.blas) of ratrain's contenders, fp32 on the first BLAS first."""
    precs = [p for p in a.precisions.split(",") if p and not (a.no_fp16 and p == "fp16")]
    precs = ["fp32", *(p for p in precs if p != "fp32")]
    blases = [b for b in a.blas.split(",") if b]
    return [(f"ratrain_{p}" + (f"_{b}" if len(blases) > 1 else ""), p, b)
            for p in precs for b in blases]


def throughput(a) -> dict:
    cfg32 = bench_config("fp32", a.threads, a.sets)
    tokens = cfg32.parallel.global_batch * cfg32.model.seq_len
    flops = cfg32.model.flops_per_token() * tokens
    steps, blas = {}, {}
    for name, precision, lib in contenders(a):
        step, ex = runtime_step(bench_config(precision, a.threads, [*a.sets, f"run.blas={lib}"]))
        steps[name], blas[name] = step, ex.ctx.kernels.blas_label()
    base = next(iter(steps))  # fp32 on the first BLAS: the ratios' reference
    remote = {}
    if not a.no_torch:
        try:
            import torch  # noqa: F401  (present? the worker imports it again)

            remote["torch_eager"] = torch_remote(a.threads, a.torch_malloc, a.sets)
        except ImportError as e:
            print(f"# PyTorch eager skipped: {e}; pip install 'ratrain[bench]' installs it",
                  file=sys.stderr)
    steps.update(remote)
    sgemm = sgemm_step(a.threads)
    times = {k: [] for k in steps}
    rates = []
    try:
        for r in range(a.warmup + a.rounds):
            rate = sgemm()
            for name, step in steps.items():
                t = time.perf_counter()
                inner = step()
                took = inner if name in remote else time.perf_counter() - t
                if r >= a.warmup:
                    times[name].append(took)
            if r >= a.warmup:
                rates.append(rate)
    finally:
        for step in remote.values():
            step.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "threads": a.threads, "tokens_per_step": tokens, "flops_per_step": flops,
        "rounds": a.rounds, "sgemm_gflops": statistics.median(rates),
        "ratrain_malloc": "tuned" if allocator.tuned() else "default",
        "torch_malloc": a.torch_malloc, "sets": list(a.sets), "blas": blas,
    }
    for k, v in med.items():
        out[f"{k}_step_s"] = v
        out[f"{k}_tokens_per_s"] = tokens / v
        out[f"{k}_gflops"] = flops / v / 1e9
    n = len(rates)
    ratio = lambda x, y: statistics.median(times[x][i] / times[y][i] for i in range(n))  # noqa: E731
    out["fp32_gflops_over_sgemm"] = statistics.median(
        flops / times[base][i] / 1e9 / rates[i] for i in range(n))
    if "torch_eager" in times:
        out["fp32_speed_over_torch"] = ratio("torch_eager", base)
    first = {}  # each precision's contender on the first BLAS
    for name, precision, lib in contenders(a):
        if precision in first:  # another BLAS: its time over the first one's
            out[f"{precision}_{lib}_time_over_{a.blas.split(',')[0]}"] = ratio(name, first[precision])
            continue
        first[precision] = name
        if precision != "fp32":
            out[f"{precision}_time_over_fp32"] = ratio(name, base)
    return out


def proc_status_kib(field: str) -> int:
    """A KiB figure of /proc/self/status (`VmRSS`, `VmHWM`, ...); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_hwm() -> bool:
    """Reset the resident-set high-water mark (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory(a) -> dict:
    """Ledger peak over a step vs the traced (tracemalloc) peak of the same step."""
    import tracemalloc

    out = {}
    for precision in ("fp32", "fp16"):
        cfg = bench_config(precision, a.threads, [*a.sets, f"schedule.recompute={a.recompute}"])
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        step, ex = runtime_step(cfg)
        step()  # warm-up: the first step allocates what later steps reuse
        ex.ledger.reset_peak()
        ledger0 = ex.ledger.current
        traced0 = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.reset_peak()
        reset_hwm()
        rss0 = proc_status_kib("VmHWM") * 1024
        res = step()
        traced_peak = tracemalloc.get_traced_memory()[1] - base
        hwm = proc_status_kib("VmHWM") * 1024
        tracemalloc.stop()
        ledger_peak = res.local_peak_ddr_bytes
        out[precision] = {
            "ledger_peak_bytes": ledger_peak,
            "traced_peak_growth_bytes": traced_peak,
            "ledger_over_traced": ledger_peak / traced_peak,
            "ledger_growth_bytes": ledger_peak - ledger0,
            "traced_growth_bytes": traced_peak - traced0,
            "rss_hwm_growth_bytes": hwm - rss0,
        }
        del step, ex
    return out


def profile(a) -> dict:
    """Per-kernel CPU seconds of one step (`exec.profile`), per contender (precision and BLAS,
    as `throughput` names them, less `ratrain_`), against the sgemm bound: the model's flops at
    the measured sgemm rate of the same thread count."""
    rate = statistics.median(sgemm_step(a.threads)() for _ in range(3)) * 1e9  # flop/s
    out = {"threads": a.threads, "sgemm_gflops": round(rate / 1e9, 1)}
    for name, precision, lib in contenders(a):
        cfg = bench_config(precision, a.threads, [*a.sets, f"run.blas={lib}"])
        step, ex = runtime_step(cfg)
        for _ in range(max(1, a.warmup)):
            step()
        walls, profs = [], []
        for _ in range(a.rounds):
            with Profile() as prof:
                t = time.perf_counter()
                step()
                walls.append(time.perf_counter() - t)
            profs.append(prof)
        best = profs[walls.index(statistics.median_low(walls))]
        flops = cfg.model.flops_per_token() * cfg.parallel.global_batch * cfg.model.seq_len
        wall = statistics.median_low(walls)
        rows = best.rows(rate / a.threads)
        accounted = sum(r["seconds"] for r in rows)
        out[name.removeprefix("ratrain_")] = {
            "blas": ex.ctx.kernels.blas_label(),
            "step_s": round(wall, 4), "sgemm_bound_s": round(flops / rate, 4),
            "of_sgemm": round(flops / wall / rate, 3),
            "compute_thread_s": round(wall * a.threads, 4),
            "unaccounted_s": round(wall * a.threads - accounted, 4), "kernels": rows}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2,
                    help="compute threads of ratrain and of PyTorch (default 2)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="timed steps per contender, interleaved (default 5; medians reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--no-torch", action="store_true",
                    help="leave PyTorch out (it is skipped anyway when not installed: "
                    "pip install 'ratrain[bench]')")
    ap.add_argument("--no-fp16", action="store_true", help="leave ratrain's fp16 step out")
    ap.add_argument("--precisions", default="fp32,fp16", metavar="LIST",
                    help="ratrain's precisions, comma-separated (default fp32,fp16; fp32 always)")
    ap.add_argument("--blas", default="auto", metavar="LIST",
                    help="run.blas of ratrain's contenders, comma-separated (auto, openblas, "
                    "mkl; default auto): each precision on each, interleaved")
    ap.add_argument("--memory", action="store_true", help="the memory-accounting check only")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel time of a step against the sgemm bound (median of --rounds)")
    ap.add_argument("--recompute", default="none", help="schedule.recompute for --memory")
    ap.add_argument("--torch-malloc", choices=("default", "tuned"), default="default",
                    help="the PyTorch process's allocator (default: as PyTorch users run it)")
    ap.add_argument("--json", default="", metavar="FILE", help="also write the results to FILE")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="a config override of the benchmark model, for every contender "
                         "(repeatable; e.g. model.vocab_size=32000)")
    a = ap.parse_args(argv)
    allocator.tune()
    out = memory(a) if a.memory else profile(a) if a.profile else throughput(a)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        atomic_write(a.json, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
