"""Start-up of a run: every check of the input before any work, on every rank, agreed.

`startup(args, comm)` resolves the config and checks it against the world, the registered
collective algorithms (`comm.allreduce`), the rank's device and the kernels it asks for
(`run.fused`, `run.devkernels`, `run.attention`, `run.graphs`), finds every rank's
class (`platform.classes`: measured where a class says `calibrate`) and resolves what the
config leaves to the planner (`parallel.layers_per_stage` / `replica_shares`: auto), then checks the data, a Hugging
Face import, the memory plan (`plan.check`: against the DDR cap, or the node's memory without
one), the checkpoint to resume (and whether the run is finished already), the room for the next
checkpoint, and takes the run directory's lock; each check runs through `agree`, so a bad input
stops every rank with the same message. `comm` is the control plane (`comm.control.Control`) or
anything mpi4py-like.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from ratrain.job import tblog
from ratrain.checkpoint import checkpoint_root, load_checkpoint, read_manifest, resolve_resume
from ratrain.checkpoint.space import free_bytes, human_bytes, room_problem
from ratrain.comm.algos import check_choice
from ratrain.config import Config, ConfigError, load_config
from ratrain.config.offload import tier_dir
from ratrain.data import check_data, data_resume_problem, open_datasets, record_tokenizer
from ratrain.device import Device, local_rank, open_device
from ratrain.hf import check_hf, import_model_section
from ratrain.exec import graphs
from ratrain.exec.backends import kernels_for
from ratrain.exec.context import ExecContext, sgemm_rate
from ratrain.lifecycle.pipeline import check_passes
from ratrain.plan.check import available_memory, run_plan
from ratrain.plan.hetero import resolve, with_measured_rates
from ratrain.shim import allocator
from ratrain.shim.platform import class_map, node_name
from ratrain.comm.topology import coords
from ratrain.job.runctl import check_writable, lock_dirs


class StartupError(RuntimeError):
    """Bad input found before any work; the message is the same on every rank."""


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
    cfg = load_config(args.config, args.overrides, allow_empty=False)
    if cfg.init.from_hf:
        # The model section comes from the checkpoint's config.json (seq_len stays ours).
        cfg = import_model_section(cfg, cfg.init.from_hf, args.overrides)
    return cfg


@dataclass
class Setup:
    cfg: Config
    data_paths: object
    resume: str | None
    finished: str | None = None  # a message: the run is already done, nothing to train
    classes: tuple | None = None  # every world rank's class (`platform.classes`), or None
    device: Device | None = None  # this rank's (`run.device`); None: the host's numpy
    locks: list = field(default_factory=list)  # RunLock of run.dir (and checkpoint.dir), rank 0

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def check_memory(cfg: Config, rank: int, device: Device | None = None) -> None:
    """The memory plan of this rank's stage against the DDR cap, or without a cap against the
    memory this node has for its ranks (`plan.check`; refused only beyond the plan's error);
    on a GPU, also against the card's memory, shared by the node's ranks on that card."""
    from ratrain.comm.progress import local_ranks  # loads MPI (loaded already under a launcher)

    plan = run_plan(cfg, rank)
    on_host = device is None or device.memory_bytes is None
    plan.check(rank, tolerance=0.9, available=available_memory() if on_host else None,
               local_ranks=local_ranks() or 1)
    check_device_memory(cfg, rank, device, plan)


def check_tier(cfg: Config, rank: int, plan=None) -> None:
    """The memory tier (`offload.*`): its directory (`offload.path`, which must exist; the
    default under run.dir is made) writable, this rank's predicted bytes in the tier within its
    share of `platform.tier_bytes`, and the storage's free space enough for the node's ranks
    there (`plan`: `run_plan(cfg, rank)` when made already)."""
    from ratrain.comm.progress import local_ranks  # loads MPI (loaded already under a launcher)

    if not cfg.offload.enabled:
        return
    if cfg.offload.optimizer != "off" and cfg.run.device != "cpu":
        raise ConfigError(f"offload.optimizer={cfg.offload.optimizer} keeps the optimizer state "
                          f"in host memory-mapped files, which run.device={cfg.run.device} does "
                          "not read in place: set offload.optimizer=off there (activations may "
                          "still go to the tier)")
    path = tier_dir(cfg)
    key = "offload.path" if cfg.offload.path else "run.dir"
    if cfg.offload.path and not os.path.isdir(path):
        why = "is not a directory" if os.path.exists(path) else "does not exist"
        raise OSError(f"the memory tier at offload.path={path} {why}: make the directory, or "
                      "set offload.path to one (\"\" = <run.dir>/tier)")
    check_writable(path, key)
    plan = plan or run_plan(cfg, rank)
    stage, _ = coords(rank, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.placement)
    need = plan.tier_peaks[stage] if plan.tier_peaks is not None else 0
    if plan.tier_cap is not None and need > plan.tier_cap:
        raise OSError(f"rank {rank} (stage {stage}) is predicted to hold {human_bytes(need)} in "
                      f"the memory tier, over its share {human_bytes(plan.tier_cap)} of "
                      f"platform.tier_bytes (tier at {key}={path}): offload fewer layers "
                      "(offload.activations=auto), keep the optimizer state (offload.optimizer="
                      "off), or raise platform.tier_bytes")
    ranks = local_ranks() or 1
    free = free_bytes(path)
    if need * ranks > free:
        raise OSError(f"the memory tier at {key}={path} has {human_bytes(free)} free, the "
                      f"{ranks} rank(s) of this node need about {human_bytes(need * ranks)} "
                      f"there: free space, set offload.path to a larger disk, or offload less")


def check_device_memory(cfg: Config, rank: int, device: Device | None, plan=None) -> None:
    """On a GPU, this rank's stage against the card's memory, shared by the node's ranks on
    that card (`RunPlan.check_device`; `plan`: `run_plan(cfg, rank)` when made already);
    nothing on the host."""
    from ratrain.comm.progress import local_ranks  # loads MPI (loaded already under a launcher)

    if device is not None and device.memory_bytes is not None:
        (plan or run_plan(cfg, rank)).check_device(rank, device, local_ranks() or 1)


def rank_device(cfg: Config) -> Device:
    """This rank's device (`run.device`; a GPU: card local rank % visible), checked to work."""
    return open_device(cfg.run.device, local_rank())


def finished_message(cfg: Config, resume: str | None) -> str | None:
    """Why there is nothing to train: the checkpoint to resume is at run.steps already."""
    if resume is None:
        return None
    step = read_manifest(resume)["step"]
    if step < cfg.run.steps:
        return None
    return (f"nothing to do: resumed at step {step} ({resume}, checkpoint.resume="
            f"{cfg.checkpoint.resume}), run.steps={cfg.run.steps}: the run is finished; raise "
            "run.steps to train on, or set checkpoint.resume=never to start over")


def check_data_position(cfg: Config, data_paths, resume: str) -> None:
    """The checkpoint's data position continues this run's data: a mixture changed since it
    was written (sources, weights, their tokens, order, seed, seq_len) is refused, since the
    resumed run would not read what the uninterrupted one reads (`data.data_resume_problem`)."""
    saved = load_checkpoint(resume, names=[], buffers=())["state"].get("data")
    problem = data_resume_problem(saved, open_datasets(cfg, data_paths)[0])
    if problem:
        raise ConfigError(
            f"checkpoint {resume} cannot continue this run's data: {problem}; restore "
            "data.sources as they were, or start afresh (checkpoint.resume=never)")


def rank_classes(cfg: Config, comm):
    """The class of every world rank (`platform.classes`; None without classes), each rank's
    node named by itself; with `calibrate` classes, their compute rates measured here (each
    rank's sgemm rate, a class taking its slowest rank's), the same config on every rank.
    Then the planner's counts for `parallel.*: auto` (`plan.hetero.resolve`)."""
    hosts = comm.allgather(node_name()) if comm.Get_size() > 1 else [node_name()]
    classes = agree(comm, class_map, cfg.platform, hosts)
    if any(c.calibrate for c in cfg.platform.classes):
        rate = measured_rate(cfg)  # every rank, at the same point
        rates = comm.allgather(rate) if comm.Get_size() > 1 else [rate]
        cfg = agree(comm, with_measured_rates, cfg, classes, rates)
    return agree(comm, resolve, cfg, classes), classes


def check_graphs(cfg: Config, xp, kernels) -> None:
    """One line where `run.graphs: on` asks for graphs this rank's block calls cannot be."""
    graphs.resolve(cfg.run.graphs, ExecContext(cfg.model, cfg.precision, xp, kernels=kernels),
                   cfg.offload.activations != "off")


def measured_rate(cfg: Config) -> float:
    """This rank's sgemm rate in flop/s (best of three), at `run.threads` or its share of the
    node's cores, measured while the node's other ranks measure theirs (as they will compute)."""
    from ratrain.comm.progress import cores, local_ranks  # loads MPI (loaded already here)

    threads = cfg.run.threads or max(1, cores() // (local_ranks() or 1))
    rate = sgemm_rate(threads)
    return max(rate() for _ in range(3))


def startup(args, comm) -> Setup:
    cfg = agree(comm, resolve_config, args)
    allocator.tune(cfg.run.malloc)  # freed DDR stays in the process, as on the cluster
    agree(comm, cfg.check_world, comm.Get_size())
    agree(comm, check_passes, cfg)  # sync.mode: partial, offload.*: what they cannot run with
    agree(comm, check_choice, cfg.comm.allreduce)  # a registered algorithm (`comm.algos`)
    device = agree(comm, rank_device, cfg)  # cupy and a card that works, before any work
    kernels = agree(comm, kernels_for, cfg, device.xp)  # run.fused / devkernels / attention
    agree(comm, check_graphs, cfg, device.xp, kernels)  # run.graphs: on where layers capture
    cfg, classes = rank_classes(cfg, comm)
    data_paths = agree(comm, check_data, cfg, comm)
    cfg = agree(comm, record_tokenizer, cfg, data_paths)
    if cfg.init.from_hf:
        agree(comm, check_hf, cfg.init.from_hf, cfg.model)
    if cfg.run.tensorboard:
        agree(comm, tblog.check)
    agree(comm, lambda: comm.Get_rank() == 0 and check_writable(cfg.run.dir, "run.dir"))
    resume = agree(comm, lambda: resolve_resume(cfg.checkpoint, cfg.run.dir, cfg.model, comm=comm))
    if getattr(args, "dry_run", False):  # the plan is the dry run's own report
        return Setup(cfg, data_paths, None, classes=classes, device=device)
    agree(comm, check_memory, cfg, comm.Get_rank(), device)
    agree(comm, check_tier, cfg, comm.Get_rank())
    done = agree(comm, finished_message, cfg, resume)
    if resume and not done:
        agree(comm, check_data_position, cfg, data_paths, resume)
    if done:
        return Setup(cfg, data_paths, resume, finished=done, classes=classes, device=device)
    root = checkpoint_root(cfg.checkpoint, cfg.run.dir)
    if cfg.checkpoint.interval and cfg.checkpoint.on_error == "stop":
        agree(comm, lambda: comm.Get_rank() == 0 and _no_room(root, cfg))
    locks = agree(comm, lambda: [] if comm.Get_rank() else lock_dirs(cfg.run.dir, root, _note))
    return Setup(cfg, data_paths, resume, locks=locks, classes=classes, device=device)


def _note(msg: str) -> None:
    print(f"ratrain: {msg}", file=sys.stderr, flush=True)


def _no_room(root: str, cfg: Config) -> None:
    problem = room_problem(root, cfg)
    if problem:
        raise OSError(problem)


__all__ = ["Setup", "StartupError", "agree", "check_data_position", "check_device_memory",
           "check_memory", "check_tier",
           "finished_message", "rank_classes", "rank_device", "resolve_config", "startup"]
