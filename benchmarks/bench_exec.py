"""Single-rank training throughput of the exec kernels, next to sgemm and PyTorch eager.

    .venv/bin/python benchmarks/bench_exec.py                 # fp32 + fp16 + torch, 2 threads
    .venv/bin/python benchmarks/bench_exec.py --repeats 5 --json out.json

Model (issue 2's benchmark): vocab 256, hidden 512, 8 layers, 8 heads, 8 kv heads, ffn 1376,
seq 256, micro-batch 8. One timed step = forward + backward of the whole stack (embedding,
8 layers, head with loss), gradients accumulated into fp32 buffers; the optimizer step is
excluded (it is the same elementwise AdamW for both sides and not an exec kernel). Flops per
token: ModelConfig.flops_per_token (6 x matmul parameters + causal attention, fwd + bwd).

The machine may be shared: the timed steps run in interleaved rounds (one sgemm, one step of
each contender) so that every contender sees the same load, and each figure is the median of
`--repeats` rounds after `--warmup` rounds. PyTorch eager runs transformers'
LlamaForCausalLM (sdpa attention) with torch.set_num_threads(threads), same shapes, same step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ratrain.config import ModelConfig
from ratrain.bench import sgemm_step
from ratrain.exec import head, layers
from ratrain.exec.context import ExecContext
from ratrain.exec.spec import RECOMPUTE, init_param, model_blocks

BENCH_MODEL = ModelConfig(
    vocab_size=256, hidden=512, layers=8, heads=8, kv_heads=8, ffn_hidden=1376, seq_len=256
)


def ratrain_step(precision: str, threads: int, batch: int, recompute: str = "none"):
    """A step function: forward + backward of the whole benchmark model on one micro-batch."""
    m = BENCH_MODEL
    ctx = ExecContext(m, precision, threads=threads)
    blocks = model_blocks(m)
    P = [{q.local: init_param(q, 0).astype(ctx.dtype) for q in b.params} for b in blocks]
    G = [{q.local: np.zeros(q.shape, np.float32) for q in b.params} for b in blocks]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.vocab_size, (batch, m.seq_len))
    targets = rng.integers(0, m.vocab_size, (batch, m.seq_len))

    def step():
        x, ce = layers.embed_forward(ids, P[0], ctx)
        caches = []
        for i in range(m.layers):
            x, c = layers.layer_forward(x, P[1 + i], ctx, recompute)
            caches.append(c)
        loss, ch = head.head_forward(x, targets, P[-1], ctx)
        dx = head.head_backward(1.0, ch, P[-1], G[-1], ctx)
        for i in reversed(range(m.layers)):
            dx = layers.layer_backward(dx, caches[i], P[1 + i], G[1 + i], ctx)
        layers.embed_backward(dx, ce, P[0], G[0], ctx)
        return loss

    return step


def torch_step(threads: int, batch: int):
    """The same step in PyTorch eager: transformers' LlamaForCausalLM (sdpa attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = BENCH_MODEL
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden, intermediate_size=m.ffn_hidden,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        max_position_embeddings=m.seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float().train()
    ids = torch.randint(0, m.vocab_size, (batch, m.seq_len))
    targets = torch.randint(0, m.vocab_size, (batch, m.seq_len))
    ce = torch.nn.CrossEntropyLoss()

    def step():
        logits = model(input_ids=ids).logits
        loss = ce(logits.view(-1, m.vocab_size), targets.view(-1))
        loss.backward()
        return loss

    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", default="none", choices=RECOMPUTE,
                    help="what each layer's backward recomputes (schedule.recompute)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-fp16", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    m = BENCH_MODEL
    tokens = a.batch * m.seq_len
    flops = m.flops_per_token() * tokens
    res: dict = {"threads": a.threads, "batch": a.batch, "seq_len": m.seq_len,
                 "flops_per_step": flops, "repeats": a.repeats, "recompute": a.recompute}
    steps = {"ratrain_fp32": ratrain_step("fp32", a.threads, a.batch, a.recompute)}
    if not a.no_fp16:
        steps["ratrain_fp16"] = ratrain_step("fp16", a.threads, a.batch, a.recompute)
    if not a.no_torch:
        try:
            steps["torch_eager"] = torch_step(a.threads, a.batch)
        except ImportError as e:
            print(f"torch eager skipped: {e}")
    sgemm = sgemm_step(a.threads)
    times: dict = {k: [] for k in steps}
    rates = []
    # Interleaved rounds (sgemm, then one step of each) so that all see the same machine load.
    for _ in range(a.warmup + a.repeats):
        rates.append(sgemm())
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    rates = rates[a.warmup:]
    res["sgemm_gflops"] = statistics.median(rates)
    res["sgemm_all"] = rates
    print(f"sgemm 2048^3, {a.threads} BLAS threads: {res['sgemm_gflops']:.1f} GFLOP/s (median)")

    def report(name, ts):
        med = statistics.median(ts)
        res[name] = {"step_s": med, "tokens_per_s": tokens / med, "gflops": flops / med / 1e9,
                     "times": ts}
        print(f"{name:>12}: step {med * 1e3:8.1f} ms  {tokens / med:8.0f} tok/s  "
              f"{flops / med / 1e9:6.1f} GFLOP/s  (median of {len(ts)})")

    for name, ts in times.items():
        report(name, ts[a.warmup:])
    # Paired per-round ratios (same round = same load), and their medians: the robust figures.
    t32 = times["ratrain_fp32"][a.warmup:]
    res["fp32_vs_sgemm"] = statistics.median(flops / t / 1e9 / r for t, r in zip(t32, rates))
    print(f"ratrain fp32 GFLOP/s / sgemm GFLOP/s = {res['fp32_vs_sgemm']:.2f} "
          "(median of per-round ratios; target >= 0.60)")
    if "ratrain_fp16" in times:
        t16 = times["ratrain_fp16"][a.warmup:]
        res["fp16_over_fp32_time"] = statistics.median(b / t for t, b in zip(t32, t16))
        print(f"fp16 step / fp32 step = {res['fp16_over_fp32_time']:.2f} "
              "(median of per-round ratios; target <= 1.5)")
    if "torch_eager" in times:
        tt = times["torch_eager"][a.warmup:]
        res["fp32_vs_torch"] = statistics.median(b / t for t, b in zip(t32, tt))
        print(f"ratrain fp32 throughput / torch eager = {res['fp32_vs_torch']:.2f} "
              "(median of per-round ratios; target >= 1.0)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
