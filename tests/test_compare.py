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


def test_a_truncated_copy_fails_unless_a_prefix_is_asked_for(tmp_path, capsys):
    a = run_dir(tmp_path, "a", [2.0, 1.5, 1.0, 0.9])
    short = run_dir(tmp_path, "short", [2.0, 1.5])  # a run that stopped early
    assert main([short, a, "--tol", "0"]) == 1
    assert main([a, short, "--tol", "0"]) == 1
    err = capsys.readouterr().err
    assert f"2 step(s) of {a} missing from {short}: 3, 4" in err
    assert main([short, a, "--tol", "0", "--prefix"]) == 0
    gap = run_dir(tmp_path, "gap", [2.0, 1.5, 1.0, 0.9])
    lines = (tmp_path / "gap" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "gap" / "metrics.jsonl").write_text("\n".join(lines[:1] + lines[2:]) + "\n")
    assert main([gap, a, "--tol", "0", "--prefix"]) == 1  # a gap is not a prefix
    assert "missing from" in capsys.readouterr().err


def test_different_step_sets_fail_at_tol_0(tmp_path):
    a = run_dir(tmp_path, "a", [2.0, 1.5, 1.0])
    b = tmp_path / "b"
    b.mkdir()
    (b / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n"
                                             for s, v in ((1, 2.0), (2, 1.5), (4, 1.0))))
    assert main([a, str(b), "--tol", "0"]) == 1
    assert main([a, str(b)]) == 1  # without a tolerance too


def test_nan_fails_even_in_both_runs(tmp_path, capsys):
    nan = float("nan")
    a = run_dir(tmp_path, "a", [2.0, nan, nan])
    b = run_dir(tmp_path, "b", [2.0, nan, nan])  # both diverged alike
    assert main([a, b, "--tol", "0"]) == 1
    assert f"NaN in {a} at step(s) 2, 3" in capsys.readouterr().err
    c = run_dir(tmp_path, "c", [2.0, 1.0, 1.0])
    assert main([c, b, "--prefix"]) == 1  # a NaN the other run does not share: inf deviation


def test_a_damaged_line_is_an_error_and_a_torn_last_line_is_left_out(tmp_path, capsys):
    a = run_dir(tmp_path, "a", [2.0, 1.5])
    f = tmp_path / "a" / "metrics.jsonl"
    b = run_dir(tmp_path, "b", [2.0, 1.5])
    f.write_text(f.read_text() + '{"step": 3, "lo')  # a crash in mid-write
    assert main([a, b, "--tol", "0"]) == 0
    f.write_text('{"step": 1, "lo\n' + f.read_text())  # damage in the middle
    with pytest.raises(SystemExit, match=r"metrics.jsonl:1 is not a JSON object"):
        main([a, b, "--tol", "0"])


def eval_dir(tmp_path, name, points):
    """A run directory whose eval.jsonl holds (step, eval_loss, elapsed_s) points."""
    d = tmp_path / name
    d.mkdir()
    (d / "eval.jsonl").write_text("".join(
        json.dumps({"step": s, "eval_loss": v, "elapsed_s": t}) + "\n" for s, v, t in points))
    return str(d)


def test_partial_sync_recipe_judges_the_eval_curve_and_the_time_to_loss(tmp_path, capsys):
    full = eval_dir(tmp_path, "full", [(10, 3.0, 20), (20, 2.5, 40), (30, 2.2, 60),
                                       (40, 2.0, 80), (50, 1.9, 100)])
    # early eval off by 10% (not judged after --after 0.2), then within 2%, ends below full
    part = eval_dir(tmp_path, "part", [(10, 3.3, 10), (20, 2.53, 20), (30, 2.21, 30),
                                       (40, 2.02, 40), (50, 1.89, 50)])
    recipe = [part, full, "--key", "eval_loss", "--tol", "0.02", "--after", "0.2",
              "--final-tol", "0.01", "--time-to-final", "--min-speedup", "1.3"]
    assert main(recipe) == 0
    out = capsys.readouterr().out
    assert "steps=4" in out and "final_rel_dev=5.26" in out
    assert "time_to_final_a=50 time_to_final_b=100 speedup=2" in out
    assert main(recipe[:4] + ["--tol", "0.02"]) == 1  # every eval counted: 10% at step 10
    slow = eval_dir(tmp_path, "slow", [(10, 3.0, 30), (20, 2.5, 60), (30, 2.2, 90),
                                       (40, 2.0, 120), (50, 1.9, 150)])
    assert main([slow, *recipe[1:]]) == 1  # the same curve, slower: speed-up 0.67
    assert "0.667 < 1.3" in capsys.readouterr().err
    never = eval_dir(tmp_path, "never", [(10, 3.0, 1), (20, 2.5, 2), (30, 2.2, 3), (40, 2.0, 4),
                                         (50, 1.91, 5)])  # within 1% but never reaches 1.9
    assert main([never, full, "--key", "eval_loss", "--time-to-final"]) == 0
    assert "time_to_final_a=inf" in capsys.readouterr().out
    assert main([never, *recipe[1:]]) == 1


def test_step_efficiency_is_what_a_step_is_worth_in_the_others_steps(tmp_path, capsys):
    from ratrain.compare import step_efficiency, step_to

    full = {10: 3.0, 20: 2.5, 30: 2.2, 40: 2.0}
    assert step_to(full, 2.35) == pytest.approx(25.0)  # interpolated between 20 and 30
    assert step_to(full, 3.5) == 10.0 and step_to(full, 1.9) is None
    assert step_to({10: 3.0, 20: float("nan"), 30: 2.0}, 2.5) == 30.0  # nothing across a NaN
    behind = {10: 3.1, 20: 2.7, 30: 2.4, 40: 2.35}  # at 40 where full was at 25
    assert step_efficiency(behind, full) == pytest.approx(25 / 40)
    ahead = {10: 2.9, 20: 2.3, 30: 2.0, 40: 1.9}  # reached full's 2.0 at 30
    assert step_efficiency(ahead, full) == pytest.approx(40 / 30)
    assert step_efficiency(full, full) == 1.0
    assert step_efficiency({10: 3.0, 40: 3.5}, full) == 0.25  # full was there at its first eval
    assert step_efficiency({**full, 40: float("nan")}, full) == 0.0
    assert step_efficiency(full, {**full, 40: float("nan")}) == float("inf")
    longer = {**behind, 50: 2.0}  # judged at the last shared step, 40
    assert step_efficiency(longer, full) == pytest.approx(25 / 40)
    for a, b in (({1: 1.0}, {2: 1.0}), ({0: 2.0, 1: 1.0}, {0: 1.0, 2: 1.0})):
        with pytest.raises(ValueError, match="no step after step 0"):
            step_efficiency(a, b)
    assert step_efficiency({0: 2.0, 10: 1.0}, {0: 1.5, 10: 1.5}) == 10 / 5  # from step 0
    a = eval_dir(tmp_path, "behind", [(s, y, s) for s, y in behind.items()])
    b = eval_dir(tmp_path, "full", [(s, y, s) for s, y in full.items()])
    assert main([a, b, "--key", "eval_loss", "--step-efficiency"]) == 0  # a figure, no bound
    assert "step_efficiency=0.625" in capsys.readouterr().out
