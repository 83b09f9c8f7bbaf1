"""Train a model: `python -m ratrain.train --config FILE [--set section.key=value ...]`.

Runs alone (one process, no launcher) or under `mpirun -n N` / `srun`. Every check of the
input (config, world size, data, Hugging Face import, the memory plan against the DDR cap or
the node's memory, checkpoint, room for checkpoints, the run directory's lock) runs before any
work, on every rank, and the ranks agree on the verdict: a bad input stops every rank with the
same message (printed once, by rank 0) and exit code 2. After start-up, an exception on any
rank aborts the whole job (MPI_Abort; every rank prints why) instead of leaving the others
hanging, and the job's watchdog (`comm.timeout`, `ratrain.comm.watchdog`) ends it when a rank
stops answering. A run stops early and cleanly on a signal or `run.time_limit` (a checkpoint
at the step reached, exit 75), on `optim.max_nonfinite_steps` non-finite steps (exit 4) and on
a checkpoint that cannot be written (exit 5, unless `checkpoint.on_error: continue`); the exit
codes are `ratrain.runctl`'s.

This module is the thin entry: it wires config -> platform -> topology -> state -> executor
and loops over steps; the schedule and its numerics live in `ratrain.lifecycle`.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ratrain.checkpoint import (
    CheckpointError,
    StateStream,
    checkpoint_root,
    load_checkpoint,
    read_manifest,
    resolve_resume,
    save_checkpoint,
)
from ratrain.checkpoint.space import checkpoint_bytes, room_problem
from ratrain.comm.abort import abort, abort_on_error
from ratrain.config import CommConfig, Config, ConfigError, config_from_dict, load_config
from ratrain.data import check_data, eval_batches, open_datasets
from ratrain.exec.params import BUFFERS
from ratrain.fileio import atomic_write
from ratrain.hf import check_hf, hf_model_config, load_hf_params
from ratrain.lifecycle.preflight import memory_problem
from ratrain.lifecycle.rank import build_rank
from ratrain.metrics import MetricsWriter
from ratrain.runctl import (
    EXIT_CHECKPOINT,
    EXIT_DIVERGED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    StopRequests,
    lock_dirs,
    write_status,
)
from ratrain.shim import allocator


class StartupError(RuntimeError):
    """Bad input found before any work; the message is the same on every rank."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m ratrain.train",
        description="Train a LLaMA-family model with ratrain (one process, mpirun or srun).",
    )
    ap.add_argument("--config", required=True, help="YAML job file (see jobs/)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set optim.lr=1e-3",
    )
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Start-up: every check before any work, agreed across ranks
# --------------------------------------------------------------------------------------------


def agree(comm, fn, *args):
    """Run `fn` on every rank; if it fails on any rank, raise StartupError with the first
    failing rank's message on every rank. (A start-up control-plane exchange, not training
    traffic.)"""
    result, err = None, None
    try:
        result = fn(*args)
    except (ConfigError, ValueError, OSError, RuntimeError, KeyError) as e:
        err = str(e) or type(e).__name__
    errs = comm.allgather(err) if comm.Get_size() > 1 else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        rank, msg = bad[0]
        if comm.Get_size() > 1 and not all(e == msg for _, e in bad):
            msg = f"{msg} (rank {rank}; other ranks failed too)"
        raise StartupError(msg)
    return result


def resolve_config(args) -> Config:
    cfg = load_config(args.config, args.overrides)
    if cfg.init.from_hf:
        # The model section comes from the checkpoint's config.json (seq_len stays ours).
        hf_model = hf_model_config(cfg.init.from_hf)
        data = cfg.to_dict()
        seq_len = data["model"]["seq_len"]
        data["model"].update(hf_model)
        data["model"]["seq_len"] = seq_len
        cfg = config_from_dict(data, f"{args.config} + {cfg.init.from_hf}/config.json")
    return cfg


@dataclass
class Setup:
    cfg: Config
    data_paths: object
    resume: str | None
    finished: str | None = None  # a message: the run is already done, nothing to train
    locks: list = field(default_factory=list)  # RunLock of run.dir (and checkpoint.dir), rank 0

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def check_memory(cfg: Config, rank: int) -> None:
    """The memory plan of this rank's stage against the DDR cap (or the node's memory)."""
    from ratrain.comm.progress import local_ranks  # loads MPI (loaded already under a launcher)

    problem = memory_problem(cfg, rank % cfg.parallel.pp, local_ranks() or 1)
    if problem:
        raise ConfigError(problem)


def finished_message(cfg: Config, resume: str | None) -> str | None:
    """Why there is nothing to train: the checkpoint to resume is at run.steps already."""
    if resume is None:
        return None
    step = read_manifest(resume)["step"]
    if step < cfg.run.steps:
        return None
    return (f"the run is finished: {resume} is step {step} of run.steps={cfg.run.steps}; "
            "nothing to do (raise run.steps to train further)")


def startup(args, comm) -> Setup:
    cfg = agree(comm, resolve_config, args)
    agree(comm, cfg.check_world, comm.Get_size())
    data_paths = agree(comm, check_data, cfg, comm)
    if cfg.init.from_hf:
        agree(comm, check_hf, cfg.init.from_hf, cfg.model)
    agree(comm, check_memory, cfg, comm.Get_rank())
    resume = agree(comm, lambda: resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=comm))
    done = agree(comm, finished_message, cfg, resume)
    if done:
        return Setup(cfg, data_paths, resume, finished=done)
    root = checkpoint_root(cfg.checkpoint, cfg.run.dir)
    if cfg.checkpoint.interval and cfg.checkpoint.on_error == "stop":
        agree(comm, lambda: comm.Get_rank() == 0 and _no_room(root, cfg))
    locks = agree(comm, lambda: [] if comm.Get_rank() else lock_dirs(cfg.run.dir, root, _note))
    return Setup(cfg, data_paths, resume, locks=locks)


def _note(msg: str) -> None:
    print(f"ratrain: {msg}", file=sys.stderr, flush=True)


def _no_room(root: str, cfg: Config) -> None:
    problem = room_problem(root, cfg)
    if problem:
        raise OSError(problem)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


class Trainer:
    """One rank's training loop."""

    def __init__(self, setup: Setup, comm, ctl=None):
        cfg = self.cfg = setup.cfg
        self.comm = comm
        self.ctl = ctl if ctl is not None else comm  # the control plane (comm.control.Control)
        self.rank = comm.Get_rank()
        self.start_step = 0
        self.resume_state = None
        self.resumed = bool(setup.resume)
        self.parts = build_rank(cfg, comm if comm.Get_size() > 1 else None,
                                watchdog_s=cfg.comm.timeout or None,
                                load=lambda state: self._load_weights(state, setup.resume))
        self.watchdog = getattr(self.ctl, "watchdog", None)
        if self.parts.engine is not None and self.watchdog is not None:
            self.parts.engine.attach(self.watchdog)
        self.topo, self.profile = self.parts.topo, self.parts.profile
        self.state, self.executor = self.parts.state, self.parts.executor
        if self.resume_state is not None:
            self.executor.load_state_dict(self.resume_state["executor"])
        self.train_ds, self.eval_ds = open_datasets(cfg, setup.data_paths)
        self.writes_metrics = self.executor.reports_loss
        self.metrics = None
        self.nonfinite = 0  # consecutive non-finite steps
        self.save_s = 0.0  # the last checkpoint's duration (the time limit keeps room for one)
        self.stop: StopRequests | None = None

    @property
    def replica(self) -> int:
        return self.topo.replica if self.topo is not None else 0

    def _load_weights(self, state, resume: str | None) -> None:
        """The starting weights: a checkpoint to resume, or an imported Hugging Face model."""
        if resume:
            self._load_checkpoint(state, resume)
        elif self.cfg.init.from_hf:
            state.load_named(load_hf_params(self.cfg.init.from_hf, self.cfg.model,
                                            names=state.names))

    def _load_checkpoint(self, state, path: str) -> None:
        """Read this stage's parameters; a sharded state keeps only its segment, one block at a
        time (so never more than one extra block is held)."""
        if not state.sharded:
            ck = load_checkpoint(path, state.names, out=state.state_dict())
        else:
            for b in state.blocks:
                ck = load_checkpoint(path, [p.name for p in b.params])
                for buf in BUFFERS:
                    state.load_named(ck[buf], buf, blocks=[b.name])
        self.start_step = ck["step"]
        self.resume_state = ck["state"]

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train from the resumed step to run.steps; the exit code (`ratrain.runctl`)."""
        cfg = self.cfg
        if self.rank == 0:
            os.makedirs(cfg.run.dir, exist_ok=True)
        self.ctl.barrier()  # the run directory exists before any rank writes into it
        if self.rank == 0:
            atomic_write(os.path.join(cfg.run.dir, "config.yaml"), cfg.to_yaml())
            write_status(cfg.run.dir, self.start_step)
            self._banner()
        if self.writes_metrics:
            self.metrics = MetricsWriter(cfg.run.dir, cfg.run.steps, self.start_step)
        self.stop = StopRequests(cfg.run, self._hard_exit)
        self.step_reached = self.start_step
        try:
            code = self._loop()
        finally:
            self.stop.close()
        if cfg.run.trace and code in (EXIT_OK, EXIT_STOPPED):
            self.executor.write_trace(os.path.join(cfg.run.dir, "trace.json"))
        if self.rank == 0:
            write_status(cfg.run.dir, self.step_reached, code)
        self.close()
        return code

    def _loop(self) -> int:
        cfg = self.cfg
        for step in range(self.start_step, cfg.run.steps):
            n = step + 1  # steps are numbered from 1 in metrics and checkpoints
            self._doing(f"step {n}")
            self.step_reached = n
            t0 = time.perf_counter()
            res = self.executor.run_step(step, self._batch(step))
            dt = time.perf_counter() - t0
            self._record(n, res, dt)
            if self._diverged(n, res):
                return EXIT_DIVERGED
            if cfg.data.eval_interval and n % cfg.data.eval_interval == 0 and self.eval_ds is not None:
                self._eval(n)
            # The last step is saved whenever checkpoints are in use (an interval, or this run
            # resumed one), so that a later start knows the run is finished.
            last = n == cfg.run.steps and (cfg.checkpoint.interval or self.resumed)
            saved = bool(last or cfg.checkpoint.interval and n % cfg.checkpoint.interval == 0)
            if saved and not self._save(n):
                return EXIT_CHECKPOINT
            reason = self._agree_stop(dt) if n < cfg.run.steps else None
            if reason:
                return self._stop_at(n, reason, saved)
        return EXIT_OK

    def _record(self, n: int, res, dt: float) -> None:
        if self.metrics is None:
            return
        cfg = self.cfg
        tokens_per_step = cfg.parallel.global_batch * cfg.model.seq_len
        rec = {
            "step": n,
            "loss": res.loss,
            "grad_norm": res.grad_norm,
            "lr": res.lr,
            "loss_scale": res.loss_scale,
            "skipped": bool(res.skipped),
            "tokens": tokens_per_step,
            "step_time_s": dt,
            "tokens_per_s": tokens_per_step / dt,
            "peak_ddr_bytes": int(res.peak_ddr_bytes),
        }
        log = n % cfg.run.log_interval == 0 or n == cfg.run.steps or n == self.start_step + 1
        self.metrics.write(rec, cfg.model.flops_per_token(), log=log)

    def _diverged(self, n: int, res) -> bool:
        """Whether `optim.max_nonfinite_steps` consecutive steps were not finite (every rank
        knows the loss and the skip, so every rank decides the same)."""
        bad = bool(res.skipped) or not math.isfinite(res.loss)
        self.nonfinite = self.nonfinite + 1 if bad else 0
        limit = self.cfg.optim.nonfinite_limit(self.cfg.precision)
        if self.nonfinite < limit:
            return False
        if self.rank == 0:
            print(f"error: step {n}: the loss or the gradients were not finite for "
                  f"{self.nonfinite} consecutive step(s) (loss {res.loss}, grad norm "
                  f"{res.grad_norm}; optim.max_nonfinite_steps={limit} in {self.cfg.precision}): "
                  "training diverged; lower optim.lr, raise optim.warmup_steps or check the data",
                  file=sys.stderr, flush=True)
        return True

    def _agree_stop(self, step_s: float) -> str | None:
        """Whether every rank stops now: any rank's signal or time limit (one tiny all-reduce
        through the engine per step); the reason, or None."""
        mine = self.stop.local_reason(step_s, self.save_s or step_s)
        if self.parts.engine is None:
            return mine
        flag = np.array([1.0 if mine else 0.0])
        self.parts.engine.allreduce(flag, self.topo.comm, algo="tree").result()
        return (mine or "a stop request on another rank") if flag[0] > 0 else None

    def _stop_at(self, n: int, reason: str, saved: bool) -> int:
        """The graceful stop: a checkpoint at step n (unless just written), then exit 75."""
        if not saved and not self._save(n, stopping=True):
            return EXIT_CHECKPOINT
        if self.rank == 0:
            print(f"ratrain: stopped at step {n} of {self.cfg.run.steps} ({reason}); the "
                  f"checkpoint of step {n} is committed: run the same command again to continue "
                  f"(exit {EXIT_STOPPED})", flush=True)
        return EXIT_STOPPED

    def _hard_exit(self, code: int, why: str) -> None:
        """A second signal, or the graceful stop ran out of time: end at once (every rank)."""
        print(f"[rank {self.rank}] ratrain: {why} (exit {code})", file=sys.stderr, flush=True)
        abort(None, code)

    def _doing(self, what: str) -> None:
        if self.watchdog is not None:
            self.watchdog.doing(what)

    def _batch(self, step: int):
        """This rank's micro-batches: inputs on the first stage, targets on the last."""
        ex = self.executor
        first, last = ex.stage == 0, ex.stage == ex.pp - 1
        if not (first or last):
            return None
        inputs, targets = self.train_ds.batch_for_step(step, self.replica)
        return (inputs if first else None, targets if last else None)

    def _eval(self, n: int) -> None:
        batches = eval_batches(self.eval_ds, self.cfg.data.eval_batches, self.replica)
        loss = self.executor.eval_loss(batches)
        if self.metrics is not None:
            self.metrics.write_event({"step": n, "eval_loss": loss})
            print(f"step {n:>5d} | eval loss {loss:.4f}", flush=True)

    def _save(self, n: int, stopping: bool = False) -> bool:
        """Checkpoint step n and log it; on failure (the same error on every rank) say so and
        return whether training goes on (`checkpoint.on_error`; never when stopping)."""
        self._doing(f"checkpoint save at step {n}")
        t0 = time.perf_counter()
        try:
            path = self._write_checkpoint(n)
        except CheckpointError as e:
            go_on = self.cfg.checkpoint.on_error == "continue" and not stopping
            if self.rank == 0:
                then = (f"training goes on (checkpoint.on_error=continue); next try at step "
                        f"{n + self.cfg.checkpoint.interval}" if go_on else
                        f"stopping (exit {EXIT_CHECKPOINT}); set checkpoint.on_error=continue to "
                        "train on without checkpoints")
                print(f"{'warning' if go_on else 'error'}: {e}\n  {then}", file=sys.stderr,
                      flush=True)
            return go_on
        self.save_s = time.perf_counter() - t0
        if self.rank == 0:
            size = checkpoint_bytes(path)
            print(f"checkpoint step {n}: {path}, {size / 2**20:.2f} MiB ({size} bytes) in "
                  f"{self.save_s:.2f} s", flush=True)
        return True

    def _write_checkpoint(self, n: int) -> str:
        cfg = self.cfg
        self.executor.flush()  # deferred updates applied: the saved masters are step n's
        if self.executor.sharded:
            # Each replica holds a segment of every block: gather one block at a time while
            # replica 0 writes it (every replica of the stage takes part in the gathers).
            shapes = {p.name: p.shape for b in self.state.blocks for p in b.params}
            tensors = StateStream(shapes, BUFFERS, self.executor.iter_full_state())
        else:
            tensors = self.state.state_dict()
        return save_checkpoint(
            checkpoint_root(cfg.checkpoint, cfg.run.dir),
            n,
            cfg,
            tensors,
            {"executor": self.executor.state_dict(), "data": self.train_ds.state_dict(n)},
            stage=self.executor.stage,
            replica=self.replica,
            comm=self.ctl if self.comm.Get_size() > 1 else None,
            log=(lambda m: print(m, flush=True)) if self.rank == 0 else (lambda m: None),
        )

    def _banner(self) -> None:
        cfg = self.cfg
        m, p = cfg.model, cfg.parallel
        print(
            f"ratrain: {m.num_params() / 1e6:.2f}M params ({m.layers} layers, hidden {m.hidden}), "
            f"pp={p.pp} dp={p.dp} micro_batch={p.micro_batch} x {p.num_micro_batches}, "
            f"{cfg.precision}, policy {cfg.schedule.policy}, recompute {cfg.schedule.recompute}, "
            f"platform {self.profile.name}, steps {self.start_step + 1}..{cfg.run.steps}, "
            f"run dir {cfg.run.dir}",
            flush=True,
        )

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.parts.close()


def _comm_timeout(args) -> float:
    """comm.timeout of the job as this process reads it alone (before MPI starts; the default
    when the config is bad: start-up will say why on every rank)."""
    try:
        return load_config(args.config, args.overrides).comm.timeout
    except ConfigError:
        return CommConfig.timeout


def main(argv=None) -> int:
    args = parse_args(argv)
    timeout = _comm_timeout(args)
    # MPI's start-up and the watchdog's own set-up are collectives that no watchdog covers yet:
    # should a rank stop meanwhile, dump the stacks and exit instead of waiting for ever.
    backstop = timeout and "mpi4py.MPI" not in sys.modules
    if backstop:
        faulthandler.dump_traceback_later(timeout + 30, exit=True)
    from mpi4py import MPI  # after the arguments: --help needs no MPI

    from ratrain.comm.control import Control  # loads MPI, after the backstop is armed

    allocator.tune()  # freed DDR stays in the process, as on the cluster (see its docstring)
    comm = MPI.COMM_WORLD
    ctl = Control.for_job(comm, timeout)
    if backstop:
        faulthandler.cancel_dump_traceback_later()
    with abort_on_error():  # an error on one rank, even in start-up, ends every rank
        code = _main(args, comm, ctl)
    ctl.close()  # collective: every rank gets here with the same code
    return code


def _main(args, comm, ctl) -> int:
    try:
        setup = startup(args, ctl)
    except StartupError as e:
        if comm.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if setup.finished:
        if comm.Get_rank() == 0:
            print(f"ratrain: {setup.finished}", flush=True)
        return EXIT_OK
    try:
        return Trainer(setup, comm, ctl).run()
    finally:
        setup.release()


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["StartupError", "Trainer", "agree", "check_memory", "finished_message", "main",
           "resolve_config", "startup"]
