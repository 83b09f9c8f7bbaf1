"""One rank's training loop: steps, metrics, evaluation, checkpoints, and how a run ends.

`Trainer(setup, comm, ctl).run()` builds the rank (`runtime.rank.build_rank`), resumes or
imports its weights, and loops over steps; after each step every rank agrees whether to stop (a
signal or `run.time_limit` on any rank: `runctl.StopRequests`, one tiny all-reduce through the
engine), and the loop ends early on `optim.max_nonfinite_steps` non-finite steps or a checkpoint
that cannot be written. It returns the exit code (`ratrain.job.runctl`). The schedule and its
numerics live in `ratrain.lifecycle`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import numpy as np

from ratrain.checkpoint import (
    CheckpointError,
    StateStream,
    checkpoint_root,
    holds_replicas,
    load_stage,
    read_manifest,
    resume_replica,
    save_checkpoint,
)
from ratrain.checkpoint.space import checkpoint_bytes
from ratrain.comm.topology import coords
from ratrain.config.offload import tier_dir
from ratrain.job.abort import abort
from ratrain.job.abort import on_end as abort_on_end
from ratrain.data import eval_batches, open_datasets, open_eval_sets
from ratrain.exec.params import STATE_BUFFERS
from ratrain.fileio import atomic_write
from ratrain.hf import load_hf_params
from ratrain.runtime.rank import build_rank
from ratrain.runtime.trace import TAG as TIMELINE_TAG
from ratrain.shim.allocator import resident_bytes
from ratrain.job.metrics import MetricsWriter
from ratrain.job import early, faults
from ratrain.job.runctl import (
    EXIT_CHECKPOINT,
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    StopRequests,
    unwritable,
    write_status,
)
from ratrain.job.tblog import TensorBoard
from ratrain.shim.tier import TierFull
from ratrain.shim.tierstore import TierError
from ratrain.train.startup import Setup


class ResumeFailed(RuntimeError):
    """The verified checkpoint could not be read after all (changed since, or unreadable); the
    message is the one line that says so."""


class WriteFailed(RuntimeError):
    """A file of the run could not be written; the message is the one line that says so."""


@contextlib.contextmanager
def writing(what: str, run_dir: str, key: str = "run.dir"):
    """Writes of `what` under `run_dir`: an OSError (no space, read-only, permissions) becomes
    WriteFailed naming the file, the directory and the key that moves it."""
    try:
        yield
    except OSError as e:
        raise WriteFailed(unwritable(key, run_dir, OSError(
            e.errno, e.strerror or str(e), os.path.join(run_dir, what)))) from None


class Trainer:
    """One rank's training loop."""

    def __init__(self, setup: Setup, comm, ctl=None, peers=None):
        cfg = self.cfg = setup.cfg
        self.comm = comm
        self.ctl = ctl if ctl is not None else comm  # the control plane (comm.control.Control)
        self.rank = comm.Get_rank()
        self.start_step = 0
        self.resume_state = None
        self.resumed = bool(setup.resume) or peers is not None
        # elastic: the survivors' state after a lost rank (`train.survive.Peers`), or None
        self.peers = peers
        self.saving: int | None = None  # the step whose checkpoint is being written
        self.classes = setup.classes  # every world rank's class (`platform.classes`), or None
        self.this_rank = build_rank(cfg, comm if comm.Get_size() > 1 else None,  # a `Rank`
                                    watchdog_s=cfg.comm.timeout or None, device=setup.device,
                                    load=lambda state: self._load_weights(state, setup.resume))
        self.watchdog = getattr(self.ctl, "watchdog", None)
        if self.this_rank.engine is not None and self.watchdog is not None:
            self.this_rank.engine.attach(self.watchdog)
        self.topo, self.profile = self.this_rank.topo, self.this_rank.profile
        self.state, self.executor = self.this_rank.state, self.this_rank.executor
        if self.resume_state is not None:
            with self._resuming(setup.resume):
                self.executor.load_state_dict(self.resume_state["executor"])
        self.train_ds = open_datasets(cfg, setup.data_paths)[0]
        self.eval_sets = open_eval_sets(cfg, setup.data_paths)  # (name, weight, dataset)
        if self.resume_state is not None:  # a mixture's counts there: no replay from sample 0
            self.train_ds.load_state_dict(self.resume_state.get("data"))
        self.writes_metrics = self.executor.reports_loss
        self.metrics = self.tb = None
        self.nonfinite = 0  # consecutive non-finite steps
        self.save_s = 0.0  # the last checkpoint's duration (the time limit keeps room for one)
        self.stop: StopRequests | None = None
        self.why = ""  # why the run ended other than its own way (status.json)

    @property
    def replica(self) -> int:
        return self.topo.replica if self.topo is not None else 0

    def _load_weights(self, state, resume: str | None) -> None:
        """The starting weights: the survivors' (elastic, after a lost rank), a checkpoint to
        resume, or an imported Hugging Face model."""
        if self.peers is not None and not resume:
            self.peers.load(state)
            self.start_step, self.resume_state = self.peers.step, self.peers.state
        elif resume:
            self._load_checkpoint(state, resume)
        elif self.cfg.init.from_hf:
            state.load_named(load_hf_params(self.cfg.init.from_hf, self.cfg.model,
                                            names=state.names))

    def _load_checkpoint(self, state, path: str) -> None:
        """Read this stage's parameters and moments (`checkpoint.load_stage`: a sharded state
        keeps only its segment, one block at a time); under partial sync at the saved dp, this
        replica's own (`checkpoint.resume_replica`)."""
        p = self.cfg.parallel
        with self._resuming(path):
            own = resume_replica(read_manifest(path), self.cfg,
                                 coords(self.rank, p.pp, p.dp, p.placement)[1])
            ck = load_stage(state, path, replica=own)
        self.start_step = ck["step"]
        self.resume_state = ck["state"]

    @staticmethod
    @contextlib.contextmanager
    def _resuming(path: str):
        """Reading the checkpoint that start-up verified: a failure now (the files changed
        since, or cannot be read) is ResumeFailed, one line, never a traceback."""
        try:
            yield
        except (CheckpointError, OSError, KeyError, ValueError, TypeError) as e:
            what = " ".join(str(e).split()) or type(e).__name__
            raise ResumeFailed(f"cannot resume from {path}: {what} (it verified at start-up: "
                               "changed since?); checkpoint.resume=auto takes the newest "
                               "usable one") from None

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Train from the resumed step to run.steps; the exit code (`ratrain.job.runctl`)."""
        cfg = self.cfg
        # from here a stop signal is graceful (before: `job.early` exits 75 at once)
        self.stop = StopRequests(cfg.run, self._hard_exit)
        self.step_reached = self.start_step
        try:
            return self._run()
        except (WriteFailed, TierError, TierFull) as e:  # a file of the run, or the tier's
            return self._write_failed(str(e))

    def _run(self) -> int:
        cfg = self.cfg
        if self.rank == 0:
            with writing("the run directory", cfg.run.dir):
                os.makedirs(cfg.run.dir, exist_ok=True)
        self.ctl.barrier()  # the run directory exists before any rank writes into it
        if self.rank == 0:
            with writing("config.yaml", cfg.run.dir):
                atomic_write(os.path.join(cfg.run.dir, "config.yaml"), cfg.to_yaml())
            with writing("status.json", cfg.run.dir):
                write_status(cfg.run.dir, self.start_step)
            # how the job ends, should a rank fail or stop answering (the watchdog tells us)
            abort_on_end(lambda code, why: write_status(cfg.run.dir, self.step_reached, code, why))
            self._banner()
        self.t_start = time.perf_counter()
        if self.writes_metrics:
            with writing("metrics.jsonl", cfg.run.dir):
                self.metrics = MetricsWriter(cfg.run.dir, cfg.run.steps)
            self.peak = self.this_rank.peak_flops(self.classes)  # every rank's, for MFU
            if cfg.run.tensorboard:
                with writing("tensorboard/", cfg.run.dir):
                    self.tb = TensorBoard(cfg.run.dir)
        if self.peers is not None:
            self._recovered(self.peers.event)
        code, lost = EXIT_ERROR, False
        try:
            code = self._loop()
        except Exception as e:
            lost = faults.lost(e) and faults.watching()  # elastic: the survivors recover
            raise
        finally:
            if not lost:
                early.ended(code)  # a signal from now on: this code at once
            self.stop.close()
        if cfg.run.trace and code in (EXIT_OK, EXIT_STOPPED):
            with writing("trace.json", cfg.run.dir, "run.trace"):
                self.executor.write_trace(os.path.join(cfg.run.dir, "trace.json"))
        if self.rank == 0:
            abort_on_end(None)
            with writing("status.json", cfg.run.dir):
                write_status(cfg.run.dir, self.step_reached, code, self.why)
        self.close()
        return code

    def _write_failed(self, why: str) -> int:
        """A file of the run could not be written (a full or read-only disk): one line, the
        status if it can still be written, exit 5 (2 when nothing was trained yet); every rank
        ends (only this one knows)."""
        code = EXIT_CHECKPOINT if self.step_reached > self.start_step else EXIT_USAGE
        early.ended(code)
        self.stop.close()
        print(f"error: {why}; the last committed checkpoint is kept (exit {code})",
              file=sys.stderr, flush=True)
        abort_on_end(None)
        with contextlib.suppress(OSError):  # in place: it still fits when the disk is full
            write_status(self.cfg.run.dir, self.step_reached, code, why, state="write failed")
        if self.comm.Get_size() > 1:
            abort(None, code)
        with contextlib.suppress(OSError):
            self.close()
        return code

    def _loop(self) -> int:
        cfg = self.cfg
        cut = self.peers.save if self.peers is not None else None  # cut off by the loss
        if cut is not None and not self._save(cut):
            return EXIT_CHECKPOINT
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
            if cfg.data.eval_interval and n % cfg.data.eval_interval == 0 and self.eval_sets:
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
            # each rank's whole memory (resident set) beside its ledger peak, by world rank
            "rss_bytes": max(res.resident_bytes),
            "rss_bytes_by_rank": list(res.resident_bytes),
            "peak_ddr_bytes_by_rank": list(res.peaks_ddr_bytes),
            "mfu": tokens_per_step / dt * cfg.model.flops_per_token() / self.peak,
            "elapsed_s": time.perf_counter() - self.t_start,
        }
        log = n % cfg.run.log_interval == 0 or n == cfg.run.steps or n == self.start_step + 1
        with writing("metrics.jsonl", cfg.run.dir):
            self.metrics.write(rec, cfg.model.flops_per_token(), log=log)
        if self.tb is not None:
            with writing("tensorboard/", cfg.run.dir):
                self.tb.log(rec, "train")

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
        if self.this_rank.engine is None:
            return mine
        flag = np.array([1.0 if mine else 0.0])
        self.this_rank.engine.allreduce(flag, self.topo.comm, algo="tree").result()
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
        """The eval loss of each held-out file (one; or each source of a mixture, whose
        weighted mean is eval_loss) into eval.jsonl."""
        tokens = self.cfg.data.eval_batches * self.cfg.parallel.global_batch * self.cfg.model.seq_len
        losses = [(name, w, self.executor.eval_loss(
            eval_batches(ds, self.cfg.data.eval_batches, self.replica)))
            for name, w, ds in self.eval_sets]
        loss = sum(w * x for _, w, x in losses) / sum(w for _, w, _ in losses)
        if self.metrics is None:
            return
        rec = {"step": n, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
               "eval_tokens": tokens * len(losses)}
        for name, _, x in losses:
            if name:  # a mixture's source
                rec.update({f"eval_loss/{name}": x, f"eval_ppl/{name}": math.exp(min(x, 700.0))})
        rec["elapsed_s"] = time.perf_counter() - self.t_start
        with writing("eval.jsonl", self.cfg.run.dir):
            self.metrics.write_event(rec)
        if self.tb is not None:
            with writing("tensorboard/", self.cfg.run.dir):
                self.tb.log(rec, "eval")
        each = "".join(f" | {name} {x:.4f}" for name, _, x in losses if name)
        print(f"step {n:>5d} | eval loss {loss:.4f} | perplexity {rec['eval_ppl']:.2f}{each}",
              flush=True)

    def _save(self, n: int, stopping: bool = False) -> bool:
        """Checkpoint step n and log it; on failure (the same error on every rank) say so and
        return whether training goes on (`checkpoint.on_error`; never when stopping)."""
        self._doing(f"checkpoint save at step {n}")
        t0 = time.perf_counter()
        self.saving = n
        try:
            path = self._write_checkpoint(n)
        except CheckpointError as e:
            self.saving = None
            go_on = self.cfg.checkpoint.on_error == "continue" and not stopping
            self.why = "" if go_on else str(e).splitlines()[0]
            if self.rank == 0:
                then = (f"training goes on (checkpoint.on_error=continue); next try at step "
                        f"{n + self.cfg.checkpoint.interval}" if go_on else
                        f"stopping (exit {EXIT_CHECKPOINT}); set checkpoint.on_error=continue to "
                        "train on without checkpoints")
                print(f"{'warning' if go_on else 'error'}: {e}\n  {then}", file=sys.stderr,
                      flush=True)
            return go_on
        self.save_s = time.perf_counter() - t0
        self.saving = None
        if self.rank == 0:
            size = checkpoint_bytes(path)
            print(f"step {n:>5d} | checkpoint saved: {path} ({size / 2**20:.2f} MiB, {size} "
                  f"bytes, {self.save_s:.2f} s)", flush=True)
        return True

    def _write_checkpoint(self, n: int) -> str:
        cfg = self.cfg
        self.executor.flush()  # deferred updates applied: the saved masters are step n's
        own = self.state.state_dict() if holds_replicas(cfg) else None
        if self.executor.sharded or own is not None:
            # Each replica holds a segment of every block (sharded), or its own state (partial
            # sync: the model is the replicas' mean): gather or average one block at a time
            # while replica 0 writes it (every replica of the stage takes part).
            shapes = {p.name: p.shape for b in self.state.blocks for p in b.params}
            tensors = StateStream(shapes, STATE_BUFFERS,
                                  self.executor.iter_full_state(mean=own is not None))
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
            own=own,
        )

    def _banner(self) -> None:
        cfg = self.cfg
        m, p = cfg.model, cfg.parallel
        print(
            f"ratrain: {m.num_params() / 1e6:.2f}M params ({m.layers} layers, hidden {m.hidden}), "
            f"pp={p.pp} dp={p.dp} micro_batch={p.micro_batch} x {p.num_micro_batches}, "
            + (f"layers per stage {list(p.layers_per_stage)}, " if p.layers_per_stage else "")
            + (f"replica shares {list(p.replica_shares)}, " if p.replica_shares else "")
            + (f"rank classes {', '.join(c.name for c in cfg.platform.classes)}, "
               if cfg.platform.classes else "") +
            f"{self.topo.describe() if self.topo else '1 node x 1 rank'} ({p.placement}), "
            f"{cfg.precision}, policy {self.executor.policy.label}, recompute {cfg.schedule.recompute}, "
            + (f"sync partial (period {cfg.sync.period}, {cfg.sync.assign}, averaged "
               f"{cfg.sync.average}; optimizer state whole on every replica, "
               "schedule.shard_optimizer=false), "
               if cfg.sync.partial else "") +
            f"platform {self.profile.name}, {self.this_rank.ctx.threads} threads/rank, "
            f"device {self.this_rank.device.describe()} (rank 0), "
            f"{self.this_rank.ctx.kernels.describe()}, "
            f"steps {self.start_step + 1}..{cfg.run.steps}, run dir {cfg.run.dir}, "
            f"{self._memory_note()}"
            + (f", offload activations {cfg.offload.activations} optimizer "
               f"{cfg.offload.optimizer} to {tier_dir(cfg)} (tier "
               f"{self.profile.tier.name if self.profile.tier else 'not stated'})"
               if cfg.offload.enabled else "")
            + (f", model from {cfg.init.from_hf}" if cfg.init.from_hf else "")
            + (f", tokenizer {cfg.data.tokenizer}" if cfg.data.tokenizer else ""),
            flush=True,
        )

    def _memory_note(self) -> str:
        """Rank 0's memory at start (its resident set and the ledger's part of it) and what its
        timeline keeps."""
        ledger, run = self.this_rank.ledger, self.cfg.run
        kept = (f"trace timeline up to {run.trace_bytes / 2**20:.3g} MiB per rank (ledger tag "
                f"{TIMELINE_TAG}; the oldest steps dropped beyond)" if run.trace else
                "timeline of the current step only (run.trace off)")
        return (f"memory at start: rss {resident_bytes() / 2**20:.1f} MiB, ledger "
                f"{ledger.current / 2**20:.1f} MiB (rank 0), {kept}")

    def _recovered(self, event) -> None:
        """Elastic: record the recovery that made this job (metrics.jsonl, status.json, the
        log), once the new job is ready."""
        event.recovered_at = time.time()
        rec = event.record()
        if self.metrics is not None:
            with writing("metrics.jsonl", self.cfg.run.dir):
                self.metrics.event(rec)
        if self.rank == 0:
            print(f"ratrain: rank(s) {', '.join(map(str, event.lost))} lost; the survivors go "
                  f"on as {event.layout} from step {event.step} (state from {event.how}; "
                  f"{rec['detect_to_ready_s']:.2f} s from detection to the new job)", flush=True)
            with writing("status.json", self.cfg.run.dir):
                write_status(self.cfg.run.dir, event.step - 1, None,
                             f"recovered from lost rank(s) {event.lost} at step {event.step}")

    def abandon(self) -> None:
        """Elastic recovery: let go of this rank's engine, watchdog and files without the
        collective ends (their communicators are revoked; the survivors make new ones)."""
        eng = self.this_rank.engine
        if eng is not None:
            eng.close(timeout=2.0)
        if self.watchdog is not None:
            self.watchdog.abandon()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.tb is not None:
            self.tb.close()
        self.this_rank.close()


__all__ = ["Trainer"]
