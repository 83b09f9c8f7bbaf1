"""Run control: the run directory's lock (held, refused, taken over from a dead holder, never
through a link) and stop requests (signals, second signal, grace, time limit)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ratrain.config import load_config
from ratrain.job.runctl import (
    EXIT_INTERRUPTED,
    LOCK_NAME,
    RunLock,
    RunLocked,
    StopRequests,
    lock_dirs,
)

HOLD = """
import sys, time
from ratrain.job.runctl import RunLock
lock = RunLock.acquire(sys.argv[1])
print("HELD", flush=True)
time.sleep(60)
"""


def _holder(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "HELD"
    return p


def test_a_second_run_is_refused_naming_host_and_pid(tmp_path):
    p = _holder(tmp_path)
    try:
        with pytest.raises(RunLocked) as e:
            RunLock.acquire(str(tmp_path / "run"))
        msg = str(e.value)
        assert f"pid {p.pid} on host" in msg and "in use by another run" in msg
        assert str(tmp_path / "run" / LOCK_NAME) in msg
    finally:
        p.kill()
        p.wait()
    # its holder was killed: the lock is taken over, with a message naming it
    lock = RunLock.acquire(str(tmp_path / "run"))
    assert lock.note and f"pid {p.pid}" in lock.note and "taking over" in lock.note
    info = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert info["pid"] == os.getpid()
    lock.release()
    again = RunLock.acquire(str(tmp_path / "run"))  # released cleanly: nothing to take over
    assert again.note is None
    again.release()


def test_the_lock_file_is_never_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "run").mkdir()
    os.symlink(victim, tmp_path / "run" / LOCK_NAME)
    with pytest.raises(OSError):
        RunLock.acquire(str(tmp_path / "run"))
    assert victim.read_text() == "keep"


def test_checkpoint_dir_outside_the_run_is_locked_too(tmp_path):
    locks = lock_dirs(str(tmp_path / "run"), str(tmp_path / "ck"), print)
    assert len(locks) == 2 and (tmp_path / "ck" / LOCK_NAME).exists()
    with pytest.raises(RunLocked, match="checkpoint.dir"):
        lock_dirs(str(tmp_path / "run2"), str(tmp_path / "ck"), print)
    assert not (tmp_path / "run2" / LOCK_NAME).read_text()  # run2's lock was given back
    for lock in locks:
        lock.release()
    inside = lock_dirs(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints"), print)
    assert len(inside) == 1
    inside[0].release()


def _run_cfg(*sets):
    return load_config(None, list(sets)).run


def test_first_signal_asks_to_stop_second_exits_at_once():
    exits = []
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequests(_run_cfg("run.stop_signals=[USR1]"), lambda code, why: exits.append(code))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.local_reason(1.0, 1.0) == "SIGUSR1" and not exits
        os.kill(os.getpid(), signal.SIGUSR1)  # the same request delivered twice: ignored
        assert not exits
        stop.t_request -= 3.0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert exits == [EXIT_INTERRUPTED]
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) is before  # the handler is given back


def test_grace_runs_out():
    exits = []
    stop = StopRequests(_run_cfg("run.stop_grace=1"), lambda code, why: exits.append((code, why)),
                        install=False)
    stop.request("SIGTERM")
    time.sleep(1.5)
    stop.close()
    assert exits and exits[0][0] == EXIT_INTERRUPTED and "run.stop_grace=1" in exits[0][1]


def test_time_limit_leaves_room_for_a_step_and_a_checkpoint():
    now = [0.0]
    stop = StopRequests(_run_cfg("run.time_limit=100"), None, install=False, clock=lambda: now[0])
    now[0] = 80.0
    assert stop.local_reason(step_s=5.0, save_s=5.0) is None  # 20 s left > 2 x 5 + 5
    now[0] = 86.0
    assert "run.time_limit=100" in stop.local_reason(step_s=5.0, save_s=5.0)
    stop.close()
