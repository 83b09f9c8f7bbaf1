"""benchmarks/gpu.py (issues 19 and 29's GPU figures) runs: its plumbing on the stand-in with PyTorch on
the CPU (--smoke: seconds, no figures), and its refusal without a GPU. The figures themselves
are scripts/gpu-check.sh's, on a GPU."""

import json
import os
import subprocess
import sys

import pytest

from tests._devices import GPU
from tests._prereq import need

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run([sys.executable, "benchmarks/gpu.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.torch
def test_speed_plumbing_on_the_standin():
    need("torch")
    need("transformers")
    p = run("speed", "--device", "standin", "--smoke")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out["tokens_per_s"]) == {"ratrain bf16", "ratrain fp16", "ratrain fp32",
                                        "torch amp bf16 sdpa", "torch amp fp16 sdpa",
                                        "torch fp32 eager", "ratrain bf16 devkernels off",
                                        "ratrain bf16 head chunk 16 MiB",
                                        "ratrain bf16 rmsnorm, rope on cupy"}
    assert out["devkernels_gain_bf16"] > 0 and out["head_chunk_gain_bf16"] > 0
    assert out["cupy_norm_rope_gain_bf16"] > 0
    assert all(v > 0 for v in out["tokens_per_s"].values())
    assert set(out["vs_torch"]) == {"bf16", "fp16", "fp32"}
    assert all(out["memory"][f"ratrain {p}"]["ledger_peak"] > 0 for p in ("bf16", "fp16", "fp32"))
    assert out["kernels"]["bf16"].endswith("attention tiled-1024")  # the stand-in's


def test_agree_plumbing_on_the_standin():
    p = run("agree", "--device", "standin", "--smoke")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["cpu_vs_device_fp32_max_rel"] < 1e-5  # the stand-in's arithmetic is numpy's
    assert out["fp16_vs_fp32_max_rel"] < 1e-2 and out["bf16_vs_fp32_max_rel"] < 3e-2
    for prec in ("fp16", "bf16"):  # the smoke's 2 steps: one window, its own last
        win = out[f"{prec}_vs_fp32_window_rel"]
        assert win["window"] == 2 and win["max"] == win["last"] <= out[f"{prec}_vs_fp32_max_rel"]


def test_refuses_without_a_gpu_or_with_standin_alone():
    p = run("speed", "--device", "standin")
    assert p.returncode == 2 and "--smoke" in p.stderr
    if GPU is None:
        p = run("agree")
        assert p.returncode == 2 and "run.device: gpu" in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


def test_attention_plumbing_on_the_standin():
    """Without a card the attention benchmark builds and validates its graphs, runs nothing."""
    need("cudnn", "cuDNN's fused attention graphs (pip install nvidia-cudnn-frontend)")
    p = run("attention", "--device", "standin", "--smoke")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["executed"] is False and out["graphs_validated"] == 6


def test_profile_and_gemm_plumbing_on_the_standin():
    """`profile`: per category, synchronized, for each precision asked; `gemm`: cupy's GEMM,
    ratrain's cast-around one and (16-bit) its layout's GemmEx at each shape and precision
    (PyTorch's only on a card)."""
    p = run("profile", "--device", "standin", "--smoke", "--precisions", "bf16")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])["by_precision"]
    assert set(out) == {"bf16"} and out["bf16"]["step_s"] > 0
    assert {"gemm", "attention", "adamw"} <= {r["category"] for r in out["bf16"]["categories"]}
    p = run("gemm", "--device", "standin", "--smoke")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])["by_shape"]
    assert {(r["precision"], r["case"]) for r in rows} == {
        (p, c) for p in ("bf16", "fp16", "fp32") for c in ("qkv", "head chunk")}
    assert all(set(r["ms"]) == {"cupy", "ratrain", *(("ratrain16",) if r["precision"] != "fp32"
                                                    else ())}
               and min(r["ms"].values()) > 0 for r in rows)


def test_window_rel_compares_the_curves_mean_over_windows():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", f"{ROOT}/benchmarks/gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = mod._window_rel([1.0, 3.0, 2.0, 2.0, 9.0], [2.0, 2.0, 1.0, 1.0, 1.0], 2)
    assert got == {"max": 1.0, "last": 1.0, "window": 2}  # windows 2 vs 2, then 2 vs 1
    assert mod._window_rel([2.0, 2.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], 2)["max"] == 0.0
    assert mod._window_rel([1.0], [1.0, 2.0], 1) is None and mod._window_rel(None, [1.0]) is None
