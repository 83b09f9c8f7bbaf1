"""Fault trials against the trainer, as a user would meet them (issue 14's targets).

    python benchmarks/faults.py stop --trials 20 [--timeout 30]   # kill -STOP a random rank
    python benchmarks/faults.py share --trials 10                  # two runs on one run.dir
    python benchmarks/faults.py diskfull --trials 10               # the checkpoint disk fills (root)
    python benchmarks/faults.py kill9 --trials 70                  # kill -9, restart, compare curves

Every trial runs `python -m ratrain.train` on `jobs/tiny.yaml` (data from `--tokens`, default
the prepared corpus under data/stdlib) in a fresh directory under `--work`, injects its fault,
checks the outcome and prints one JSON line; the last line is a summary. Needs mpirun beside the
interpreter (the stop and kill9 trials at 2 and 4 ranks) and, for diskfull, root (a tmpfs).

stop: a run of 2 or 4 ranks (pp 2, dp 1 or 2; a checkpoint every 2 steps) is started; after a
random 2-10 s, or (every other trial) as soon as a checkpoint shard is being written, one random
rank is stopped with SIGSTOP. Passes when the job ends within timeout + 10 s of the stop, non-zero,
and its output names the stopped rank ("rank R stopped answering").
share: two runs on one run.dir started 0-0.9 s apart in random order; passes when one refuses at
start-up (exit 2, naming the other's PID) and the other finishes with every step recorded once and
every checkpoint verifying.
diskfull: the checkpoint dir is a tmpfs with room for about three checkpoints; from a random save
on (a shard being written) a filler takes all the space left and any freed later. Passes when no committed checkpoint is damaged, the
first error line says "no space left on device" (`mid_write`: the save failed while writing,
not refused up front), a restart on the still-full disk either refuses
at start-up (exit 2) or trains on after pruning ahead (never a crash at the same save), and once
the filler is gone the run finishes with the uninterrupted run's loss curve, bitwise.
kill9: a run (1 process, or 4 ranks pp 2 x dp 2 every fifth trial) is SIGKILLed (one random
rank) after a random 0.5-6 s, then restarted until it finishes; passes when every restart loads
(no damaged checkpoint, no crash) and the final loss curve equals the uninterrupted run's bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MPIRUN = str(Path(PY).with_name("mpirun"))
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1",
           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1")


def cmd(run_dir, ranks=1, sets=(), tokens=""):
    base = [PY, "-m", "ratrain.train", "--config", str(ROOT / "jobs" / "tiny.yaml"),
            "--set", f"run.dir={run_dir}", "--set", f"data.tokens={tokens}",
            "--set", "data.eval_interval=0", "--set", "run.log_interval=1",
            "--set", "checkpoint.resume=auto"]  # tiny.yaml's demo says never: restarts must resume
    for s in sets:
        base += ["--set", s]
    if ranks == 1:
        return base
    return [MPIRUN, "-n", str(ranks), "--oversubscribe", *base]


def launch(c, **kw):
    return subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT, **kw)


def ranks_of(proc) -> dict[int, int]:
    """{world rank: pid} of the python ranks under `proc` (mpirun or the process itself)."""
    out = {}
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ratrain.train" not in cmdline or b"mpirun" in cmdline or b"prterun" in cmdline:
            continue
        rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")), 0)
        out[rank] = pid
    return out


def _descendants(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = [int(k) for k in kids]
    for k in list(out):
        out += _descendants(k)
    return out


def saving(ckpt_root: Path) -> bool:
    """Whether a shard is being written under `ckpt_root` (a temporary shard file exists)."""
    try:
        for d in os.scandir(ckpt_root):
            if d.is_dir(follow_symlinks=False):
                for f in os.scandir(d.path):
                    if f.name.startswith(".shard-") and ".tmp." in f.name:
                        return True
    except OSError:
        return False
    return False


def wait_until(pred, limit: float, step: float = 0.002) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if pred():
            return True
        time.sleep(step)
    return False


def curve(run_dir):
    sys.path.insert(0, str(ROOT))
    from ratrain.job.metrics import read_curve

    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_curve(str(run_dir))]


def verify_all(ckpt_root) -> list[str]:
    from ratrain.checkpoint import is_committed, list_checkpoints, verify_checkpoint

    bad = []
    for _, p in list_checkpoints(str(ckpt_root)):
        if is_committed(p):
            bad += verify_checkpoint(p)
    return bad


# --------------------------------------------------------------------------------------------


def trial_stop(i, rnd, work, a):
    ranks = 2 if i % 2 == 0 else 4
    run = work / f"stop{i}"
    sets = ["parallel.pp=2", f"parallel.dp={ranks // 2}", "run.steps=100000",
            "checkpoint.interval=2", "checkpoint.keep=2", f"comm.timeout={a.timeout}"]
    p = launch(cmd(run, ranks, sets, a.tokens))
    in_save = i % 4 in (1, 2)
    wait_until(lambda: (run / "metrics.jsonl").exists(), 120, 0.05)
    if in_save:
        wait_until(lambda: saving(run / "checkpoints"), 30)
    else:
        time.sleep(rnd.uniform(2, 10))
    victim = rnd.choice(sorted(ranks_of(p)))
    pid = ranks_of(p)[victim]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=a.timeout + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    dt = time.monotonic() - t0
    named = f"rank {victim} stopped answering" in err
    ok = p.returncode not in (0, None) and named and dt <= a.timeout + 10
    return {"trial": i, "ranks": ranks, "stopped": victim, "in_save": in_save,
            "ended_after_s": round(dt, 1), "rc": p.returncode, "named": named, "ok": ok}


def trial_share(i, rnd, work, a):
    run = work / f"share{i}"
    sets = ["run.steps=40", "checkpoint.interval=10"]
    first = launch(cmd(run, 1, sets, a.tokens))
    time.sleep(rnd.uniform(0.0, 0.9))
    second = launch(cmd(run, 1, sets, a.tokens))
    outs = [q.communicate(timeout=600) for q in (first, second)]
    rcs = sorted(q.returncode for q in (first, second))
    refused = [o for q, o in zip((first, second), outs) if q.returncode == 2]
    names_pid = bool(refused) and "in use by another run (pid" in refused[0][1]
    steps = [s for s, _, _ in curve(run)]
    lines = [json.loads(x) for x in open(run / "metrics.jsonl")]
    once = [r["step"] for r in lines if "loss" in r] == list(range(1, 41))
    bad = verify_all(run / "checkpoints")
    ok = rcs == [0, 2] and names_pid and once and steps == list(range(1, 41)) and not bad
    return {"trial": i, "rcs": rcs, "refusal_names_pid": names_pid, "steps_once": once,
            "damaged": len(bad), "ok": ok}


def trial_diskfull(i, rnd, work, a, reference):
    mnt = work / f"disk{i}"
    mnt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(mnt)], check=True)
    try:
        return _diskfull(i, rnd, work, a, reference, mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


class Filler:
    """Takes every byte of free space on a file system, and any freed later, until stopped."""

    def __init__(self, path: Path):
        import threading

        self.path, self.stop = path, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with open(self.path, "wb", buffering=0) as f:
            while not self.stop.is_set():
                try:
                    f.write(b"\0" * (64 << 10))
                except OSError:
                    time.sleep(0.001)

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


def _diskfull(i, rnd, work, a, reference, mnt):
    run, ck = work / f"diskrun{i}", mnt / "ck"
    sets = ["run.steps=40", "checkpoint.interval=4", "checkpoint.keep=2", f"checkpoint.dir={ck}"]
    p = launch(cmd(run, 1, sets, a.tokens))
    at = 4 * rnd.randint(1, 6)  # fill from the save after this step on

    def reached():
        steps = [int(d.name[5:]) for d in ck.glob("ckpt-*")]
        return max(steps, default=0) >= at or p.poll() is not None

    wait_until(reached, 300, 0.01)
    wait_until(lambda: saving(ck) or p.poll() is not None, 60, 0.0005)
    filler = Filler(mnt / "filler")
    out, err = p.communicate(timeout=600)
    first_error = next((x for x in err.splitlines() if x.startswith("error:")), "")
    damaged = verify_all(ck)
    restarts = []
    for _ in range(2):  # restarts on the still-full disk: refuse up front, or progress
        q = launch(cmd(run, 1, sets, a.tokens))
        o, e = q.communicate(timeout=600)
        restarts.append(q.returncode)
        damaged += verify_all(ck)
        if q.returncode in (0, 2):
            break
    filler.end()
    (mnt / "filler").unlink()
    committed = any((d / "manifest.json").exists() for d in ck.glob("ckpt-*"))
    final = launch(cmd(run, 1, sets, a.tokens))
    fo, fe = final.communicate(timeout=600)
    resumed = "resume auto: resuming from" in fo + fe
    damaged += verify_all(ck)
    same = curve(run) == reference
    space_first = p.returncode == 0 or first_error.startswith("error: no space left on device")
    ok = (not damaged and space_first and final.returncode == 0 and same
          and (resumed or not committed)
          and all(r in (0, 2, 5) for r in restarts))
    return {"trial": i, "rc": p.returncode, "first_error": first_error[:90],
            "mid_write": "nothing was written" not in first_error, "restarts": restarts,
            "final_rc": final.returncode, "committed_before_final": committed, "final_resumed": resumed, "damaged": len(damaged),
            "curve_equal": same, "ok": ok}


def trial_kill9(i, rnd, work, a, references):
    ranks = 4 if i % 5 == 4 else 1
    run = work / f"kill{i}"
    sets = ["run.steps=20", "checkpoint.interval=2", "checkpoint.keep=2"]
    if ranks == 4:
        sets += ["parallel.pp=2", "parallel.dp=2"]
    p = launch(cmd(run, ranks, sets, a.tokens))
    wait_until(lambda: (run / "metrics.jsonl").exists(), 120, 0.05)
    if i % 2:
        wait_until(lambda: saving(run / "checkpoints"), 20, 0.0005)
    else:
        time.sleep(rnd.uniform(0.5, 6))
    victims = ranks_of(p)
    hit_save = saving(run / "checkpoints")
    if victims:
        os.kill(victims[rnd.choice(sorted(victims))], signal.SIGKILL)
    p.communicate(timeout=120)
    crashes = damaged = resumed = 0
    committed = any((d / "manifest.json").exists() for d in (run / "checkpoints").glob("ckpt-*"))
    for _ in range(5):
        damaged += len(verify_all(run / "checkpoints"))
        q = launch(cmd(run, ranks, sets, a.tokens))
        o, e = q.communicate(timeout=600)
        resumed += "resume auto: resuming from" in o + e
        if q.returncode == 0:
            break
        crashes += 1
    same = curve(run) == references[ranks]
    return {"trial": i, "ranks": ranks, "in_save": hit_save, "crashes_on_restart": crashes,
            "damaged": damaged, "committed_before": committed, "resumed": resumed > 0,
            "curve_equal": same,
            "ok": same and not crashes and not damaged and (resumed > 0 or not committed)}


# --------------------------------------------------------------------------------------------


def reference(work, a, name, ranks, sets):
    run = work / name
    if not (run / "metrics.jsonl").exists():
        q = launch(cmd(run, ranks, sets, a.tokens))
        o, e = q.communicate(timeout=1200)
        if q.returncode:
            raise SystemExit(f"the reference run failed:\n{o}\n{e}")
    return curve(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["stop", "share", "diskfull", "kill9"])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=30.0, help="comm.timeout of the stop trials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/ratrain-faults")
    ap.add_argument("--tokens", default=str(ROOT / "data" / "stdlib" / "train.bin"))
    a = ap.parse_args(argv)
    work = Path(a.work) / a.kind
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rnd = random.Random(a.seed)
    print(json.dumps({"kind": a.kind, "load": os.getloadavg(), "host": os.uname().nodename}),
          flush=True)
    extra = ()
    if a.kind == "diskfull":
        extra = (reference(work, a, "ref", 1, ["run.steps=40"]),)
    elif a.kind == "kill9":
        extra = ({1: reference(work, a, "ref1", 1, ["run.steps=20"]),
                  4: reference(work, a, "ref4", 4, ["run.steps=20", "parallel.pp=2",
                                                     "parallel.dp=2"])},)
    trial = {"stop": trial_stop, "share": trial_share, "diskfull": trial_diskfull,
             "kill9": trial_kill9}[a.kind]
    rows = []
    for i in range(a.trials):
        row = trial(i, rnd, work, a, *extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"kind": a.kind, "trials": len(rows), "passed": sum(r["ok"] for r in rows),
               "load_after": os.getloadavg()}
    if a.kind == "stop":
        ends = [r["ended_after_s"] for r in rows]
        summary.update(max_end_s=max(ends), median_end_s=statistics.median(ends),
                       in_save=sum(r["in_save"] for r in rows))
    print(json.dumps(summary), flush=True)
    return 0 if summary["passed"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
