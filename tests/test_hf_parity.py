"""Loss-curve parity with PyTorch + transformers (benchmarks/hf_parity.py, shortened)."""

import importlib.util
import os

import pytest
from tests._prereq import need

pytestmark = pytest.mark.torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *args):
    """benchmarks/hf_parity.py's main on a small model and random tokens: (exit status, out
    dir)."""
    need("torch")
    need("transformers")
    spec = importlib.util.spec_from_file_location("hf_parity", f"{ROOT}/benchmarks/hf_parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ratrain.data import write_tokens

    import numpy as np

    tokens = tmp_path / "t.bin"
    if not tokens.exists():
        write_tokens(tokens, np.random.default_rng(0).integers(0, 256, 40000), vocab_size=256)
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    cwd = os.getcwd()
    os.chdir(ROOT)  # the script runs `-m ratrain.train --config jobs/tiny.yaml`
    try:
        rc = mod.main(["--out", str(out), "--tokens", str(tokens), "--hidden", "64", "--ffn",
                       "160", "--layers", "2", "--seq-len", "32", "--warmup", "3", *args])
    finally:
        os.chdir(cwd)
    return rc, out


def test_losses_match_transformers_and_torch_adamw(tmp_path, capsys):
    rc, _ = run(tmp_path, "--steps", "12", "--tol", "1e-4")
    out = capsys.readouterr().out
    assert "steps=12" in out
    assert rc == 0, out


def test_at_bf16_both_sides_run_16_bits_and_stay_close(tmp_path, capsys):
    """`--precision bf16`: ratrain at bf16, PyTorch under autocast to bf16: each side moves off
    its fp32 run by bf16's rounding, and the two stay within 2% of each other over 6 steps."""
    from ratrain.compare import read_metrics

    runs = {p: run(tmp_path, "--steps", "6", "--tol", "2e-2", "--precision", p)
            for p in ("fp32", "bf16")}
    out = capsys.readouterr().out
    assert all(rc == 0 for rc, _ in runs.values()), out
    (_, d32), (_, d16) = runs["fp32"], runs["bf16"]
    for side in ("ratrain", "torch.jsonl"):
        a, b = read_metrics(str(d16 / side)), read_metrics(str(d32 / side))
        assert a.keys() == b.keys() and 0 < max(abs(a[s] - b[s]) / b[s] for s in a) < 2e-2, side
