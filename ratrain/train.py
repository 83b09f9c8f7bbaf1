"""Train a model: `python -m ratrain.train --config FILE [--set section.key=value ...]`.

Runs alone (one process, no launcher) or under `mpirun -n N` / `srun`. Every check of the
input (config, world size, data, Hugging Face import, checkpoint) runs before any work, on
every rank, and the ranks agree on the verdict: a bad input stops every rank with the same
message (printed once, by rank 0) and exit code 2. After start-up, an exception on any rank
aborts the whole job (MPI_Abort) instead of leaving the others hanging.

This module is the thin entry: it wires config -> platform -> topology -> state -> executor
and loops over steps; the schedule and its numerics live in `ratrain.lifecycle`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

from ratrain.checkpoint import (
    StateStream,
    checkpoint_root,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from ratrain.comm.abort import abort_on_error
from ratrain.config import Config, ConfigError, load_config
from ratrain.data import check_data, eval_batches, open_datasets, record_tokenizer
from ratrain.exec.params import BUFFERS
from ratrain.fileio import atomic_write
from ratrain.hf import check_hf, import_model_section, load_hf_params
from ratrain.lifecycle.rank import build_rank
from ratrain.metrics import MetricsWriter
from ratrain.shim import allocator
from ratrain import tblog
from ratrain.plan.check import run_plan
from ratrain.tblog import TensorBoard


class StartupError(RuntimeError):
    """Bad input found before any work; the message is the same on every rank."""


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
        cfg = import_model_section(cfg, cfg.init.from_hf, args.overrides)
    return cfg


@dataclass
class Setup:
    cfg: Config
    data_paths: object
    resume: str | None


def startup(args, comm) -> Setup:
    cfg = agree(comm, resolve_config, args)
    agree(comm, cfg.check_world, comm.Get_size())
    data_paths = agree(comm, check_data, cfg, comm)
    cfg = agree(comm, record_tokenizer, cfg, data_paths)
    if cfg.init.from_hf:
        agree(comm, check_hf, cfg.init.from_hf, cfg.model)
    if cfg.run.tensorboard:
        agree(comm, tblog.check)
    resume = agree(comm, lambda: resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=comm))
    return Setup(cfg, data_paths, resume)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


class Trainer:
    """One rank's training loop."""

    def __init__(self, setup: Setup, comm):
        cfg = self.cfg = setup.cfg
        self.comm = comm
        self.rank = comm.Get_rank()
        self.start_step = 0
        self.resume_state = None
        self.parts = build_rank(cfg, comm if comm.Get_size() > 1 else None,
                                load=lambda state: self._load_weights(state, setup.resume))
        self.topo, self.profile = self.parts.topo, self.parts.profile
        self.state, self.executor = self.parts.state, self.parts.executor
        if self.resume_state is not None:
            self.executor.load_state_dict(self.resume_state["executor"])
        self.train_ds, self.eval_ds = open_datasets(cfg, setup.data_paths)
        self.writes_metrics = self.executor.reports_loss
        self.metrics = self.tb = None

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
        cfg = self.cfg
        if self.start_step >= cfg.run.steps:
            if self.rank == 0:
                print(f"nothing to do: resumed at step {self.start_step} (checkpoint.resume="
                      f"{cfg.checkpoint.resume}), run.steps={cfg.run.steps}; raise run.steps to "
                      "train on, or set checkpoint.resume=never to start over", flush=True)
            self.close()
            return 0
        if self.rank == 0:
            os.makedirs(cfg.run.dir, exist_ok=True)
        if self.comm.Get_size() > 1:
            self.comm.Barrier()  # the run directory exists before any rank writes into it
        if self.rank == 0:
            atomic_write(os.path.join(cfg.run.dir, "config.yaml"), cfg.to_yaml())
            self._banner()
        self.t_start = time.perf_counter()
        if self.writes_metrics:
            self.metrics = MetricsWriter(cfg.run.dir, cfg.run.steps, self.start_step)
            peak = self.parts.peak_flops() * cfg.parallel.world_size  # every rank's, for MFU
            self.tb = TensorBoard(cfg.run.dir) if cfg.run.tensorboard else None
        fpt = cfg.model.flops_per_token()
        tokens_per_step = cfg.parallel.global_batch * cfg.model.seq_len
        for step in range(self.start_step, cfg.run.steps):
            t0 = time.perf_counter()
            batch = self._batch(step)
            res = self.executor.run_step(step, batch)
            dt = time.perf_counter() - t0
            n = step + 1  # steps are numbered from 1 in metrics and checkpoints
            if self.metrics is not None:
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
                    "mfu": tokens_per_step / dt * fpt / peak,
                    "elapsed_s": time.perf_counter() - self.t_start,
                }
                log = n % cfg.run.log_interval == 0 or n == cfg.run.steps or n == self.start_step + 1
                self.metrics.write(rec, fpt, log=log)
                if self.tb is not None:
                    self.tb.log(rec, "train")
            if cfg.data.eval_interval and n % cfg.data.eval_interval == 0 and self.eval_ds is not None:
                self._eval(n)
            if cfg.checkpoint.interval and (n % cfg.checkpoint.interval == 0 or n == cfg.run.steps):
                self._save(n)
        if cfg.run.trace:
            self.executor.write_trace(os.path.join(cfg.run.dir, "trace.json"))
        self.close()
        return 0

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
            rec = {"step": n, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
                   "eval_tokens": len(batches) * self.cfg.parallel.global_batch
                   * self.cfg.model.seq_len, "elapsed_s": time.perf_counter() - self.t_start}
            self.metrics.write_event(rec)
            if self.tb is not None:
                self.tb.log(rec, "eval")
            print(f"step {n:>5d} | eval loss {loss:.4f} | perplexity {rec['eval_ppl']:.2f}",
                  flush=True)

    def _save(self, n: int) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.executor.flush()  # deferred updates applied: the saved masters are step n's
        if self.executor.sharded:
            # Each replica holds a segment of every block: gather one block at a time while
            # replica 0 writes it (every replica of the stage takes part in the gathers).
            shapes = {p.name: p.shape for b in self.state.blocks for p in b.params}
            tensors = StateStream(shapes, BUFFERS, self.executor.iter_full_state())
        else:
            tensors = self.state.state_dict()
        path = save_checkpoint(
            checkpoint_root(cfg.checkpoint, cfg.run.dir),
            n,
            cfg,
            tensors,
            {"executor": self.executor.state_dict(), "data": self.train_ds.state_dict(n)},
            stage=self.executor.stage,
            replica=self.replica,
            comm=self.comm if self.comm.Get_size() > 1 else None,
            log=(lambda m: print(m, flush=True)) if self.rank == 0 else (lambda m: None),
        )
        if self.rank == 0:
            print(f"step {n:>5d} | checkpoint saved: {path} ({time.perf_counter() - t0:.1f}s)",
                  flush=True)

    def _banner(self) -> None:
        cfg = self.cfg
        m, p = cfg.model, cfg.parallel
        print(
            f"ratrain: {m.num_params() / 1e6:.2f}M params ({m.layers} layers, hidden {m.hidden}), "
            f"pp={p.pp} dp={p.dp} micro_batch={p.micro_batch} x {p.num_micro_batches}, "
            f"{cfg.precision}, policy {cfg.schedule.policy}, recompute {cfg.schedule.recompute}, "
            f"platform {self.profile.name}, {self.parts.ctx.threads} threads/rank, "
            f"steps {self.start_step + 1}..{cfg.run.steps}, run dir {cfg.run.dir}"
            + (f", model from {cfg.init.from_hf}" if cfg.init.from_hf else "")
            + (f", tokenizer {cfg.data.tokenizer}" if cfg.data.tokenizer else ""),
            flush=True,
        )

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.tb is not None:
            self.tb.close()
        self.parts.close()


def print_config(args) -> int:
    """--print-config: the resolved config as YAML (no MPI, no data read)."""
    try:
        print(resolve_config(args).to_yaml(), end="", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def dry_run(setup: Setup, comm) -> int:
    """--dry-run: after every start-up check, the memory plan against the cap, checked on every
    rank for its own stage; prints the plan; trains nothing."""
    plan = agree(comm, run_plan, setup.cfg)
    bad = None
    try:
        agree(comm, plan.check, comm.Get_rank())
    except StartupError as e:
        bad = e
    if comm.Get_rank() == 0:
        cfg, ds = setup.cfg, open_datasets(setup.cfg, setup.data_paths)[0]
        epochs = cfg.run.steps * cfg.parallel.global_batch / ds.num_windows
        print(f"config {cfg.parallel.pp} x {cfg.parallel.dp} = {comm.Get_size()} ranks: OK\n"
              f"data {ds.path}: {ds.num_tokens} tokens, {ds.num_windows} windows of "
              f"{cfg.model.seq_len + 1}; run.steps={cfg.run.steps} reads {epochs:.2f} epochs\n"
              f"eval {setup.data_paths.eval_tokens or 'none'}; tokenizer "
              f"{cfg.data.tokenizer or 'unknown'}\n" + "\n".join(plan.describe()), flush=True)
    if bad is not None:
        raise bad
    if comm.Get_rank() == 0:
        print("dry run: every check passed; nothing trained", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.print_config:
        return print_config(args)
    from mpi4py import MPI  # after the arguments: --help needs no MPI

    allocator.tune()  # freed DDR stays in the process, as on the cluster (see its docstring)

    comm = MPI.COMM_WORLD
    try:
        setup = startup(args, comm)
        if args.dry_run:
            return dry_run(setup, comm)
    except StartupError as e:
        if comm.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    with abort_on_error():
        return Trainer(setup, comm).run()


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["StartupError", "Trainer", "agree", "dry_run", "main", "print_config",
           "resolve_config", "startup"]
