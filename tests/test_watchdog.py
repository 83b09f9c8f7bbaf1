"""The job's watchdog, under a real mpirun: a rank stopped with SIGSTOP anywhere (a control-plane
gather, an engine receive) ends the job on every rank within the timeout, naming the stopped
rank; an error on one rank is reported by every rank; a clean end leaves nothing behind."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

SCRIPT = r'''
import os, signal, sys, time
import numpy as np
from mpi4py import MPI
from ratrain.job.abort import abort_on_error
from ratrain.job.control import Control
from ratrain.comm.engine import CommEngine
from ratrain.shim.ledger import Ledger

case, timeout = sys.argv[1], float(sys.argv[2])
world = MPI.COMM_WORLD
r = world.Get_rank()
ctl = Control.for_job(world, timeout)
with abort_on_error():
    if case == "clean":
        for i in range(3):
            assert ctl.allgather(r) == list(range(world.Get_size()))
            ctl.barrier()
            time.sleep(0.3)
    elif case == "gather":  # rank 1 stops as a rank writing its checkpoint shard would
        ctl.watchdog.doing("writing its shard")
        time.sleep(1.0)  # the activity reaches the monitor with the next heartbeat
        if r == 1:
            print(f"STOP {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        ctl.gather(r, root=0)
        ctl.bcast(None, root=0)
    elif case == "engine":  # rank 0 waits in an engine receive (its own timeout is shorter)
        eng = CommEngine(world, watchdog_s=timeout / 2)
        eng.attach(ctl.watchdog)
        buf = np.zeros(4)
        if r == 1:
            print(f"STOP {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if r == 0:
            eng.recv(buf, 1, tag=5).result()
        else:
            eng.recv(buf, 0, tag=5).result()
    elif case == "cap":  # an error on one rank: every rank says why the job ends
        led = Ledger(cap=2**20, rank=r)
        if r == 1:
            time.sleep(0.5)
            led.alloc("activations.mb0.layers.3", (2**19,), np.float32)
        ctl.barrier()
ctl.close()
print("DONE", r, flush=True)
'''

MPIRUN = Path(sys.executable).with_name("mpirun")
pytestmark = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 1 or not (MPIRUN.exists() or shutil.which("mpirun")),
    reason="launches its own mpirun (run without mpirun)",
)


def launch(tmp_path, case, ranks=3, timeout=3.0):
    script = tmp_path / "wd.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    cmd = [mpirun, "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-n", str(ranks),
           sys.executable, str(script), case, str(timeout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return proc, time.time()


@pytest.mark.parametrize("case", ["gather", "engine"])
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path, case):
    proc, t_end = launch(tmp_path, case)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "DONE" not in proc.stdout
    assert "rank 1 stopped answering: no sign of life for" in proc.stderr, proc.stderr
    assert "comm.timeout=3" in proc.stderr and "pid" in proc.stderr
    if case == "gather":
        assert "last doing: writing its shard" in proc.stderr
    else:  # the engine's own (shorter) timeout left the naming to the watchdog
        assert "CommTimeout" not in proc.stderr
    # every live rank said why the job ended
    for r in (0, 2):
        assert f"[rank {r}] error:" in proc.stderr and "rank 1 stopped answering" in proc.stderr
    t_stop = float(next(x.split()[1] for x in proc.stdout.splitlines() if x.startswith("STOP")))
    assert t_end - t_stop > 2.5  # not before the timeout


@pytest.mark.timing
def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    proc, t_end = launch(tmp_path, "gather", timeout=5.0)
    t_stop = float(next(x.split()[1] for x in proc.stdout.splitlines() if x.startswith("STOP")))
    assert t_end - t_stop < 5.0 + 5, f"took {t_end - t_stop:.1f} s"


def test_an_error_on_one_rank_is_reported_by_every_rank(tmp_path):
    proc, _ = launch(tmp_path, "cap")
    assert proc.returncode != 0
    for r in (0, 2):
        assert f"[rank {r}] error: the job ends: rank 1 failed: DDRCapExceeded: rank 1: DDR cap " \
               "exceeded" in proc.stderr, proc.stderr
    assert "[rank 1] DDRCapExceeded" in proc.stderr


def test_a_clean_end_closes_the_watchdog(tmp_path):
    proc, _ = launch(tmp_path, "clean")
    assert proc.returncode == 0, proc.stderr
    assert sorted(x for x in proc.stdout.splitlines() if x.startswith("DONE")) == [
        "DONE 0", "DONE 1", "DONE 2"]
    assert "warning" not in proc.stderr


def test_a_stopped_rank_ends_a_training_job(tmp_path):
    """The trainer under mpirun: rank 1 stopped mid-training ends the job, named, exit 3."""
    from ratrain.data import write_tokens
    from tests.test_train import TINY

    import numpy as np

    write_tokens(tmp_path / "t.bin", np.random.default_rng(0).integers(0, 64, 20000), vocab_size=64)
    (tmp_path / "job.yaml").write_text(TINY + f"data: {{tokens: {tmp_path}/t.bin}}\n")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    p = subprocess.Popen(
        [mpirun, "--oversubscribe", "-n", "2", sys.executable, "-m", "ratrain.train", "--config",
         str(tmp_path / "job.yaml"), "--set", "parallel.pp=2", "--set", "run.steps=100000",
         "--set", "checkpoint.interval=5", "--set", "comm.timeout=3", "--set",
         f"run.dir={tmp_path}/run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    for line in p.stdout:
        if "checkpoint saved:" in line and "ckpt-000010" in line:
            break
    ranks = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout
    pids = sorted(int(x) for x in ranks.split())
    victim = next(q for q in pids if b"OMPI_COMM_WORLD_RANK=1\0" in
                  Path(f"/proc/{q}/environ").read_bytes())
    os.kill(victim, 19)  # SIGSTOP
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert "rank 1 stopped answering" in err and f"pid {victim}" in err


def test_the_control_plane_calls_busy_only_ranks_that_answer():
    """A long wait says "busy, not stopped" only when the watchdog still hears the ranks waited
    for; a silent one is the watchdog's to name (no warning contradicting its error)."""
    import io

    from ratrain.job.control import Control

    class Dog:
        timeout = 0.05

        def __init__(self, silent):
            self._silent = silent

        def silent(self, ranks):
            return self._silent

    for silent, said in ((True, False), (False, True)):
        out = io.StringIO()
        ctl = Control(MPI.COMM_SELF, Dog(silent), out=out)
        t0 = time.monotonic()
        ctl._wait(lambda t0=t0: time.monotonic() - t0 > 0.3, "a gather", lambda: [1])
        ctl.comm.Free()
        assert ("busy, not stopped" in out.getvalue()) == said, out.getvalue()
