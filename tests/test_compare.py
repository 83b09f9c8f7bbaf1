import json

import pytest

from ratrain.compare import main


def run_dir(tmp_path, name, losses):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "loss": loss}) + "\n")
        f.write(json.dumps({"step": 2, "eval_loss": 9.0}) + "\n")
    return str(d)


def test_compare_reports_max_relative_deviation(tmp_path, capsys):
    a = run_dir(tmp_path, "a", [2.0, 1.5, 1.0])
    b = run_dir(tmp_path, "b", [2.0, 1.5, 1.001])
    assert main([a, b, "--tol", "1e-2"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("max_rel_dev=9.99") and out.endswith("steps=3")
    assert main([a, b, "--tol", "1e-4"]) == 1


def test_compare_missing_run_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main([str(tmp_path / "x"), str(tmp_path / "y")])
