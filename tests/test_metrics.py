"""metrics.jsonl is only ever appended to: a restart marks re-run steps (every record has the
field), a torn last line is cut, a link is never followed; `read_curve` keeps the last record of
each step; eval.jsonl is never opened through a link either."""

import io
import json
import os

import pytest

from ratrain.job.metrics import MetricsWriter, read_curve


def rec(step, loss):
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "loss_scale": 1.0,
            "skipped": False, "tokens": 8, "step_time_s": 0.1, "tokens_per_s": 80.0,
            "peak_ddr_bytes": 0}


def lines(path):
    return [json.loads(x) for x in open(path)]


def test_restart_appends_and_marks_rerun_steps(tmp_path):
    w = MetricsWriter(str(tmp_path), 6, out=io.StringIO())
    for s in (1, 2, 3, 4):
        w.write(rec(s, 10.0 - s))
    w.close()
    w = MetricsWriter(str(tmp_path), 6, out=io.StringIO())  # resumed from step 2
    for s in (3, 4, 5):
        w.write(rec(s, 20.0 - s))
    w.close()
    got = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 3, 4, 5]  # nothing dropped
    assert [r["rerun"] for r in got] == [False] * 4 + [True, True, False]  # in every record
    curve = read_curve(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in curve] == [(1, 9.0), (2, 8.0), (3, 17.0), (4, 16.0),
                                                       (5, 15.0)]


def test_a_torn_last_line_is_cut_and_nothing_else(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps(rec(1, 1.0)) + "\n" + '{"step": 2, "lo')
    w = MetricsWriter(str(tmp_path), 3, out=io.StringIO())
    w.write(rec(2, 2.0))
    w.close()
    assert [r.get("step") for r in lines(p)] == [1, 2]


def test_metrics_never_follow_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / "metrics.jsonl")
    with pytest.raises(OSError):
        MetricsWriter(str(run), 3, out=io.StringIO())
    assert victim.read_text() == "keep"
    os.unlink(run / "metrics.jsonl")
    os.symlink(victim, run / "eval.jsonl")
    w = MetricsWriter(str(run), 3, out=io.StringIO())
    with pytest.raises(OSError):
        w.write_event({"step": 1, "eval_loss": 1.0})
    assert victim.read_text() == "keep"


def test_read_curve_leaves_out_only_a_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    good = json.dumps(rec(1, 1.0)) + "\n" + json.dumps(rec(2, 2.0)) + "\n"
    p.write_text(good + '{"step": 3, "lo')  # torn: no newline at the end
    assert [r["step"] for r in read_curve(str(p))] == [1, 2]
    p.write_text(good + '{"step": 3, "lo\n')  # ends in a newline: not torn but damaged
    with pytest.raises(ValueError, match=r"metrics.jsonl:3 is not a JSON object"):
        read_curve(str(p))
    p.write_text('[1, 2]\n' + good)
    with pytest.raises(ValueError, match=r"metrics.jsonl:1 is not a JSON object"):
        read_curve(str(p))


def test_progress_goes_to_the_stdout_of_now(tmp_path, monkeypatch):
    """Without `out`, the progress lines go to `sys.stdout` as it is when the writer is made,
    not as it was when the module was imported (a stream replaced since, e.g. by a test's
    capture that has ended, may be closed)."""
    now = io.StringIO()
    monkeypatch.setattr("sys.stdout", now)
    w = MetricsWriter(str(tmp_path), 2)
    w.write(rec(1, 3.0))
    w.close()
    assert "step" in now.getvalue() and "1/2" in now.getvalue()
