"""One failing rank stops the job: a DDR-cap error on one rank ends every rank within 10 s."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

SCRIPT = r'''
import sys, time
import numpy as np
from mpi4py import MPI
from ratrain.job.abort import abort_on_error
from ratrain.comm.engine import CommEngine
from ratrain.shim.ledger import Ledger

cap = int(float(sys.argv[1]) * 2**20)
r = MPI.COMM_WORLD.Get_rank()
with abort_on_error():
    eng = CommEngine(MPI.COMM_WORLD, watchdog_s=600)
    led = Ledger(cap=cap, rank=r)
    a = led.alloc("params.master", (2**20,), np.float32)  # 4 MiB
    if r == 1:
        print(f"FAIL_AT {time.time()}", flush=True)
        led.alloc("activations.mb3.layers.5", (2**20,), np.float32)  # 4 MiB more
    eng.allreduce(a, MPI.COMM_WORLD, "ring").result()  # the others wait here for rank 1
    eng.close()
print("DONE", r, flush=True)
'''

MPIRUN = Path(sys.executable).with_name("mpirun")
pytestmark = pytest.mark.skipif(
    MPI.COMM_WORLD.Get_size() > 1 or not (MPIRUN.exists() or shutil.which("mpirun")),
    reason="launches its own mpirun (run without mpirun)",
)


def launch(tmp_path, cap_mib, ranks=3):
    script = tmp_path / "cap.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    cmd = [mpirun, "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-n", str(ranks),
           sys.executable, str(script), str(cap_mib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return proc, time.time()


def test_cap_error_on_one_rank_stops_every_rank(tmp_path):
    proc, _ = launch(tmp_path, cap_mib=6)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode != 0
    assert "DONE" not in out  # no rank got past the failure
    assert "[rank 1] DDRCapExceeded: rank 1: DDR cap exceeded allocating 4.00 MiB (4194304 B) for " \
           "'activations.mb3.layers.5': in use 4.00 MiB (4194304 B), cap 6.00 MiB (6291456 B); " \
           "largest users: params.master=4.00 MiB" in err, err


@pytest.mark.timing
def test_cap_error_on_one_rank_stops_every_rank_within_10s(tmp_path):
    proc, t_end = launch(tmp_path, cap_mib=6)
    assert proc.returncode != 0
    t_fail = float(next(line.split()[1] for line in proc.stdout.splitlines()
                        if line.startswith("FAIL_AT")))
    assert t_end - t_fail < 10, f"took {t_end - t_fail:.1f} s to stop"


def test_run_under_the_cap_finishes(tmp_path):
    proc, _ = launch(tmp_path, cap_mib=16)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("DONE")) == [
        "DONE 0", "DONE 1", "DONE 2"]
