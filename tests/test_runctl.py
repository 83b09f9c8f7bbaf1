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


def test_status_is_fixed_size_and_updated_in_place(tmp_path):
    from ratrain.job.runctl import STATUS_BYTES, write_status

    write_status(str(tmp_path), 0)
    ino = (tmp_path / "status.json").stat().st_ino
    write_status(str(tmp_path), 7, 5, "no space left on device", state="write failed")
    st = (tmp_path / "status.json").stat()
    assert st.st_ino == ino and st.st_size == STATUS_BYTES  # in place: no new room needed
    got = json.loads((tmp_path / "status.json").read_text())
    assert got["state"] == "write failed" and got["exit"] == 5 and got["step"] == 7
    assert got["why"] == "no space left on device"


@pytest.mark.parametrize("body, code, state", [
    ("raise RuntimeError('boom')", 1, "failed"),
    ("abort.abort(None, 76, 'a second signal')", 76, "interrupted"),
    ("abort.abort(None, 3, 'rank 1 stopped answering')", 3, "a rank stopped answering"),
])
def test_a_run_that_dies_says_so_in_its_status(tmp_path, body, code, state):
    """Every end that leaves a process alive to write it: the state, exit code, step and why
    (the trainer's hook on rank 0, run by abort; a watchdog notice runs it on survivors)."""
    import subprocess
    import sys

    script = (f"from ratrain.job import abort\nfrom ratrain.job.runctl import write_status\n"
              f"write_status({str(tmp_path)!r}, 0)\n"
              f"abort.on_end(lambda c, why: write_status({str(tmp_path)!r}, 12, c, why))\n"
              f"with abort.abort_on_error():\n    {body}\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stderr
    got = json.loads((tmp_path / "status.json").read_text())
    assert (got["state"], got["exit"], got["step"]) == (state, code, 12)
    assert got["why"]
