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



def test_set_changes_the_model_of_every_contender(tmp_path):
    need("torch")
    need("transformers")
    out = tmp_path / "b.json"
    bench.main(["--rounds", "1", "--warmup", "0", "--json", str(out), "--set", "model.layers=1",
                "--set", "model.seq_len=32"])
    import json

    r = json.loads(out.read_text())
    assert r["sets"] == ["model.layers=1", "model.seq_len=32"]
    assert r["tokens_per_step"] == 8 * 32  # micro-batch 8
    assert r["fp16_time_over_fp32"] > 0 and r["fp32_speed_over_torch"] > 0
    # the PyTorch child builds its model from the same overrides: a bad one stops it
    with pytest.raises(ImportError, match="did not start"):
        bench.torch_remote(1, "default", ["model.nope=1"])
