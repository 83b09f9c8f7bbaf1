"""Train a model: `python -m ratrain.train --config FILE [--set section.key=value ...]`.

Runs alone (one process, no launcher) or under `mpirun -n N` / `srun`. Every check of the
input (config, world size, data, Hugging Face import, the memory plan against the DDR cap or
the node's memory, checkpoint, room for checkpoints, the run directory's lock) runs before any
work, on every rank, and the ranks agree on the verdict: a bad input stops every rank with the
same message (printed once, by rank 0) and exit code 2. After start-up, an exception on any
rank aborts the whole job (MPI_Abort; every rank prints why) instead of leaving the others
hanging, and the job's watchdog (`comm.timeout`, `ratrain.job.watchdog`) ends it when a rank
stops answering. A run stops early and cleanly on a signal or `run.time_limit` (a checkpoint
at the step reached, exit 75), on `optim.max_nonfinite_steps` non-finite steps (exit 4) and on
a checkpoint that cannot be written (exit 5, unless `checkpoint.on_error: continue`); the exit
codes are `ratrain.job.runctl`'s.

The package: `startup` (the checks, agreed across ranks), `trainer` (the loop, and how a run
ends), and here the command itself (arguments, --print-config, --dry-run, MPI and the job's
control plane and watchdog). The schedule and its numerics live in `ratrain.lifecycle`.

May import: every package below the commands (a command: nothing imports it, and it imports no
other command).
"""

from __future__ import annotations

from ratrain.job import early

early.catch()  # the first instruction: a stop signal from here on exits 75 (ratrain.job.early)

import argparse
import faulthandler
import sys

from ratrain.elastic import launch
from ratrain.job import faults
from ratrain.job.abort import abort, abort_on_error
from ratrain.config import CommConfig, ConfigError, load_config
from ratrain.data import open_datasets
from ratrain.plan.check import run_plan
from ratrain.job.runctl import EXIT_OK, EXIT_USAGE
from ratrain.train.startup import (
    Setup,
    StartupError,
    agree,
    check_device_memory,
    check_memory,
    finished_message,
    resolve_config,
    startup,
)
from ratrain.train.trainer import ResumeFailed, Trainer


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m ratrain.train",
        description="Train a LLaMA-family model with ratrain (one process, mpirun or srun).",
    )
    ap.add_argument("--config", required=True,
                    help="YAML job file, or the name of a shipped job (tiny, correctness, ...)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set optim.lr=1e-3",
    )
    ap.add_argument("--print-config", action="store_true",
                    help="print the resolved config (YAML; with init.from_hf's model) and exit")
    ap.add_argument("--dry-run", action="store_true",
                    help="check config, data, world size and the memory plan against the DDR "
                    "cap on every rank, train nothing; exit 0 (fits) or 2")
    return ap.parse_args(argv)



def print_config(args) -> int:
    """--print-config: the resolved config as YAML (no MPI, no data read), printed by rank 0
    of a launcher's job only."""
    try:
        text = resolve_config(args).to_yaml()
    except ConfigError as e:
        if early.is_rank0():
            print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if early.is_rank0():
        print(text, end="", flush=True)
    return EXIT_OK


def dry_run(setup: Setup, comm) -> int:
    """--dry-run: after every start-up check, the memory plan against the cap, checked on every
    rank for its own stage; prints the plan; trains nothing."""
    plan = agree(comm, run_plan, setup.cfg)
    bad = None
    try:
        agree(comm, plan.check, comm.Get_rank())
        agree(comm, check_device_memory, setup.cfg, comm.Get_rank(), setup.device)
    except StartupError as e:
        bad = e
    if comm.Get_rank() == 0:
        cfg, ds = setup.cfg, open_datasets(setup.cfg, setup.data_paths)[0]
        epochs = cfg.run.steps * cfg.parallel.global_batch / ds.num_windows
        print(f"config {cfg.parallel.pp} x {cfg.parallel.dp} = {comm.Get_size()} ranks: OK\n"
              f"device {setup.device.describe() if setup.device else 'cpu'} (rank 0)\n"
              f"data {ds.path}: {ds.num_tokens} tokens, {ds.num_windows} windows of "
              f"{cfg.model.seq_len + 1}; run.steps={cfg.run.steps} reads {epochs:.2f} epochs\n"
              f"eval {_eval_files(setup.data_paths)}; tokenizer "
              f"{cfg.data.tokenizer or 'unknown'}\n" + "\n".join(plan.describe()), flush=True)
    if bad is not None:
        raise bad
    if comm.Get_rank() == 0:
        print("dry run: every check passed; nothing trained", flush=True)
    return 0


def _eval_files(paths) -> str:
    """The held-out files an eval reads (one, or one per source of a mixture), or none."""
    files = [f"{s.name}={s.eval_tokens}" for s in paths.sources if s.eval_tokens] \
        or [str(paths.eval_tokens)] * (paths.eval_tokens is not None)
    return ", ".join(files) or "none"


def _comm_timeout(args) -> tuple[float, bool]:
    """comm.timeout of the job as this process reads it alone (before MPI starts; the default
    when the config is bad: start-up will say why on every rank), and whether it is elastic;
    its run.stop_signals are caught from here on."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError:
        return CommConfig.timeout, False
    early.catch(cfg.run.stop_signals)
    return cfg.comm.timeout, cfg.elastic.enabled


def main(argv=None) -> int:
    early.begin()  # caught since the import already; again for a second main() in one process
    code = _command(argv)
    early.ended(code)
    faults.finalize(code)  # elastic, after a loss: exit without MPI_Finalize (it may hang)
    early.ignore()  # exiting with `code`: a signal now would only turn it into a kill
    return code


def _command(argv) -> int:
    args = parse_args(argv)
    args.raw = list(sys.argv[1:] if argv is None else argv)  # elastic.respawn starts new ranks so
    if args.print_config:
        early.phase("--print-config")
        return print_config(args)
    if args.dry_run:
        early.phase("--dry-run")
    timeout, elastic = _comm_timeout(args)
    # MPI's start-up and the watchdog's own set-up are collectives that no watchdog covers yet:
    # should a rank stop meanwhile, dump the stacks and exit instead of waiting for ever.
    backstop = timeout and "mpi4py.MPI" not in sys.modules
    if backstop:
        faulthandler.dump_traceback_later(timeout + 30, exit=True)
    from mpi4py import MPI  # after the arguments: --help needs no MPI

    from ratrain.job.control import Control  # loads MPI, after the backstop is armed

    if elastic and MPI.Comm.Get_parent() != MPI.COMM_NULL:  # spawned in a lost rank's place
        return _join(MPI.Comm.Get_parent(), timeout, backstop)
    comm = MPI.COMM_WORLD
    problem = launch.problem(comm.Get_size()) if elastic else None
    if elastic and problem is None:
        launch.arm()  # every communicator returns its errors: a lost peer is handled
    ctl = Control.for_job(comm, timeout)
    if elastic and problem is None:
        faults.watch([ctl.comm])
    if backstop:
        faulthandler.cancel_dump_traceback_later()
    with abort_on_error():  # an error on one rank, even in start-up, ends every rank
        code = _main(args, comm, ctl, timeout, problem)
    if faults.watching():
        return code  # elastic: the job's communicators may hold lost ranks: no collective end
    ctl.close()  # collective: every rank gets here with the same code
    return code


def _join(parent, timeout: float, backstop: bool) -> int:
    """A process spawned in a lost rank's place (`elastic.respawn`): join the survivors."""
    from ratrain.train import survive  # loads MPI (loaded already here), as the run does

    launch.arm()
    if backstop:
        faulthandler.cancel_dump_traceback_later()
    with abort_on_error():
        return survive.join(parent, timeout)


def _main(args, comm, ctl, timeout: float = 0.0, elastic_problem: str | None = None) -> int:
    try:
        if elastic_problem:  # elastic.enabled where MPI or the launch cannot deliver it
            raise StartupError(elastic_problem)
        setup = startup(args, ctl)
        if args.dry_run:
            return dry_run(setup, ctl)
    except StartupError as e:
        if comm.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if setup.finished:
        early.phase("nothing to do (the run is finished)")
        if comm.Get_rank() == 0:
            print(f"ratrain: {setup.finished}", flush=True)
        return EXIT_OK
    try:
        if faults.watching():
            from ratrain.train import survive  # loads MPI (loaded already here), as the run does

            survive.ARGS[:] = args.raw
            return survive.run(setup, comm, ctl, timeout)
        return Trainer(setup, comm, ctl).run()
    except ResumeFailed as e:  # every rank verified it; this one could not read it after all
        print(f"error: {e}", file=sys.stderr, flush=True)
        if comm.Get_size() > 1:
            abort(None, EXIT_USAGE)  # the other ranks may be waiting in a collective
        return EXIT_USAGE
    finally:
        setup.release()


__all__ = ["Setup", "StartupError", "Trainer", "agree", "check_memory", "dry_run",
           "finished_message", "main", "parse_args", "print_config", "resolve_config", "startup"]
