"""Stop signals from the first instruction of a run, until the trainer takes them over.

A run takes seconds to start (imports, MPI, the start-up checks, building the rank) and a batch
system may signal it at any moment of that: Slurm's time-limit USR1 within seconds of the start
of a requeued job, a `scancel`. Python's default action for TERM and USR1 kills the process
(exit 143/138, no message), so the entry point calls `catch()` before anything else:

    from ratrain.job import early; early.catch()    # first instruction of ratrain.train
    early.catch(cfg.run.stop_signals)               # once the config is read (before MPI)
    early.phase("nothing to do")                    # what the run is doing, for the message
    ... the trainer's StopRequests take the signals over, and hand them back when it returns
    early.ended(code)                               # a signal after the end: that exit code
    early.ignore()                                  # the last instruction: exiting with it

A stop asked before training starts ends the process at once with exit 75 and one line (from
rank 0, or from the process when no launcher gives ranks) saying that nothing was trained:
running the same command again starts or resumes the run as if nothing had happened. After the
run ended its own way, a signal ends the process at once with the run's own exit code. Under
`mpirun` or `srun` the signal goes to every rank (mpirun and srun forward it), so every rank
exits alike. Imports nothing heavy (`signal`, `os`, `sys`).
"""

from __future__ import annotations

import os
import signal
import sys

from ratrain.job.codes import EXIT_STOPPED

DEFAULT_SIGNALS = ("TERM", "USR1")  # run.stop_signals' default (a test checks they agree)
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")

_state = {"phase": "start-up", "ended": None, "caught": ()}


def signum(name: str) -> int:
    """The number of a signal named as run.stop_signals names it (TERM, SIGTERM, term)."""
    return getattr(signal, "SIG" + name.upper().removeprefix("SIG"))


def is_rank0() -> bool:
    """Rank 0 of the launcher's job, or a process no launcher started (from the environment:
    MPI need not be running)."""
    for var in RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return os.environ[var] == "0"
    return True


def _on_signal(num, frame) -> None:
    name = signal.Signals(num).name
    code = _state["ended"]
    if code is None:
        code = EXIT_STOPPED
        line = (f"ratrain: {name} during {_state['phase']}: stopped before training started, "
                f"nothing was trained; run the same command again to continue (exit {code})\n")
    else:
        line = f"ratrain: {name} after the run ended (exit {code})\n"
    if is_rank0():
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr gone or closed: the exit code still says it
            pass
    os._exit(code)


def catch(names=DEFAULT_SIGNALS) -> None:
    """Take `names` (run.stop_signals) from now on; signals caught before and not among them go
    back to their default action."""
    nums = [signum(n) for n in names]
    for num in _state["caught"]:
        if num not in nums:
            signal.signal(num, signal.SIG_DFL)
    for num in nums:
        signal.signal(num, _on_signal)
    _state["caught"] = tuple(nums)


def begin(names=DEFAULT_SIGNALS) -> None:
    """A run begins in this process (again, when a test calls the command's `main` twice):
    start-up, not ended, `names` caught."""
    _state.update(phase="start-up", ended=None)
    catch(names)


def phase(what: str) -> None:
    """What the run is doing before training, for the line a stop prints."""
    _state["phase"] = what


def ended(code: int) -> None:
    """The run has ended with `code`: a signal from now on exits with it."""
    _state["ended"] = code


def ignore() -> None:
    """The process is about to exit with its code (MPI's finalisation, the interpreter's):
    signals from now on are ignored. Python puts back the default action of a signal it has a
    handler for while it finalises, which would kill a process that has finished."""
    for num in _state["caught"]:
        signal.signal(num, signal.SIG_IGN)


__all__ = ["DEFAULT_SIGNALS", "begin", "catch", "ended", "ignore", "is_rank0", "phase", "signum"]
