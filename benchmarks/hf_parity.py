"""Loss-curve parity with PyTorch + Hugging Face transformers (issue 2's correctness target).

Builds a random LlamaForCausalLM, saves it with save_pretrained, trains it for N AdamW steps
(a) with ratrain (`init.from_hf`) and (b) with transformers + torch.optim.AdamW on the same
`sequential` batches of the same token file, then compares the per-step losses:

    python benchmarks/hf_parity.py [--steps 100] [--out runs/hf-parity] [--tol 1e-4]
                                   [--hidden 128 --layers 4 --heads 4 --kv-heads 2 ...]
                                   [--device gpu]   # both sides on the GPU (issue 19)
                                   [--precision bf16]  # ratrain's precision, PyTorch's autocast

With `--precision bf16` or `fp16` ratrain runs at that precision and PyTorch under autocast to
that dtype (fp16 with a GradScaler), masters fp32 on both: each side's 16-bit curve, set beside
its own fp32 curve (`python -m ratrain.compare`), says how far 16 bits move a run in either
framework (docs/history/gpu.md, "16 bits against fp32 over 200 steps").

Prints `max_rel_dev=<float> steps=<n>` (ratrain.compare) and exits 1 above --tol. The torch side
is an independent reference: it shares with ratrain only the token file, the batch contract of
the design (window s*G .. (s+1)*G of seq_len+1 tokens) and the optimizer hyper-parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np


def torch_reference(hf_dir, tokens_path, a, out_path):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    on = "cuda" if a.device == "gpu" else "cpu"
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.to(on).train()
    half = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    scaler = torch.amp.GradScaler(on) if half is torch.float16 else None
    opt = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup))
    toks = np.memmap(tokens_path, dtype=np.uint16, mode="r")
    T, B = a.seq_len, a.micro_batch * a.micro_batches
    n_windows = len(toks) // (T + 1)
    with open(out_path, "w") as f:
        for step in range(a.steps):
            idx = (np.arange(B) + step * B) % n_windows  # the design's sequential order
            win = np.stack([np.asarray(toks[i * (T + 1) : (i + 1) * (T + 1)], np.int64) for i in idx])
            x = torch.from_numpy(win[:, :-1]).to(on)
            y = torch.from_numpy(win[:, 1:]).to(on)
            with torch.autocast(on, dtype=half, enabled=half is not None):
                logits = model(input_ids=x).logits  # (B, T, V)
                V = logits.shape[-1]
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(),
                                                         y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
                scaler.step(opt)
                scaler.update()
            sched.step()
            f.write(json.dumps({"step": step + 1, "loss": loss.item(), "grad_norm": gnorm.item()}) + "\n")


def make_hf_model(out_dir, a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=a.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="runs/hf-parity")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=352)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", default="", help="token file (default: the embedded corpus)")
    ap.add_argument("--ratrain-args", nargs="*", default=[], help="extra --set key=value for ratrain")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu", "standin"),
                    help="where both sides compute (ratrain's run.device; PyTorch on cuda for gpu)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="ratrain's precision; PyTorch autocasts to it (fp16: with a GradScaler)")
    a = ap.parse_args(argv)

    from ratrain.data import ensure_default_corpus

    os.makedirs(a.out, exist_ok=True)
    tokens = a.tokens or str(ensure_default_corpus())
    hf_dir = os.path.join(a.out, "hf-init")
    make_hf_model(hf_dir, a)

    sets = [
        f"init.from_hf={hf_dir}",
        f"data.tokens={tokens}",
        "data.order=sequential",
        f"model.seq_len={a.seq_len}",
        f"parallel.micro_batch={a.micro_batch}",
        f"parallel.num_micro_batches={a.micro_batches}",
        f"precision={a.precision}",
        f"optim.lr={a.lr}",
        "optim.betas=[0.9,0.95]",
        "optim.eps=1e-8",
        f"optim.weight_decay={a.weight_decay}",
        f"optim.grad_clip={a.grad_clip}",
        f"optim.warmup_steps={a.warmup}",
        "optim.lr_schedule=constant",
        f"run.steps={a.steps}",
        f"run.dir={os.path.join(a.out, 'ratrain')}",
        "run.log_interval=10",
        "checkpoint.resume=never",
        "data.eval_interval=0",
        f"run.device={a.device}",
        *a.ratrain_args,
    ]
    cmd = [sys.executable, "-m", "ratrain.train", "--config", "jobs/tiny.yaml"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    ref = os.path.join(a.out, "torch.jsonl")
    torch_reference(hf_dir, tokens, a, ref)

    from ratrain.compare import compare, read_metrics

    worst, steps, devs = compare(read_metrics(os.path.join(a.out, "ratrain")), read_metrics(ref))
    gn_worst, _, _ = compare(
        read_metrics(os.path.join(a.out, "ratrain"), "grad_norm"), read_metrics(ref, "grad_norm")
    )
    print(f"max_rel_dev={worst:.6e} steps={len(steps)}")
    print(f"grad_norm max_rel_dev={gn_worst:.6e}")
    print(json.dumps({"steps": len(steps), "loss_max_rel_dev": worst,  # for benchmarks/record.py
                      "grad_norm_max_rel_dev": gn_worst}))
    return 0 if (worst <= a.tol and math.isfinite(worst) and len(steps) == a.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
