"""Figures generated from records: benchmarks/record.py writes a record (the command, commit, CPU,
cores, load before and after, date, figures), benchmarks/tables.py turns the newest records into
the summary tables of docs/BENCHMARKS.md and docs/FAULTS.md and the record tables of
docs/history/, and the pages in the tree are what the generator makes of the records in
docs/records/."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import record  # noqa: E402 - benchmarks/ is not a package
import tables  # noqa: E402

FIELDS = {"name", "command", "commit", "cpu_model", "cores", "load_before", "load_after", "date",
          "figures"}


def test_the_summary_tables_are_up_to_date_with_their_records():
    records = record.read_records(ROOT / "docs" / "records")
    for page in tables.TABLES:
        text = (ROOT / page).read_text()
        assert tables.render(page, text, records) == text, (
            f"{page} is out of date with docs/records/: run python benchmarks/tables.py")
    for rec in records.values():
        assert set(rec) == FIELDS and rec["commit"] and rec["cpu_model"], rec["name"]


def gone_scripts(page: str, records: dict) -> list[str]:
    """Scripts a row's command runs that the tree lacks, where the row does not say which commit
    has them (`git show COMMIT:PATH`)."""
    gone = []
    for row in tables.table(page, records).splitlines():
        if not row.startswith("| ") or row.startswith("| figure"):
            continue
        command = row.split(" | ")[2]
        for path in re.findall(r"(?:benchmarks|scripts|jobs)/[\w./-]+\.(?:py|sh|yaml)", command):
            if not (ROOT / path).exists() and f":{path}`" not in row:
                gone.append(path)
    return gone


def test_every_script_a_row_runs_exists_or_its_row_says_where_it_went(tmp_path):
    records = record.read_records(ROOT / "docs" / "records")
    for page in tables.TABLES:
        assert not gone_scripts(page, records), page
    record.write_record("bench-step", "python benchmarks/gone.py --rounds 1", {"x": 1},
                        out_dir=tmp_path)  # a planted record whose script was removed
    assert gone_scripts("docs/BENCHMARKS.md", record.read_records(tmp_path)) == [
        "benchmarks/gone.py"]


def test_a_new_record_changes_its_row_and_the_row_names_its_host(tmp_path):
    page = "docs/FAULTS.md"
    text = (ROOT / page).read_text()
    path = record.write_record("faults-kill9", "python benchmarks/faults.py kill9 --trials 3",
                               {"trials": 3, "passed": 2, "kind": "kill9"}, load_before=0.25,
                               out_dir=tmp_path)
    rec = json.loads(path.read_text())
    assert set(rec) == FIELDS and rec["load_before"] == 0.25
    new = tables.render(page, text, record.read_records(tmp_path))
    assert new != text  # the check fails until the page is regenerated
    row = next(x for x in new.splitlines() if x.startswith("| kill -9"))
    for part in ("passed **2**", "trials **3**", rec["commit"], rec["cpu_model"],
                 f"0.25 / {rec['load_after']}", "`python benchmarks/faults.py kill9 --trials 3`"):
        assert part in row, part
    assert tables.render(page, new, record.read_records(tmp_path)) == new  # a fixed point


def test_the_commit_is_the_trees_or_ratrain_commit_where_set(monkeypatch):
    """A copy of the tree whose .git is not its own (the device machine's) is told its commit."""
    monkeypatch.delenv("RATRAIN_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert record.commit().split("+")[0] == head
    monkeypatch.setenv("RATRAIN_COMMIT", "abc1234")
    assert record.commit() == "abc1234" and record.host()["commit"] == "abc1234"


def test_record_runs_a_command_takes_medians_and_ratios(tmp_path):
    code = ("import json, random; print('warming up'); "
            "print(json.dumps({'case': 'a', 'time_s': random.choice([1.0, 2.0, 3.0])})); "
            "print(json.dumps({'case': 'b', 'time_s': 4.0, 'ok': True}))")
    env = {"RATRAIN_RECORDS": str(tmp_path), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "x", "--rounds",
                        "3", "--ratio", "a_over_b=a.time_s:b.time_s", "--", sys.executable, "-c",
                        code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    f = json.loads((tmp_path / "x.json").read_text())["figures"]
    assert f["b.time_s"] == 4.0 and f["b.ok"] is True and f["rounds"] == 3
    assert f["a.time_s"] in (1.0, 2.0, 3.0) and f["a_over_b"] == f["a.time_s"] / 4.0


def test_a_failing_command_is_recorded_with_its_status_and_fails(tmp_path):
    code = "import json, sys; print(json.dumps({'trials': 4, 'passed': 1})); sys.exit(1)"
    env = {"RATRAIN_RECORDS": str(tmp_path), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "slurm-quick",
                        "--", sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 1
    rec = json.loads((tmp_path / "slurm-quick.json").read_text())
    assert rec["figures"] == {"trials": 4, "passed": 1, "exit_status": 1}
    table = tables.table("docs/FAULTS.md", {"slurm-quick": rec})
    assert "passed **1**; trials **4**; the command exited 1" in table
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), "y", "--",
                        sys.executable, "-c", "print('no figures')"], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 1 and "printed no JSON figures" in p.stderr
    assert not (tmp_path / "y.json").exists()


def test_bad_record_names_and_figures_are_refused(tmp_path):
    with pytest.raises(ValueError, match="plain file name"):
        record.write_record("../x", "cmd", {}, out_dir=tmp_path)
    with pytest.raises(ValueError, match="numbers, strings or booleans"):
        record.write_record("x", "cmd", {"rows": [1, 2]}, out_dir=tmp_path)
