"""Issues 19 and 29's GPU figures: speed and memory against PyTorch, agreement with the CPU,
and cuDNN's fused attention.

    python benchmarks/gpu.py speed  [--rounds 5] [--steps 3]   # the 124M LLaMA, whole steps
    python benchmarks/gpu.py agree  [--cpu-steps 20] [--half-steps 200]
    python benchmarks/gpu.py attention [--rounds 5] [--iters 30]   # fused attention, 124M shapes
    python benchmarks/gpu.py profile [--precisions bf16,fp32]   # where ratrain's step goes
    python benchmarks/gpu.py gemm            # the 124M GEMMs: cupy, ratrain, torch
    python benchmarks/gpu.py ... --device standin --smoke      # the plumbing, on a CPU (a test)

`speed`: a 124M LLaMA (hidden 768, 12 layers, 12 heads, 12 kv heads, ffn 2048, vocab 32000,
seq 1024, micro-batch 8), whole training steps (forward, backward, clipping, AdamW) of six
contenders in interleaved rounds on the same card, each step ended by a device synchronize:
ratrain bf16, fp16 and fp32 (`run.device: gpu`, pp = dp = 1, the kernel table `auto` gives:
cuDNN's fused attention at 16 bits) and PyTorch + transformers AMP bf16 + SDPA, AMP fp16 +
SDPA (GradScaler) and fp32 eager; and three trials of ratrain bf16: `run.devkernels: off` (every
op on cupy's compositions: what the numba-cuda kernels bring, `devkernels_gain_bf16`), RMSNorm
and RoPE alone on cupy (`run.reference_ops: [rmsnorm, rope]`, the two the kernels' own benchmark
finds slower: `cupy_norm_rope_gain_bf16`) and the head's logits in the host's 16 MiB chunks
(`run.head_chunk_mib: 16`) instead of a device's 256 MiB (`head_chunk_gain_bf16`: the device's
chunk over the host's).
Prints tokens/s (median over rounds), the ratios the issue targets (ratrain bf16 / AMP bf16
and fp16 / AMP fp16 >= 0.8, fp32 / PyTorch fp32 >= 1.0), MFU
(model flops per token x tokens/s) against the card's dense peak for the contender's GEMMs
(`DENSE_PEAK`: 16-bit tensor cores, or fp32), each ratrain contender's kernel table, and
memory, each contender built and warmed up alone: ratrain's ledger peak against the bytes
cupy's pool came to hold (its peak: the pool keeps what it once needed; target within 10%),
and that pool against PyTorch AMP's `max_memory_allocated` at the same precision (target: no
more).

`agree`: jobs/tiny.yaml through the trainer command, four runs at once on one cosine schedule
of `--half-steps` steps: fp32 on the CPU for `--cpu-steps` steps against the device's fp32 run
(target: every loss within 1e-5), and fp16 and bf16 against fp32 on the device over
`--half-steps` steps (target: within 1%).

`attention`: causal attention forward + backward at the 124M model's shapes (B 8, H 12, T 1024,
D 64), fp16 and bf16, in interleaved rounds (medians of `--iters` calls per round): cuDNN's
fused SDPA (`exec.cudnn_sdpa`) with the deterministic backward's two workspace settings (`dP`:
no limit, its B H T^2 2-byte workspace; `ordered`: limit 0, the linear-workspace ordered dQ),
PyTorch's `F.scaled_dot_product_attention` (its default backend, and flash and cuDNN forced
where they run) and the tiled path in fp32 (tile 1024, the GPU path before this; its inputs
fp32 copies). Prints ms, TFLOP/s (causal: 3.5 x 2 B H T^2 D flops), fused / PyTorch default
(target >= 0.9x, per setting), the relative L2 error of o, lse, dq, dk, dv against the tiled
path in fp32 (target 1e-3 fp16 / 2e-3 bf16) beside two yardsticks: the error of the reference
merely rounded to the dtype (the floor of any kernel returning that dtype) and PyTorch's SDPA's
own, whether the backward repeats bitwise, and each setting's workspace bytes against
`workspace_bound`. On the stand-in (`--smoke`) it builds and validates
the graphs only: nothing runs without a card.

`profile`: where ratrain's step of the 124M model goes, per precision (`--precisions`): the
step's time, per category with the card synchronized around each call (`exec.profile`), the
host's Python by own time (cProfile), and the card's kernels by device time (PyTorch's
profiler, which sees every library's kernels). `gemm`: the model's GEMM shapes through cupy,
through ratrain's `gemm.matmul` as the layers call it, and through PyTorch, TFLOP/s.

Each prints one JSON object last (benchmarks/record.py takes it). Refuses in one line, exit 2,
when `--device gpu` has no cupy or no card. `--smoke` shrinks everything to seconds and lets
`--device standin` run on a CPU, PyTorch then on the CPU too (tests/test_gpu_bench.py): it
checks the script, not the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MODEL_124M = ["model.vocab_size=32000", "model.hidden=768", "model.layers=12", "model.heads=12",
              "model.kv_heads=12", "model.ffn_hidden=2048", "model.seq_len=1024",
              "parallel.micro_batch=8", "parallel.num_micro_batches=1"]
MODEL_SMOKE = ["model.vocab_size=64", "model.hidden=64", "model.layers=2", "model.heads=4",
               "model.kv_heads=4", "model.ffn_hidden=64", "model.seq_len=16",
               "parallel.micro_batch=2", "parallel.num_micro_batches=1"]
# Dense peaks (no 2:4 sparsity), flop/s, by the card's name, most specific first: (16-bit
# tensor cores, fp16 and bf16 alike; fp32 without tensor cores, what cupy's and PyTorch's
# default fp32 GEMMs use: TF32 is off in both). NVIDIA's datasheets give the tensor figures with
# sparsity, twice these: H100 SXM 1,979 / FP32 67 TFLOPS, H100 PCIe 1,513 / 51, H100 NVL 1,671 /
# 60 (NVIDIA H100 Tensor Core GPU datasheet); H200 SXM 1,979 / 67, H200 NVL 1,671 / 60 (NVIDIA
# H200 datasheet); A100 SXM 624 / 19.5 (NVIDIA A100 datasheet).
DENSE_PEAK = [("H100 PCIe", 756.5e12, 51.2e12), ("H100 NVL", 835.5e12, 60.0e12),
              ("H200 NVL", 835.5e12, 60.0e12), ("H100", 989.4e12, 66.9e12),
              ("H200", 989.4e12, 66.9e12), ("A100", 312e12, 19.5e12)]
PRECISIONS = ("bf16", "fp16", "fp32")
TORCH = {"bf16": "torch amp bf16 sdpa", "fp16": "torch amp fp16 sdpa", "fp32": "torch fp32 eager"}
SPEED_TARGET = {"bf16": 0.8, "fp16": 0.8, "fp32": 1.0}  # ratrain / PyTorch tokens/s
NO_DEVKERNELS = "ratrain bf16 devkernels off"  # speed's trials beside the six contenders
SMALL_HEAD_CHUNK = "ratrain bf16 head chunk 16 MiB"
CUPY_NORM_ROPE = "ratrain bf16 rmsnorm, rope on cupy"


def card_peak(name: str, precision: str) -> float | None:
    """The card's dense peak for `precision`'s GEMMs (None: a card not in the table)."""
    return next((p16 if precision != "fp32" else p32 for key, p16, p32 in DENSE_PEAK
                 if key in name), None)


def config(precision: str, device: str, smoke: bool, attention: str = "auto", sets=()):
    from ratrain.config import load_config

    return load_config(None, [*(MODEL_SMOKE if smoke else MODEL_124M), f"precision={precision}",
                              f"run.device={device}", "optim.grad_clip=1.0", "run.threads=0",
                              f"run.attention={attention}", *sets])


def ratrain_contender(precision: str, dev, smoke: bool, attention: str = "auto", sets=()):
    """(step, peak, cfg, kernels) for ratrain at `precision` on `dev` (`sets`: more config
    keys): step() runs one whole training step and waits for the device; peak() the ledger's
    peak bytes so far."""
    from ratrain.device import synchronize
    from ratrain.runtime.rank import build_rank

    cfg = config(precision, dev.kind, smoke, attention, sets)
    rank = build_rank(cfg, None, cap=None, device=dev)
    m, p = cfg.model, cfg.parallel
    rng = np.random.default_rng(0)
    shape = (p.num_micro_batches, p.micro_batch, m.seq_len)
    batch = (rng.integers(0, m.vocab_size, shape), rng.integers(0, m.vocab_size, shape))
    count, peak = [0], [0]

    def step():
        res = rank.executor.run_step(count[0], batch)
        synchronize(dev.xp)
        count[0] += 1
        peak[0] = max(peak[0], res.local_peak_ddr_bytes)

    return step, lambda: peak[0], cfg, rank.ctx.kernels.describe()


def torch_contender(kind: str, cfg, on: str):
    """PyTorch + transformers `kind` ('fp32': eager attention, fp32; 'bf16', 'fp16': autocast
    with SDPA, fp16 with a GradScaler) on torch device `on`; step() runs one training step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m, p, o = cfg.model, cfg.parallel, cfg.optim
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        max_position_embeddings=m.seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=False, attn_implementation="eager" if kind == "fp32" else "sdpa",
    )).float().to(on).train()
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    B = p.micro_batch * p.num_micro_batches
    ids = torch.randint(0, m.vocab_size, (B, m.seq_len), device=on)
    targets = torch.randint(0, m.vocab_size, (B, m.seq_len), device=on)
    amp = kind != "fp32"
    half = torch.float16 if kind == "fp16" and on == "cuda" else torch.bfloat16  # CPU: bf16
    scaler = torch.amp.GradScaler(on, enabled=kind == "fp16" and on == "cuda")

    def step():
        with torch.autocast(on, dtype=half, enabled=amp):
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.view(-1, m.vocab_size).float(),
                                                     targets.view(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        scaler.step(opt)
        scaler.update()
        if on == "cuda":
            torch.cuda.synchronize()

    return step


def _memory(dev, on):
    """(before, after): each side of a contender's construction and warm-up, the bytes cupy's
    pool holds beyond what was in use before it (the pool keeps what it once needed: its peak)
    and PyTorch's `max_memory_allocated` beyond what was allocated before it."""
    if dev.kind != "gpu":
        return lambda: None, lambda: None
    import torch

    pool = dev.xp.get_default_memory_pool()
    base = {}

    def before():
        pool.free_all_blocks()
        torch.cuda.reset_peak_memory_stats()
        base.update(pool=pool.used_bytes(), torch=torch.cuda.memory_allocated())

    def after():
        return {"cupy_pool": pool.total_bytes() - base["pool"],
                "torch_max_allocated": torch.cuda.max_memory_allocated() - base["torch"]}

    return before, after


def _warm(name, make, warmup, errors):
    """make() -> (step, ...) run `warmup` times; None (the error kept) when it fails: one
    contender's failure costs its own figures only."""
    try:
        made = make()
        step = made[0] if isinstance(made, tuple) else made
        for _ in range(warmup):  # compile kernels, build cuDNN graphs, fill pools
            step()
        return made
    except Exception as e:  # noqa: BLE001 - reported in the record, the others still run
        errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"{name}: failed ({errors[name]})", flush=True)
        return None


def speed(a, dev) -> dict:
    on = "cuda" if dev.kind == "gpu" else "cpu"
    steps, memory, kernels, errors = {}, {}, {}, {}
    cfg = {p: config(p, dev.kind, a.smoke) for p in PRECISIONS}
    before, after = _memory(dev, on)
    for prec in PRECISIONS:  # built and warmed one at a time: each one's memory alone
        name = f"ratrain {prec}"
        before()
        made = _warm(name, lambda p=prec: ratrain_contender(p, dev, a.smoke), a.warmup, errors)
        if made is None and prec != "fp32":  # the 16-bit GEMMs still timed, attention tiled
            before()
            made = _warm(f"{name} (tiled)", lambda p=prec: ratrain_contender(
                p, dev, a.smoke, "tiled-1024"), a.warmup, errors)
        if made is not None:
            steps[name], peak, _, kernels[prec] = made
            memory[name] = {"ledger_peak": peak(), **(after() or {})}
        before()
        made = _warm(TORCH[prec], lambda p=prec: torch_contender(p, cfg[p], on), a.warmup,
                     errors)
        if made is not None:
            steps[TORCH[prec]] = made
            memory[TORCH[prec]] = after()
    # trials at bf16, timed with the rest: every op on cupy's compositions (what the device
    # kernels bring), RMSNorm and RoPE alone on cupy, and the head's logits in the host's 16 MiB
    # chunks, the device's before (63 chunks each way a step: 131 rows in the forward, 512
    # columns in the backward; 256 MiB: 4 each way)
    for name, trial in ((NO_DEVKERNELS, dict(sets=("run.devkernels=off",))),
                        (CUPY_NORM_ROPE, dict(sets=("run.reference_ops=[rmsnorm,rope]",))),
                        (SMALL_HEAD_CHUNK, dict(sets=("run.head_chunk_mib=16",)))):
        made = _warm(name, lambda t=trial: ratrain_contender("bf16", dev, a.smoke, **t),
                     a.warmup, errors)
        if made is not None:
            steps[name] = made[0]
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a.rounds):  # interleaved: every contender sees the same card state
        for k, fn in steps.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                fn()
            times[k].append((time.perf_counter() - t0) / a.steps)
    m, p = cfg["fp32"].model, cfg["fp32"].parallel
    tokens = p.micro_batch * p.num_micro_batches * m.seq_len
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    precision_of = {**{f"ratrain {p}": p for p in PRECISIONS}, **{TORCH[p]: p for p in PRECISIONS},
                    NO_DEVKERNELS: "bf16", CUPY_NORM_ROPE: "bf16", SMALL_HEAD_CHUNK: "bf16"}
    peak = {k: card_peak(dev.name, precision_of[k]) for k in tps}
    mfu = {k: m.flops_per_token() * t / peak[k] if peak[k] else None for k, t in tps.items()}
    out = {"case": "gpu-speed", "card": dev.name, "tokens_per_step": tokens,
           "tokens_per_s": tps, "mfu": mfu, "kernels": kernels, "memory": memory,
           "vs_torch": {prec: tps[f"ratrain {prec}"] / tps[TORCH[prec]] for prec in PRECISIONS
                        if f"ratrain {prec}" in tps and TORCH[prec] in tps},
           "target_vs_torch": SPEED_TARGET, "rounds": a.rounds, "steps_per_round": a.steps,
           "devkernels_gain_bf16": _over(tps, "ratrain bf16", NO_DEVKERNELS),
           "cupy_norm_rope_gain_bf16": _over(tps, CUPY_NORM_ROPE, "ratrain bf16"),
           "head_chunk_gain_bf16": _over(tps, "ratrain bf16", SMALL_HEAD_CHUNK),
           "errors": errors}
    for prec in ("bf16", "fp16"):
        mem, amp = memory.get(f"ratrain {prec}"), memory.get(TORCH[prec])
        if mem and amp:  # ledger against cupy's pool (within 10%), pool against PyTorch's
            out[f"ledger_vs_pool_{prec}"] = mem["ledger_peak"] / mem["cupy_pool"]
            out[f"pool_vs_torch_amp_{prec}"] = mem["cupy_pool"] / amp["torch_max_allocated"]
    for k, v in tps.items():
        print(f"{k:>22}: {v:12,.0f} tokens/s" + (f"  MFU {mfu[k]:.3f}" if mfu[k] else ""),
              flush=True)
    print(f"ratrain / PyTorch: {out['vs_torch']} (targets {SPEED_TARGET}); kernels: {kernels}",
          flush=True)
    return out


def _train(sets, run_dir) -> subprocess.Popen:
    """The trainer on jobs/tiny.yaml with `sets`, started (its metrics in run_dir)."""
    cmd = [sys.executable, "-m", "ratrain.train", "--config", "tiny", "--set", f"run.dir={run_dir}",
           "--set", "checkpoint.interval=0", "--set", "data.eval_interval=0",
           "--set", "checkpoint.resume=never"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def _losses(proc, run_dir) -> list[float] | None:
    """The run's losses; None when it failed (saying so)."""
    if proc.wait() != 0:
        print(f"the run in {run_dir} failed (exit {proc.returncode})", flush=True)
        return None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def _over(tps: dict, a: str, b: str) -> float | None:
    """tokens/s of contender `a` over `b`'s; None when either failed."""
    return tps[a] / tps[b] if a in tps and b in tps else None


def _max_rel(a: list[float] | None, b: list[float] | None) -> float | None:
    if a is None or b is None:
        return None
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _window_rel(a: list[float] | None, b: list[float] | None, w: int = 20) -> dict | None:
    """The curves' relative difference over windows of `w` steps (the mean loss of each):
    the largest over the run and the last window's; None when a run failed."""
    if a is None or b is None or len(a) != len(b) or len(a) < w:
        return None
    n = len(a) // w * w
    ma, mb = (np.asarray(x[:n], np.float64).reshape(-1, w).mean(axis=1) for x in (a, b))
    rel = np.abs(ma - mb) / np.abs(mb)
    return {"max": float(rel.max()), "last": float(rel[-1]), "window": w}


TINY_SMOKE = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2",
              "model.ffn_hidden=64", "model.seq_len=32"]


def agree(a, dev) -> dict:
    """The runs at once (they share the card, each its own process): fp32 on the CPU for
    `cpu_steps` steps, fp32, fp16 and bf16 on the device for `half_steps`; one cosine schedule
    of `half_steps` for all, so the CPU's steps are the device fp32 run's first ones."""
    n, nh = a.cpu_steps, a.half_steps
    small = [*(TINY_SMOKE if a.smoke else []), f"optim.decay_steps={max(nh - 10, 1)}"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"cpu": _train([*small, f"run.steps={n}", "run.device=cpu"], f"{tmp}/cpu")}
        for prec in PRECISIONS:
            runs[prec] = _train([*small, f"run.steps={nh}", f"run.device={dev.kind}",
                                 f"precision={prec}"], f"{tmp}/{prec}")
        loss = {k: _losses(proc, f"{tmp}/{k}") for k, proc in runs.items()}
    fp32 = loss["fp32"]
    out = {"case": "gpu-agree", "card": dev.name, "cpu_vs_device_fp32_steps": n,
           "cpu_vs_device_fp32_max_rel": _max_rel(fp32 and fp32[:n], loss["cpu"]),
           "half_vs_fp32_steps": nh, "errors": {k: "failed" for k, v in loss.items() if v is None}}
    for prec in ("fp16", "bf16"):
        out[f"{prec}_vs_fp32_max_rel"] = _max_rel(loss[prec], fp32)
        # the curve rather than the step: the mean loss over 20-step windows (a step's loss
        # moves by percents between two fp32 frameworks within 200 steps: docs/history/gpu.md)
        out[f"{prec}_vs_fp32_window_rel"] = _window_rel(loss[prec], fp32, min(20, nh))
    print(f"fp32 cpu vs {dev.kind}, {n} steps: max rel {out['cpu_vs_device_fp32_max_rel']} "
          f"(target 1e-5); vs fp32 on {dev.kind} over {nh} steps, max rel: fp16 "
          f"{out['fp16_vs_fp32_max_rel']}, bf16 {out['bf16_vs_fp32_max_rel']} (target 1e-2); "
          f"over windows of 20 steps: fp16 {out['fp16_vs_fp32_window_rel']}, bf16 "
          f"{out['bf16_vs_fp32_window_rel']}", flush=True)
    return out


ATTN_124M = (8, 12, 12, 1024, 64)  # B, H, KV, T, D
ATTN_SMOKE = (2, 4, 2, 32, 16)
ATTN_TOL = {"fp16": 1e-3, "bf16": 2e-3}
FUSED = {"dP": None, "ordered": 0}  # the deterministic backward's dP workspace limit


def attention(a, dev) -> dict:
    from ratrain.exec import cudnn_sdpa as cs

    B, H, KV, T, D = ATTN_SMOKE if a.smoke else ATTN_124M
    out = {"case": "gpu-attention", "card": dev.name, "shape": f"B{B} H{H} KV{KV} T{T} D{D}",
           "frontend": cs.frontend().__version__}
    if dev.kind != "gpu":  # the rehearsal: the graphs are described and validated, none runs
        specs = [cs.SdpaSpec("forward", B, H, KV, T, D, dt) for dt in cs.DTYPES]
        specs += [cs.SdpaSpec("backward", B, H, KV, T, D, dt, dp_workspace_limit=limit)
                  for dt in cs.DTYPES for limit in FUSED.values()]
        for spec in specs:
            cs.describe(spec)
        print(f"{len(specs)} cuDNN SDPA graphs built and validated; nothing executed (no GPU)")
        return {**out, "executed": False, "graphs_validated": len(specs)}
    import torch

    fused = {name: cs.CudnnSdpa(dp_workspace_limit=limit) for name, limit in FUSED.items()}
    out.update(executed=True, cudnn=fused["dP"].version, torch=torch.__version__,
               by_precision=[_attention_case(a, prec, (B, H, KV, T, D), fused, torch)
                             for prec in ("fp16", "bf16")])
    return out


def _attention_case(a, prec, shape, fused, torch) -> dict:
    """One precision of `attention`: timings, errors, repeatability, workspace."""
    import cupy as cp

    x = _attention_inputs(prec, shape, torch)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fused_step(f):
        def step():
            o, lse = f.forward(x.q, x.k, x.v, out=x.o)
            f.backward(x.q, x.k, x.v, o, x.do, lse)
        return step

    def torch_step(backend):
        def step():
            x.tq.grad = x.tk.grad = x.tv.grad = None
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                sdpa(x.tq, x.tk, x.tv, is_causal=True, enable_gqa=x.gqa).backward(x.tdo)
        return step

    steps = {f"cudnn {n}": fused_step(f) for n, f in fused.items()}
    steps["torch sdpa"] = torch_step(None)
    for name, backend in (("torch flash", SDPBackend.FLASH_ATTENTION),
                          ("torch cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:  # a backend this torch or card lacks refuses its first call
            torch_step(backend)()
            steps[name] = torch_step(backend)
        except RuntimeError as e:
            print(f"{name}: not run ({str(e).splitlines()[0][:120]})", flush=True)
    q32, k32, v32, do32 = (y.astype(np.float32) for y in (x.q, x.k, x.v, x.do))
    steps["tiled-1024 fp32"] = lambda: x.tiled_fp32(q32, k32, v32, do32, cp, block=1024)
    times = _interleaved(steps, a, cp, torch)
    B, H, KV, T, D = shape
    flops = 3.5 * 2 * B * H * T * T * D  # causal: half of 4 B H T^2 D forward, backward 2.5x
    ms = {n: 1e3 * t for n, t in times.items()}
    res = {"precision": prec, "ms": ms, "tflops": {n: flops / t / 1e12 for n, t in times.items()},
           "vs_torch_sdpa": {n: times["torch sdpa"] / times[f"cudnn {n}"] for n in fused}}
    res.update(_attention_accuracy(x, fused, sdpa, cp))
    res["within_target"] = max(res["rel_err"].values()) < ATTN_TOL[prec]
    for n, t in ms.items():
        print(f"{prec} {n:>16}: {t:8.3f} ms  {res['tflops'][n]:6.1f} TFLOP/s", flush=True)
    print(f"{prec} fused / torch sdpa: {res['vs_torch_sdpa']} (target >= 0.9); rel err vs tiled "
          f"fp32: {res['rel_err']} (target {ATTN_TOL[prec]}; rounding alone "
          f"{res['rel_err_floor']}, torch sdpa {res['torch_rel_err']}); repeats bitwise "
          f"{res['repeats_bitwise']}; workspace {res['workspace_bytes']} bytes", flush=True)
    return res


def _attention_inputs(prec, shape, torch):
    """The same operands for every contender: q, k, v, do (the layer's token-major view) and an
    output view o in `prec` on cupy; tq, tk, tv (leaves) and tdo on torch; the reference."""
    import cupy as cp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import _attention_ref

    B, H, KV, T, D = shape
    if prec == "bf16":
        import ml_dtypes  # cupy's bfloat16

        half, tdt = np.dtype(ml_dtypes.bfloat16), torch.bfloat16
    else:
        half, tdt = np.dtype(np.float16), torch.float16
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s, dtype=np.float32)
            for s in ((B, H, T, D), (B, KV, T, D), (B, KV, T, D), (B, T, H, D))]
    q, k, v, do_tm = (cp.asarray(h).astype(half) for h in host)
    tq, tk, tv = (torch.tensor(h, device="cuda", dtype=tdt, requires_grad=True) for h in host[:3])
    return argparse.Namespace(
        half=half, gqa=KV != H, q=q, k=k, v=v, do=do_tm.transpose(0, 2, 1, 3),
        o=cp.empty((B, T, H, D), half).transpose(0, 2, 1, 3), tq=tq, tk=tk, tv=tv,
        tdo=torch.tensor(host[3], device="cuda", dtype=tdt).transpose(1, 2),
        tiled_fp32=_attention_ref.tiled_fp32, rel_err=_attention_ref.rel_err)


def _attention_accuracy(x, fused, sdpa, cp) -> dict:
    """Errors against the tiled path in fp32 (the fused dP setting's, the rounding floor's,
    PyTorch's), whether each setting's backward repeats bitwise, its workspace."""
    from ratrain.exec import cudnn_sdpa as cs

    names = ("o", "lse", "dq", "dk", "dv")
    ref = dict(zip(names, x.tiled_fp32(x.q, x.k, x.v, x.do, cp)))
    o, lse = fused["dP"].forward(x.q, x.k, x.v, out=x.o)
    got = dict(zip(names, (o, lse, *fused["dP"].backward(x.q, x.k, x.v, o, x.do, lse))))
    x.tq.grad = x.tk.grad = x.tv.grad = None
    to = sdpa(x.tq, x.tk, x.tv, is_causal=True, enable_gqa=x.gqa)
    to.backward(x.tdo)
    torch_got = dict(zip(("o", "dq", "dk", "dv"), (to, x.tq.grad, x.tk.grad, x.tv.grad)))
    res = {"rel_err": {n: x.rel_err(got[n], ref[n], cp) for n in names},
           "rel_err_floor": {n: x.rel_err(ref[n].astype(x.half), ref[n], cp) for n in torch_got},
           "torch_rel_err": {n: x.rel_err(cp.from_dlpack(t.detach().float().contiguous()),
                                          ref[n], cp) for n, t in torch_got.items()},
           "repeats_bitwise": {}, "workspace_bytes": {}, "workspace_bound": {}, "engine": {}}
    for n, f in fused.items():
        o, lse = f.forward(x.q, x.k, x.v, out=x.o)
        first = [y.copy() for y in f.backward(x.q, x.k, x.v, o, x.do, lse)]
        again = f.backward(x.q, x.k, x.v, o, x.do, lse)
        res["repeats_bitwise"][n] = all(bool(cp.array_equal(y.view(cp.uint16), z.view(cp.uint16)))
                                        for y, z in zip(first, again))
        spec = next(s for s in f.graphs if s.kind == "backward" and s.dtype == x.half.name)
        res["workspace_bytes"][n] = f.graphs[spec].workspace_nbytes
        res["workspace_bound"][n] = cs.workspace_bound(spec, f.version)
        res["engine"][n] = f.graphs[spec].engine
    return res


def _interleaved(steps, a, cp, torch) -> dict:
    """Median seconds per call of each of `steps`, in `a.rounds` interleaved rounds of
    `a.iters` calls (every other round in reverse order), after `a.warmup` calls each; the
    card synchronized around each batch (`torch`: None when no PyTorch step runs on the card).
    On an H200 a fused attention call took about 0.3 ms and batches of 10 calls moved 10-20%
    with their place in the round: hence 30 calls a batch and the alternating order."""
    from ratrain.device import synchronize

    def sync():
        synchronize(cp)
        if torch is not None:
            torch.cuda.synchronize()

    for fn in steps.values():
        for _ in range(a.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(a.rounds):  # every other round in reverse: no contender always goes first
        for k, fn in (steps.items() if r % 2 == 0 else reversed(steps.items())):
            sync()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                fn()
            sync()
            times[k].append((time.perf_counter() - t0) / a.iters)
    return {k: statistics.median(v) for k, v in times.items()}


def profile(a, dev) -> dict:
    """Where a ratrain step of the 124M model goes on the card, per precision: the step's wall
    time as `speed` runs it; the same step with the device synchronized around every timed
    call (`exec.profile.Profile(sync=)`: each category's kernels, launch gaps included); and
    the host's Python functions by own time (cProfile, no synchronizing), the 25 costliest."""
    import cProfile
    import io
    import pstats

    from ratrain.device import synchronize
    from ratrain.exec.profile import Profile

    out = {"case": "gpu-profile", "card": dev.name, "by_precision": {}}
    for prec in a.precisions.split(","):
        step, _, _, kernels = ratrain_contender(prec, dev, a.smoke)
        for _ in range(a.warmup):
            step()
        wall = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            wall.append(time.perf_counter() - t0)
        with Profile(sync=lambda: synchronize(dev.xp)) as prof:
            t0 = time.perf_counter()
            step()
            synced = time.perf_counter() - t0
        pr = cProfile.Profile()
        pr.enable()
        t0 = time.perf_counter()
        step()
        traced = time.perf_counter() - t0
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
        rows = prof.rows()
        res = {"kernels": kernels, "step_s": statistics.median(wall), "synced_step_s": synced,
               "cprofile_step_s": traced, "categories": rows, "device_kernels": _kernel_table(
                   step, dev, a.kernel_rows)}
        out["by_precision"][prec] = res
        print(f"== {prec} ({kernels}): step {res['step_s'] * 1e3:.1f} ms; synchronized around "
              f"each call {synced * 1e3:.1f} ms; under cProfile {traced * 1e3:.1f} ms", flush=True)
        for r in rows[:20]:
            print(f"   {r['category']:28} {r['seconds'] * 1e3:9.2f} ms {r['calls']:7d} calls",
                  flush=True)
        print("\n".join(text.getvalue().splitlines()[:45]), flush=True)
        kt = res["device_kernels"]
        if kt and "error" in kt:
            print(f"   the kernel table failed: {kt['error']}", flush=True)
        elif kt:
            print(f"   {kt['what']}: {kt['total_ms']:.1f} ms in {kt['count']} launches "
                  f"over a {kt['step_ms']:.1f} ms step", flush=True)
            for r in kt["rows"]:
                print(f"   {r['ms']:9.3f} ms {r['count']:6d} x  {r['name'][:100]}", flush=True)
    return out


def _kernel_table(step, dev, rows: int) -> dict | None:
    """One step under PyTorch's profiler (CUPTI sees every kernel of the process: cupy's,
    numba-cuda's, cuBLAS's, cuDNN's): the `rows` kernels of most device time, their launches,
    and the device time of all against the step's wall time (the card's busy fraction). None
    off a card (the profiler's host side records PyTorch's own ops only: nothing of a step) or
    without torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile as torch_profile
    except ImportError:
        return None
    if dev.kind != "gpu" or not torch.cuda.is_available():
        return None
    try:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
        averages = prof.key_averages()
    except Exception as e:  # noqa: BLE001 - CUPTI refused, say: the step's other figures stand
        return {"error": f"{type(e).__name__}: {e}"}

    def own(e):  # microseconds of device time of the event itself
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    events = sorted((e for e in averages if own(e) > 0), key=own, reverse=True)
    return {"what": "device kernels", "step_ms": wall * 1e3,
            "total_ms": sum(map(own, events)) / 1e3, "count": sum(e.count for e in events),
            "rows": [{"name": e.key, "ms": own(e) / 1e3, "count": e.count}
                     for e in events[:rows]]}


GEMM_SHAPES = {  # the 124M model's GEMMs at micro-batch 8 x 1024 tokens: (M, K, N); the head's
    # in 16 MiB chunks: the forward's 131 rows, the backward's 512 columns (logits, weight
    # gradient rows, dxn's term)
    "qkv": (8192, 768, 2304), "attn out": (8192, 768, 768), "gate|up": (8192, 768, 4096),
    "down": (8192, 2048, 768), "head": (8192, 768, 32000), "head chunk": (131, 768, 32000),
    "head cols": (8192, 768, 512), "head dw": (512, 8192, 768), "head dx": (8192, 512, 768)}
GEMM_SMOKE = {"qkv": (64, 32, 96), "head chunk": (3, 32, 64)}


def gemm(a, dev) -> dict:
    """The 124M model's GEMM shapes, interleaved, TFLOP/s: cupy's matmul on 16-bit (or fp32)
    operands; ratrain's `gemm.matmul` on an fp32 activation and a 16-bit weight (`half=`: a
    cast before, the GEMM into fp32 by cuBLAS's GemmEx, `exec.devgemm`), and on 16-bit
    operands (`ratrain16`: GemmEx alone, the 16-bit layout's GEMM); torch.matmul on the same
    16-bit operands; per shape and precision. Says whether the GEMMs or the casts around them
    hold ratrain's steps back, and how near the card's peak the layout's GEMMs run."""
    from ratrain.exec import gemm as rgemm
    from ratrain.exec.kernels import DTYPES

    cp = dev.xp
    try:
        import torch
    except ImportError:
        torch = None
    on = "cuda" if dev.kind == "gpu" else "cpu"
    shapes = GEMM_SMOKE if a.smoke else GEMM_SHAPES
    rng = np.random.default_rng(0)
    out = {"case": "gpu-gemm", "card": dev.name, "by_shape": []}
    for prec in PRECISIONS:
        dt = DTYPES[prec]
        half = None if prec == "fp32" else dt
        for name, (M, K, N) in shapes.items():
            x32 = cp.asarray(rng.standard_normal((M, K), np.float32))
            w = cp.asarray(rng.standard_normal((K, N), np.float32).astype(dt))
            x = x32.astype(dt)
            steps = {"cupy": lambda x=x, w=w: cp.matmul(x, w),
                     "ratrain": lambda x32=x32, w=w, h=half: rgemm.matmul(x32, w, xp=cp, half=h)}
            if half is not None:
                steps["ratrain16"] = lambda x=x, w=w, h=half: rgemm.matmul(x, w, xp=cp, half=h)
            if torch is not None and on == "cuda":
                tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[prec]
                tx = torch.randn(M, K, device=on, dtype=tdt)
                tw = torch.randn(K, N, device=on, dtype=tdt)
                steps["torch"] = lambda tx=tx, tw=tw: torch.matmul(tx, tw)
            ms = _interleaved(steps, a, cp, torch if on == "cuda" else None)
            row = {"precision": prec, "case": name, "shape": f"{M}x{K}x{N}",
                   "tflops": {k: 2 * M * K * N / v / 1e12 for k, v in ms.items()},
                   "ms": {k: v * 1e3 for k, v in ms.items()}}
            out["by_shape"].append(row)
            print(f"{prec} {name:>10} {row['shape']:>16}: " + "  ".join(
                f"{k} {row['ms'][k]:8.3f} ms {row['tflops'][k]:7.1f} TFLOP/s" for k in ms),
                flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("speed", "agree", "attention", "profile", "gemm"))
    ap.add_argument("--device", default="gpu", choices=("gpu", "standin"))
    ap.add_argument("--smoke", action="store_true", help="seconds-long, for the plumbing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30,
                    help="attention and gemm: calls per contender per round")
    ap.add_argument("--cpu-steps", type=int, default=20)
    ap.add_argument("--half-steps", type=int, default=200, help="fp16, bf16 and fp32 on the device")
    ap.add_argument("--precisions", default="bf16,fp32", help="profile: which, comma-separated")
    ap.add_argument("--kernel-rows", type=int, default=30, help="profile: kernels listed")
    a = ap.parse_args(argv)
    if a.device == "standin" and not a.smoke:
        print("error: --device standin measures nothing: give --smoke, or --device gpu",
              file=sys.stderr)
        return 2
    bad = sorted(set(a.precisions.split(",")) - set(PRECISIONS))
    if bad:
        print(f"error: --precisions {a.precisions}: {', '.join(bad)} is not one of "
              f"{', '.join(PRECISIONS)}", file=sys.stderr)
        return 2
    if a.smoke:
        a.rounds, a.steps, a.warmup, a.iters = 1, 1, 1, 1
        a.cpu_steps = a.half_steps = 2
    from ratrain.device import DeviceError, open_device
    from ratrain.exec.cudnn_sdpa import CudnnUnavailable

    try:
        dev = open_device(a.device)
        out = {"speed": speed, "agree": agree, "attention": attention, "profile": profile,
               "gemm": gemm}[a.what](a, dev)
    except (DeviceError, CudnnUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 1 if out.get("errors") else 0  # a failed contender or run: its step fails


if __name__ == "__main__":
    sys.exit(main())
