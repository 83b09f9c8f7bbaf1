"""Per-step metrics: `metrics.jsonl` records, `eval.jsonl` records and the progress line
printed on rank 0.

`metrics.jsonl` holds one record per training step, every record with the same fields and
types (`REQUIRED`, plus from the trainer `mfu`, `elapsed_s`, and each rank's whole memory
beside its ledger peak: `rss_bytes` (the largest resident set over ranks, measured at the
step's gradient norm), `rss_bytes_by_rank` and `peak_ddr_bytes_by_rank` (lists by world
rank)); eval results go to their own
file, `eval.jsonl` (`step, eval_loss, eval_ppl, eval_tokens, elapsed_s`), so a table of either
file has one type per column. The progress line shows MFU (model flops utilisation: achieved
flop/s over the peak of every rank) and the time elapsed since the run (or its resume) began.

Both files are only ever appended to, never through a symbolic link: a resumed or restarted run
adds its records after the old ones, and a step recorded before that is trained again carries
`"rerun": true` (every record has the field); a reader keeps the last record of each step
(`read_curve`). Only a torn last line (a crash in mid-write) is cut off.

`read_curve` is the one reader of both files (`ratrain.compare`, `plan.calibrate`, the
benchmarks). Its rule for damage: a torn last line (the file does not end in a newline and its
last line is not JSON: a crash in mid-write, which the writer cuts off when the run resumes) is
left out; any other line that is not a JSON object is an error naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ratrain.fileio import append_whole, open_no_follow

EVAL_FILE = "eval.jsonl"
REQUIRED = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "loss_scale",
    "skipped",
    "tokens",
    "step_time_s",
    "tokens_per_s",
    "peak_ddr_bytes",
)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsWriter:
    """Appends one JSON object per step to `<run_dir>/metrics.jsonl` and prints progress.

    Only the writing rank creates one (rank 0 of the last stage, which knows the loss); see
    the module for what a resumed or restarted run appends.
    """

    def __init__(self, run_dir: str, total_steps: int, out=None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.out = out or sys.stdout  # the stream of now (not import time's: it may be replaced)
        self._t0 = time.perf_counter()
        self._steps_timed = 0
        self._time_sum = 0.0
        self.recorded = self._cut_torn_line()  # the last step recorded so far (0: none)
        self._fd = _open_log(self.path)
        self._eval = None

    def _cut_torn_line(self) -> int:
        """Cut a torn last line off the file (nothing else); return the last step recorded."""
        last = 0
        try:
            fd = open_no_follow(self.path, os.O_RDWR)
        except FileNotFoundError:
            return 0
        with os.fdopen(fd, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                f.truncate(end)
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "loss" in rec:
                    last = max(last, int(rec.get("step", 0)))
        return last

    def write(self, rec: dict, flops_per_token: float | None = None, log: bool = True) -> None:
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        rec = {**rec, "rerun": rec["step"] <= self.recorded}
        append_whole(self._fd, (json.dumps(rec) + "\n").encode())  # whole or not at all
        if rec["step"] > 1 or self.total_steps == 1:  # the first step pays warm-up
            self._steps_timed += 1
            self._time_sum += rec["step_time_s"]
        if log:
            self.out.write(self.progress_line(rec, flops_per_token) + "\n")
            self.out.flush()

    def progress_line(self, rec: dict, flops_per_token: float | None) -> str:
        mean = self._time_sum / self._steps_timed if self._steps_timed else rec["step_time_s"]
        eta = mean * (self.total_steps - rec["step"])
        parts = [
            f"step {rec['step']:>5d}/{self.total_steps}",
            f"loss {rec['loss']:.4f}",
            f"gnorm {rec['grad_norm']:.3f}",
            f"lr {rec['lr']:.2e}",
            f"{rec['tokens_per_s']:,.0f} tok/s",
        ]
        if flops_per_token:
            parts.append(f"{rec['tokens_per_s'] * flops_per_token / 1e9:.1f} GFLOP/s")
        if rec.get("mfu") is not None:
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        parts.append(f"peak {_human(rec['peak_ddr_bytes'])}")
        if rec.get("rss_bytes"):
            parts.append(f"rss {_human(rec['rss_bytes'])}")
        if rec.get("skipped"):
            parts.append(f"SKIPPED (overflow, scale -> {rec['loss_scale']:g})")
        if "elapsed_s" in rec:
            parts.append(f"elapsed {_eta(rec['elapsed_s'])}")
        parts.append(f"ETA {_eta(eta)}")
        return " | ".join(parts)

    def event(self, rec: dict) -> None:
        """A record of something that happened to the job (elastic mode's recovery from a lost
        rank: `"event": "rank_lost"`), between the steps; it holds no `step` or `loss`, so
        the curves (`read_curve`) skip it."""
        append_whole(self._fd, (json.dumps(rec) + "\n").encode())

    def write_event(self, rec: dict) -> None:
        """An eval record, to `eval.jsonl` (appended; its own file so that `metrics.jsonl`
        keeps one type per field)."""
        if self._eval is None:
            self._eval = _open_log(os.path.join(os.path.dirname(self.path), EVAL_FILE))
        append_whole(self._eval, (json.dumps(rec) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)
        if self._eval is not None:
            os.close(self._eval)


def _open_log(path: str) -> int:
    """A log's descriptor for appending (created if absent), never through a symbolic link."""
    return open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def read_curve(path: str, key: str = "loss") -> list[dict]:
    """The records holding "step" and `key` of a metrics file, or of a run directory's
    `metrics.jsonl` (`eval.jsonl` for an `eval_*` key), one per step in step order: the last
    record of each step (a re-run replaces the earlier one). A torn last line is left out;
    another line that is not a JSON object raises ValueError naming the file and line."""
    if os.path.isdir(path):
        path = os.path.join(path, EVAL_FILE if key.startswith("eval_") else "metrics.jsonl")
    with open(path) as f:
        text = f.read()
    lines = text.split("\n")  # the last item: "" when the file ends in a newline, else torn?
    by_step: dict[int, dict] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if lineno == len(lines):
                continue  # a torn last line: a crash in mid-write
            raise ValueError(f"{path}:{lineno} is not a JSON object (damaged; only a torn "
                             "last line is left out)") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno} is not a JSON object")
        if "step" in rec and key in rec:
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]
