"""Benchmark records: one JSON file per figure group under docs/records/ (`<name>.json`; a new
record of a name replaces the old), the source of the generated summary tables of
docs/BENCHMARKS.md and docs/FAULTS.md (benchmarks/tables.py).

    python benchmarks/record.py NAME [--rounds N] [--ratio KEY=NUM:DEN ...] -- COMMAND ...

runs COMMAND N times (default 1; its output is echoed), takes the JSON it prints (its whole
output as one JSON document, or every line that is a JSON object), flattens it into figures
(nested keys joined by "."; an object in a list keyed by its identifying fields, e.g.
`allreduce/tree/4/8.time_s`; the last object line, a benchmark's summary, also under its own
keys; numbers, strings and booleans kept), adds each `--ratio` (NUM over
DEN, per round), takes the median of every number over the rounds and writes the record.
A failing round ends the rounds; what it printed is recorded (with its `exit_status`) and the
script exits with its status; a command that printed no JSON writes nothing. Records go to
$RATRAIN_RECORDS (default docs/records/; smoke runs point it elsewhere).

Record fields: name, command (exactly what was run: this script's command line), commit (git
rev-parse --short HEAD, "+dirty" when the tree has changes; $RATRAIN_COMMIT where set, for a
copy of the tree whose .git is not the tree's: the device machine's reported the session's
first commit, dirty), cpu_model (/proc/cpuinfo), cores
(os.cpu_count()), load_before, load_after (1-minute load average), date (ISO-8601 UTC), figures.
"+dirty" leaves out docs/records/ itself (a re-measurement writes records one after another).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ID_FIELDS = ("case", "kind", "policy", "op", "algo", "ranks", "bytes", "size", "precision", "seed")


def records_dir() -> Path:
    return Path(os.environ.get("RATRAIN_RECORDS", ROOT / "docs" / "records"))


def commit() -> str:
    if os.environ.get("RATRAIN_COMMIT"):
        return os.environ["RATRAIN_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    # records written earlier in the same re-measurement do not make the code dirty
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/records")
    return head + ("+dirty" if changed.strip() else "")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def host() -> dict:
    """The fields of a record that describe the machine and the code, taken now."""
    return {"commit": commit(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "load": round(os.getloadavg()[0], 2)}


def write_record(name: str, command: str, figures: dict, load_before: float | None = None,
                 out_dir: Path | None = None) -> Path:
    """Write `<records dir>/<name>.json` (atomically) and return its path. `load_before`: the
    load when the measurement began (default: now)."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"record name {name!r}: a plain file name, e.g. bench-step")
    bad = {k: v for k, v in figures.items() if not isinstance(v, (int, float, str, bool))}
    if bad:
        raise ValueError(f"record {name}: figures must be numbers, strings or booleans: {bad}")
    h = host()
    rec = {"name": name, "command": command, "commit": h["commit"], "cpu_model": h["cpu_model"],
           "cores": h["cores"], "load_before": h["load"] if load_before is None else load_before,
           "load_after": h["load"],
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "figures": figures}
    d = out_dir or records_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def read_records(d: Path | None = None) -> dict[str, dict]:
    """name -> record, of every record in the directory."""
    d = d or records_dir()
    out = {}
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        rec = json.loads(p.read_text())
        out[rec["name"]] = rec
    return out


def parse_output(text: str):
    """The JSON a command printed: its whole output as one document, else its object lines."""
    try:
        doc = json.loads(text)
        # one object line that identifies itself (a benchmark's row): keyed like a list item
        return [doc] if isinstance(doc, dict) and any(f in doc for f in ID_FIELDS) else doc
    except ValueError:
        pass
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def flatten(obj, prefix: str = "") -> dict:
    """Figures from parsed JSON: nested keys joined by "."; list items keyed by ID_FIELDS."""
    out: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            key = "/".join(str(v[f]) for f in ID_FIELDS if f in v) if isinstance(v, dict) else ""
            out.update(flatten(v, f"{prefix}{key or i}."))
    elif isinstance(obj, (bool, int, float, str)) and obj == obj:  # NaN left out
        out[prefix[:-1]] = obj
    return out


def combine(rounds: list[dict], ratios: dict[str, tuple[str, str]]) -> dict:
    """One figure set from the rounds': each ratio per round, then the median of numbers
    (strings and booleans: the last round's; a boolean that differs between rounds: False)."""
    for r in rounds:
        for key, (num, den) in ratios.items():
            if num not in r or den not in r:
                raise SystemExit(f"error: --ratio {key}: no figure {num if num not in r else den}"
                                 f" (figures: {', '.join(sorted(r)[:20])} ...)")
            r[key] = r[num] / r[den]
    out = {}
    for key in rounds[-1]:
        vals = [r[key] for r in rounds if key in r]
        if isinstance(vals[-1], bool):
            out[key] = all(vals)
        elif isinstance(vals[-1], (int, float)):
            out[key] = statistics.median(vals) if len(vals) > 1 else vals[0]
        else:
            out[key] = vals[-1]
    if len(rounds) > 1:
        out["rounds"] = len(rounds)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python benchmarks/record.py NAME [--rounds N] [--ratio KEY=NUM:DEN] -- "
              "COMMAND ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python benchmarks/record.py")
    ap.add_argument("name")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ratio", action="append", default=[], metavar="KEY=NUM:DEN")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    ratios = {}
    for spec in a.ratio:
        key, _, rest = spec.partition("=")
        num, _, den = rest.partition(":")
        if not (key and num and den):
            print(f"error: --ratio {spec!r}: give KEY=NUM:DEN (figure keys)", file=sys.stderr)
            return 2
        ratios[key] = (num, den)
    if not cmd or a.rounds < 1:
        print("error: give a command after -- and --rounds >= 1", file=sys.stderr)
        return 2
    load_before = round(os.getloadavg()[0], 2)
    rounds = []
    for _ in range(a.rounds):
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        sys.stdout.write(p.stdout)
        doc = parse_output(p.stdout)
        figures = flatten(doc)
        if isinstance(doc, list) and doc and isinstance(doc[-1], dict):
            figures.update(flatten(doc[-1]))  # the last line, a benchmark's summary: unprefixed
        if not figures:
            print(f"error: {shlex.join(cmd)} exited {p.returncode} and printed no JSON figures;"
                  " no record written", file=sys.stderr)
            return p.returncode or 1
        rounds.append(dict(figures, exit_status=p.returncode))
        if p.returncode != 0:  # recorded as it is (a failed trial is a figure), then the status
            break
    command = shlex.join(["python", "benchmarks/record.py", *argv])
    path = write_record(a.name, command, combine(rounds, ratios), load_before)
    print(f"record: {path}", file=sys.stderr)
    return rounds[-1]["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
