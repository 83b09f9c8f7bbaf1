"""The batch scripts on a real Slurm (issue 11's targets), against a cluster such as
`scripts/slurm-local.sh` brings up (two slurmd as two nodes on this host):

    scripts/slurm-local.sh run /tmp/ratrain-slurm python benchmarks/slurm_trials.py all --trials 10
    ... slurm_trials.py signals --trials 10 | timelimit | chain | array | nodes | quick | elastic

Every job is `slurm/train.sbatch` (or `correctness.sbatch`) on `jobs/tiny.yaml` at 4 ranks
(pp 2 x dp 2), submitted from a directory outside the repository; the reference is the same run
uninterrupted (the same script, launcher and layout). One JSON line per trial, a summary last;
exit 1 if any failed.

signals: `scancel --signal=SIG JOB` (SIG = USR1 and TERM) once the run has recorded a random
number of steps, for each launcher (srun --mpi=pmix on 2 nodes x 2 tasks; mpirun on 1 node x 4
tasks); passes when the run stopped with a checkpoint at the step it had reached, the job was
requeued and finished, no step was trained twice and the loss curve equals the reference bitwise.
timelimit: a job with a 1-minute limit (and --signal=B:USR1@40) requeues itself until the run is
done. chain: the same without requeue, chained three times with --dependency=afterany. array:
--array=0-3%1. Each passes when the run finishes with the reference's curve bitwise and the jobs
that start after it finished exit 0 within 10 s. nodes: a 2-node job with srun+pmix, one with
mpirun, and correctness.sbatch. quick: one USR1 trial per launcher against one reference run (srun's:
a run is bitwise the same however its ranks are packed into nodes) and a finished-run job (the test
suite's version). elastic: a job with elastic.enabled on 2 nodes x 3 tasks (pp 2 x dp 3; the
script launches it with mpirun --with-ft ulfm), one rank SIGKILLed once the run has recorded a
random number of steps; passes when the job ends COMPLETED and never requeued, with one
rank_lost event and every step trained (the survivors went on as pp 2 x dp 2).

A job requeued by Slurm waits (BeginTime) as long as a job credential lives before it may start
again: two minutes by default, 10 s on the cluster scripts/slurm-local.sh brings up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/ratrain-slurm-trials")  # --work: run directories, logs, the submit directory
STEPS = 60
SETS = ["parallel.pp=2", "parallel.dp=2", "data.eval_interval=0", "run.log_interval=5",
        "checkpoint.interval=20"]
# srun --mpi=pmix with the pip wheel: at most 2 tasks per node here (see scripts/slurm-local.sh);
# mpirun on one node, the batch node (named after this host by slurm-local.sh).
LAYOUT = {"srun": ["-N", "2", "--ntasks-per-node=2"],
          "mpirun": ["-N", "1", "-n", "4", f"--nodelist={os.uname().nodename}"]}


def run_dir(name) -> Path:
    return WORK / "runs" / name


def env(launcher="srun", name="", **extra):
    e = dict(os.environ, PYTHONPATH=str(ROOT), RATRAIN_LAUNCHER=launcher,
             RATRAIN_VENV=os.environ.get("RATRAIN_VENV", str(ROOT / ".venv")),
             RATRAIN_LOG_DIR=str(WORK / "logs"), RATRAIN_RUN_DIR=str(run_dir(name)))
    if launcher == "mpirun":
        e["RATRAIN_MPIRUN_ARGS"] = "--oversubscribe --bind-to none"
    if os.geteuid() == 0:
        e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    e.update(extra)
    return e


def sets_args(tokens, steps=STEPS, extra=()):
    out = []
    for s in [f"data.tokens={tokens}", f"run.steps={steps}", *SETS, *extra]:
        out += ["--set", s]
    return out


def sbatch(args, e, script="train.sbatch"):
    p = subprocess.run(["sbatch", "--parsable", *args[0], str(ROOT / "slurm" / script), *args[1]],
                       capture_output=True, text=True, env=e, cwd=WORK)
    if p.returncode:
        raise RuntimeError(f"sbatch failed: {p.stderr}")
    return p.stdout.strip().split(";")[0]


def job(jid) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True,
                         text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(jid, until, limit=900.0) -> dict:
    """Poll job `jid` until `until(info)` holds twice 3 s apart (a job that requeues itself may
    show as ended for a moment)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        info = job(jid)
        if until(info):
            time.sleep(3)
            again = job(jid)
            if until(again):
                return again
            continue
        time.sleep(0.5)
    raise TimeoutError(f"job {jid}: {job(jid)}")


def finished(info) -> bool:
    return info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                    "OUT_OF_MEMORY")


def records(run_dir):
    out = []
    try:
        lines = open(run_dir / "metrics.jsonl").read().splitlines()
    except OSError:
        return out
    for x in lines:
        with contextlib.suppress(ValueError):  # the line being written
            out.append(json.loads(x))
    return out


def curve(run_dir):
    sys.path.insert(0, str(ROOT))
    from ratrain.job.metrics import read_curve

    if not (Path(run_dir) / "metrics.jsonl").exists():
        return []
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_curve(str(run_dir))]


def reference(tokens, steps, launcher):
    """The uninterrupted run's curve: the same job through the same script and launcher."""
    name = f"ref-{launcher}-{steps}"
    run = run_dir(name)
    if len(curve(run)) != steps:
        shutil.rmtree(run, ignore_errors=True)
        jid = sbatch((["-J", name, *LAYOUT[launcher]],
                      ["jobs/tiny.yaml", *sets_args(tokens, steps)]), env(launcher, name))
        info = wait_job(jid, finished, limit=1800)
        if info["JobState"] != "COMPLETED":
            raise SystemExit(f"the reference job {jid} failed: {logs(name, jid)[-2000:]}")
    return curve(run)


def logs(name, jid):
    return "\n".join(p.read_text() for p in (WORK / "logs").glob(f"{name}-{jid}*.out"))


# --------------------------------------------------------------------------------------------


def trial_signal(i, sig, launcher, rnd, tokens, ref):
    name = f"sig-{launcher}-{sig}-{i}"
    run = run_dir(name)
    shutil.rmtree(run, ignore_errors=True)
    jid = sbatch((["-J", name, *LAYOUT[launcher]], ["jobs/tiny.yaml", *sets_args(tokens)]),
                 env(launcher, name))
    at = rnd.randint(3, STEPS - 10)
    t0 = time.monotonic()
    while sum("loss" in r for r in records(run)) < at:
        if time.monotonic() - t0 > 300 or finished(job(jid)):
            break
        time.sleep(0.02)
    seen = sum("loss" in r for r in records(run))
    subprocess.run(["scancel", f"--signal={sig}", jid], check=True)
    info = wait_job(jid, lambda j: finished(j) and j.get("JobState") != "PENDING")
    text = logs(name, jid)
    m = re.search(r"stopped at step (\d+)", text)
    stopped = int(m.group(1)) if m else None
    recs = records(run)
    rerun = sum(bool(r.get("rerun")) for r in recs)
    same = curve(run) == ref
    ok = (info["JobState"] == "COMPLETED" and stopped is not None and int(info["Restarts"]) >= 1
          and f"ckpt-{stopped:06d} (" in text and rerun == 0 and same)
    return {"trial": i, "signal": sig, "launcher": launcher, "signalled_after_step": seen,
            "stopped_at": stopped, "restarts": int(info["Restarts"]), "rerun_steps": rerun,
            "curve_equal": same, "state": info["JobState"], "ok": ok}


def _run_of_jobs(kind, tokens, ref, steps, launcher="srun"):
    """Jobs with a 1-minute limit: requeued (timelimit), chained (chain) or an array."""
    name = f"{kind}-{launcher}"
    run = run_dir(name)
    shutil.rmtree(run, ignore_errors=True)
    base = ["-J", name, "-t", "1", "--signal=B:USR1@40", *LAYOUT[launcher]]
    args = ["jobs/tiny.yaml", *sets_args(tokens, steps)]
    e = env(launcher, name)
    if kind == "timelimit":
        jids = [sbatch((base, args), e)]
    elif kind == "chain":
        jids = [sbatch((base + ["--no-requeue"], args), e)]
        for _ in range(3):
            jids.append(sbatch((base + ["--no-requeue", f"--dependency=afterany:{jids[-1]}"],
                                args), e))
    else:
        arr = sbatch((base + ["--no-requeue", "--array=0-3%1"], args), e)
        jids = [f"{arr}_{t}" for t in range(4)]
    rows = []
    for jid in jids:
        info = wait_job(jid, lambda j: finished(j) and j.get("JobState") != "PENDING",
                        limit=1800)
        rows.append(info)
    text = "".join(logs(name, j.get("JobId", "")) for j in rows)
    surplus = [j for j in rows if "the run is finished" in logs(name, j.get("JobId", ""))]
    surplus_s = [_seconds(j.get("RunTime", "0")) for j in surplus]
    same = curve(run) == ref
    ok = (all(j["JobState"] == "COMPLETED" for j in rows) and same
          and all(s < 10 for s in surplus_s) and "stopped at step" in text)
    return {"kind": kind, "launcher": launcher, "jobs": len(rows),
            "restarts": [int(j.get("Restarts", 0)) for j in rows],
            "stops": len(re.findall("stopped at step", text)), "surplus_s": surplus_s,
            "curve_equal": same, "ok": ok}


def _seconds(runtime: str) -> int:
    parts = [int(x) for x in re.split("[:-]", runtime)]
    out = 0
    for p in parts:
        out = out * 60 + p
    return out


def trial_nodes(tokens):
    rows = []
    for launcher in ("srun", "mpirun"):
        name = f"nodes-{launcher}"
        shutil.rmtree(run_dir(name), ignore_errors=True)
        jid = sbatch((["-J", name, "-N", "2", "--ntasks-per-node=2"],
                      ["jobs/tiny.yaml", *sets_args(tokens, 20)]), env(launcher, name))
        info = wait_job(jid, finished)
        rows.append({"job": f"train.sbatch -N 2 --ntasks-per-node=2, {launcher}",
                     "nodes": info.get("NodeList"), "state": info["JobState"],
                     "ok": info["JobState"] == "COMPLETED" and info.get("NumNodes") == "2"})
    jid = sbatch((["-N", "2", "--ntasks-per-node=2"],
                  ["jobs/correctness.yaml", "--set", f"data.tokens={tokens}", "--set",
                   "run.steps=20"]), env("srun", "correctness"), "correctness.sbatch")
    info = wait_job(jid, finished)
    text = logs("ratrain-correctness", jid)
    rows.append({"job": "correctness.sbatch -N 2 --ntasks-per-node=2", "state": info["JobState"],
                 "compare": (re.findall(r"max_rel_dev=\S+ steps=\d+", text) or [""])[0],
                 "ok": info["JobState"] == "COMPLETED" and "max_rel_dev=0" in text})
    return rows


def trial_finished(tokens, ref_steps):
    """A job on a finished run: says so and exits 0 at once."""
    name = "sig-srun-USR1-0"
    jid = sbatch((["-J", name, *LAYOUT["srun"]], ["jobs/tiny.yaml", *sets_args(tokens)]),
                 env("srun", name))
    info = wait_job(jid, finished)
    secs = _seconds(info.get("RunTime", "0"))
    said = "the run is finished" in logs(name, jid)
    return {"kind": "finished", "state": info["JobState"], "run_s": secs, "said": said,
            "ok": info["JobState"] == "COMPLETED" and said and secs < 10}


def _rank_pids(run):
    """The PIDs of the training ranks of run directory `run` (not mpirun, not a shell)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"ratrain.train" in argv and f"run.dir={run}".encode() in argv
                and Path(argv[0].decode()).name.startswith("python")):
            out.append(int(d.name))
    return sorted(out)


def trial_elastic(i, rnd, tokens, steps=40):
    """Elastic mode under Slurm: a pp 2 x dp 3 job on 2 nodes x 3 tasks (mpirun --with-ft ulfm,
    as train.sbatch launches it), one rank SIGKILLed once the run has recorded a random number of
    steps; passes when the job ends COMPLETED, never requeued, the survivors' event recorded
    and every step trained."""
    name = f"elastic-mpirun-{i}"
    run = run_dir(name)
    shutil.rmtree(run, ignore_errors=True)
    layout = ["-N", "2", "--ntasks-per-node=3"]
    jid = sbatch((["-J", name, *layout],
                  ["jobs/tiny.yaml", *sets_args(tokens, steps, ["parallel.dp=3",
                                                                "elastic.enabled=true"])]),
                 env("mpirun", name))
    at = rnd.randint(3, steps - 15)
    t0 = time.monotonic()
    while len([r for r in records(run) if "loss" in r]) < at:
        if finished(job(jid)) or time.monotonic() - t0 > 600:
            return {"case": i, "kind": "elastic", "ok": False, "why": f"job {jid} ended or stalled before "
                    f"step {at}", "log": logs(name, jid)[-1500:]}
        time.sleep(0.2)
    pids = _rank_pids(run)
    victim = rnd.choice(pids)
    os.kill(victim, 9)
    info = wait_job(jid, finished)
    ev = [r for r in records(run) if r.get("event") == "rank_lost"]
    steps_done = sorted({r["step"] for r in records(run) if "loss" in r})
    ok = (info["JobState"] == "COMPLETED" and info.get("Restarts") == "0" and len(ev) == 1
          and steps_done == list(range(1, steps + 1)))
    return {"case": i, "kind": "elastic", "killed_at_step": at, "ranks": len(pids), "state":
            info["JobState"], "restarts": info.get("Restarts"), "event": ev[0] if ev else None,
            "steps": len(steps_done), "ok": ok}


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["all", "signals", "timelimit", "chain", "array", "nodes",
                                     "quick", "elastic"])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--tokens", default=str(ROOT / "data" / "stdlib" / "train.bin"))
    ap.add_argument("--long-steps", type=int, default=400, help="run.steps of the 1-minute jobs")
    ap.add_argument("--work", default="/tmp/ratrain-slurm-trials",
                    help="run directories, logs, the submit directory")
    a = ap.parse_args(argv)
    global WORK
    WORK = Path(a.work)
    if not os.environ.get("SLURM_CONF") and not shutil.which("sinfo"):
        raise SystemExit("no Slurm: run under scripts/slurm-local.sh run STATE ...")
    WORK.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(a.seed)
    print(json.dumps({"what": a.what, "load": os.getloadavg()}), flush=True)
    rows = []

    def out(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    if a.what in ("all", "signals", "quick"):
        n = 1 if a.what == "quick" else a.trials
        sigs = ("USR1",) if a.what == "quick" else ("USR1", "TERM")
        for launcher in ("srun", "mpirun"):
            # quick: one reference for both launchers (a run is bitwise the same however its
            # ranks are packed into nodes, so srun's 2 nodes and mpirun's one give one curve)
            ref = reference(a.tokens, STEPS, "srun" if a.what == "quick" else launcher)
            for sig in sigs:
                for i in range(n):
                    out(trial_signal(i, sig, launcher, rnd, a.tokens, ref))
    if a.what == "quick":
        out(trial_finished(a.tokens, STEPS))
    if a.what in ("all", "timelimit", "chain", "array"):
        long_ref = reference(a.tokens, a.long_steps, "srun")
        for kind in ("timelimit", "chain", "array"):
            if a.what in ("all", kind):
                out(_run_of_jobs(kind, a.tokens, long_ref, a.long_steps))
    if a.what in ("all", "nodes"):
        for row in trial_nodes(a.tokens):
            out(row)
    if a.what in ("all", "elastic"):
        for i in range(1 if a.what == "all" else a.trials):
            out(trial_elastic(i, rnd, a.tokens))
    summary = {"trials": len(rows), "passed": sum(r["ok"] for r in rows),
               "load_after": os.getloadavg()}
    print(json.dumps(summary), flush=True)
    return 0 if summary["passed"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
