"""Where PyTorch eager's step of the benchmark model goes (issue 15): the same step
`python -m ratrain.bench` times (transformers' LlamaForCausalLM, SDPA attention,
torch.optim.AdamW, 2 threads), under torch.profiler, per operator (self time, seconds per
step), to set beside `python -m ratrain.bench --profile`.

    python benchmarks/torch_profile.py [--steps 2] [--top 20]
"""

import argparse

from ratrain.bench import bench_config, torch_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after 2 untimed)")
    ap.add_argument("--top", type=int, default=20, help="operators listed")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.steps < 1:
        raise SystemExit(f"--steps {a.steps}: give at least 1")
    from torch.profiler import ProfilerActivity, profile

    step = torch_step(bench_config("fp32", a.threads))
    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    rows = sorted(((e.self_cpu_time_total / a.steps / 1e6, e.key) for e in prof.key_averages()),
                  reverse=True)
    print(f"self time per step, all operators: {sum(t for t, _ in rows):.3f} s")
    for t, k in rows[: a.top]:
        print(f"{t:8.3f} s  {k}")


if __name__ == "__main__":
    main()
