"""Loss-curve parity with PyTorch + transformers (benchmarks/hf_parity.py, shortened)."""

import importlib.util
import os

import pytest
from tests._prereq import need

pytestmark = pytest.mark.torch


def test_losses_match_transformers_and_torch_adamw(tmp_path, capsys):
    need("torch")
    need("transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("hf_parity", f"{root}/benchmarks/hf_parity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ratrain.data import write_tokens

    import numpy as np

    tokens = tmp_path / "t.bin"
    write_tokens(tokens, np.random.default_rng(0).integers(0, 256, 40000), vocab_size=256)
    cwd = os.getcwd()
    os.chdir(root)  # the script runs `-m ratrain.train --config jobs/tiny.yaml`
    try:
        rc = mod.main(["--steps", "12", "--out", str(tmp_path / "out"), "--tokens", str(tokens),
                       "--hidden", "64", "--ffn", "160", "--layers", "2", "--seq-len", "32",
                       "--warmup", "3", "--tol", "1e-4"])
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "steps=12" in out
    assert rc == 0, out
