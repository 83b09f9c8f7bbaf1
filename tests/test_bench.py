"""The single-rank benchmark command (python -m ratrain.bench) runs and reports consistent
figures; the PyTorch contender runs in its own process."""

import pytest

from ratrain import bench
from tests._prereq import need


def test_throughput_figures_are_consistent(tmp_path):
    need("torch")
    need("transformers")
    out = tmp_path / "b.json"
    bench.main(["--rounds", "1", "--warmup", "0", "--no-fp16", "--json", str(out)])
    import json

    r = json.loads(out.read_text())
    assert r["torch_malloc"] == "default"
    for k in ("ratrain_fp32", "torch_eager"):
        assert r[f"{k}_step_s"] > 0
        assert r[f"{k}_tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r[f"{k}_step_s"])
    assert r["fp32_speed_over_torch"] == pytest.approx(
        r["torch_eager_step_s"] / r["ratrain_fp32_step_s"])
    assert r["fp32_gflops_over_sgemm"] > 0

