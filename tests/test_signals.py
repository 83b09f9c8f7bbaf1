"""Stop signals from the first instruction of `python -m ratrain.train` (`ratrain.job.early`):
a stop asked before training starts exits 75 at once with one line saying nothing was trained,
whatever the phase; after the run ended, a signal exits with the run's own code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratrain.config.run import RunConfig
from ratrain.job import early

ROOT = Path(__file__).resolve().parents[1]


def test_the_early_signals_are_run_stop_signals_default():
    assert RunConfig().stop_signals == early.DEFAULT_SIGNALS


def caught(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc/PID/status SigCgt)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(ln for ln in text.splitlines() if ln.startswith("SigCgt")).split()[1], 16)
    return bool(mask >> (sig - 1) & 1)


def _wait_caught(p, sig: int, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not caught(p.pid, sig):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.002)


@pytest.mark.parametrize("sig,sets", [(signal.SIGUSR1, []), (signal.SIGTERM, []),
                                      (signal.SIGUSR2, ["--set", "run.stop_signals=[USR2]"])])
def test_a_stop_during_start_up_exits_75_at_once_with_one_line(tmp_path, sig, sets):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "ratrain.train", "--config", "tiny", "--set",
                          f"run.dir={run_dir}", *sets], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _wait_caught(p, sig)  # as soon as the handler is there: still importing or starting up
    os.kill(p.pid, sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    assert err.count("\n") == 1 and "nothing was trained" in err
    assert f"{signal.Signals(sig).name} during start-up" in err
    assert not run_dir.exists()


def _script(body: str) -> subprocess.CompletedProcess:
    code = ("import os, signal, time\nfrom ratrain.job import early\nearly.catch()\n" + body
            + "\nos.kill(os.getpid(), signal.SIGUSR1)\ntime.sleep(30)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_every_phase_is_named_and_a_signal_after_the_end_keeps_the_runs_code():
    r = _script('early.phase("nothing to do (the run is finished)")')
    assert r.returncode == 75 and "during nothing to do" in r.stderr and "nothing was trained" in r.stderr
    r = _script("early.ended(0)")
    assert r.returncode == 0 and "after the run ended (exit 0)" in r.stderr
    r = _script("early.ended(4)")
    assert r.returncode == 4
    r = _script('early.catch(["USR2"])')  # USR1 no longer listed: its default action again
    assert r.returncode == -signal.SIGUSR1


def test_only_rank_0_prints_under_a_launcher(monkeypatch):
    r = subprocess.run([sys.executable, "-c", "import os, signal, time\nfrom ratrain.job import "
                        "early\nearly.catch()\nos.kill(os.getpid(), signal.SIGTERM)\n"
                        "time.sleep(30)\n"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, OMPI_COMM_WORLD_RANK="1"))
    assert r.returncode == 75 and r.stderr == ""


def test_after_the_last_instruction_the_stop_signals_are_ignored():
    """Python puts back a signal's default action (a kill) while it finalises, except for an
    ignored one: after the last instruction the stop signals are ignored, so a run that has
    finished is not turned into a kill by a late signal (seen: exit -10 after "finished")."""
    code = ("import signal\nfrom ratrain.job import early\nearly.catch()\nearly.ended(0)\n"
            "early.ignore()\nprint(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN, "
            "signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr
