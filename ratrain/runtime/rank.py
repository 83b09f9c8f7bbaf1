"""One way to build a rank: config -> plan -> platform -> topology -> ledger -> state ->
context -> engine -> executor -> recompute.

    rank = build_rank(cfg, MPI.COMM_WORLD)            # or comm=None for one process (no MPI)
    res = rank.executor.run_step(step, batch)
    rank.close()

Every part comes from the config. The pipeline's plan (`lifecycle.pipeline.PipelinePlan`:
policy, stages, step lists, validated; this replica's micro-batch count) is made first, pure.
The platform profile (`platform.*`; the rank's class's under `platform.classes`, which
`shim.platform.rank_profile` finds from the rank or its node) gives the DDR cap of the
ledger, the link throttle of the communication engine in two levels (inside a node, and the
node's interface, whose slots the node's ranks share) and the compute pacer (both only under
`platform.emulate`, where one host's ranks are also cut into nodes of the profile's
`ranks_per_node`); `parallel.placement` lays the grid on the ranks (`comm.topology`); the
staging windows of the hierarchical collectives are sized for the stage's largest gradient and
accounted in the ledger (`comm.shm`); the stage's blocks come from `parallel.pp` /
`layers_per_stage`; the kernel table (`exec.backends`: which implementation runs each op, from
`run.fused`, `run.devkernels`, `run.attention` and the device) is made once, for the state and
the context; a policy
that shards the optimizer state (`ratrain` at dp > 1) gets a state sharded from the start, so the
whole stage's state is never allocated; `run.threads` (0: the cores the launcher gives this
rank, `local_threads`; results never depend on it) sets the compute threads. `load(state)`
runs after the state is built and before the executor, to put checkpointed or imported weights
in. Last, one explicit step at the same point on every rank measures the stage's activation
sizes (collective when sharded: views are gathered) and sets the recompute choice
(`runtime.measure.fit_rank_recompute`); no constructor runs a collective.
The trainer, the benchmarks and the tests all build their ranks here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


from ratrain.comm.topology import NodeLinks, Topology, coords, teardown
from ratrain.device import Device, local_rank, open_device
from ratrain.exec.backends import kernels_for
from ratrain.exec.context import ExecContext, sgemm_rate
from ratrain.exec.params import GRAD_BYTES_PER_PARAM, StageState, held_elements
from ratrain.exec.spec import block_params, stage_blocks
from ratrain.runtime.executor import Executor
from ratrain.runtime.measure import fit_rank_recompute
from ratrain.lifecycle.passes import offload
from ratrain.runtime.passes.offload import open_tier
from ratrain.lifecycle.pipeline import PipelinePlan
from ratrain.shim.ledger import Ledger
from ratrain.shim.link import Levels
from ratrain.shim.pacing import Pacer
from ratrain.shim.platform import Profile, class_profile, rank_profile

PROFILE_CAP = object()  # build_rank(cap=...): the profile's DDR cap (the default)


@dataclass
class Rank:
    """Everything one rank holds; `close()` ends its engine and frees its communicators."""

    cfg: object
    profile: Profile
    topo: object | None  # comm.topology.Topology (None for one process)
    ledger: Ledger
    state: StageState
    ctx: ExecContext
    engine: object | None  # comm.engine.CommEngine (None for one process)
    executor: Executor
    slots: object | None = None  # comm.shm.SharedSlots of the node's interface (emulation)
    device: Device | None = None  # where it computes (`run.device`)
    tier_slots: object | None = None  # ... of the node's memory tier (emulation, offload.*)

    def peak_flops(self, classes=None) -> float:
        """The job's peak compute rate in flop/s, for MFU: every rank's platform rate
        (`compute_flops`, in emulated time under `time_scale`; each rank its class's, `classes`
        naming every world rank's), or on a profile without one (`host`) this rank's measured
        sgemm rate at its thread count (best of three) times the world."""
        world = self.cfg.parallel.world_size
        rates = ([class_profile(self.cfg.platform, c).compute_flops for c in classes]
                 if classes is not None else [self.profile.compute_flops] * world)
        if all(rates):
            return sum(rates) / self.profile.time_scale
        rate = sgemm_rate(self.ctx.threads)
        return max(rate() for _ in range(3)) * world

    def close(self) -> None:
        for runner in self.executor.runners.values():  # the passes' (offload: the tier's files)
            runner.close()
        _free(self.tier_slots)
        teardown(self.engine, self.slots, self.topo)
        self.ctx.close()


def _free(slots) -> None:
    if slots is not None:
        slots.free()


def shard_state(state, plan, replica: int) -> None:
    """Cut a whole-block `state` to this replica's segments when `plan`'s policy shards the
    optimizer state (its views are dropped: the next step makes them)."""
    if plan.shards > 1 and not state.sharded:
        for b in state.blocks:
            state.drop_view(b.name)
        state.shard(replica, plan.shards)


def local_threads(cfg, comm=None) -> int:
    """Compute threads per rank: `run.threads`, else the cores the launcher gives this rank.

    Those are the cores of this process's CPU affinity (`mpirun --bind-to core`, `srun
    --cpus-per-task`, a cgroup), shared evenly by the ranks of its node whose affinity overlaps
    it (ranks launched unbound all see every core of the node and split them)."""
    if cfg.run.threads:
        return cfg.run.threads
    mine = _affinity()
    sharing = 1
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI  # comm is an MPI communicator here: MPI is loaded already

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        sharing = sum(1 for cores in node.allgather(sorted(mine)) if mine & set(cores))
        node.Free()
    return max(1, len(mine) // sharing)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def _open_comm(cfg, comm, profile, ledger, watchdog_s):
    """The topology, the engine (with the two-level link throttle under emulation) and the
    node's shared interface slots, for a world of more than one rank."""
    from ratrain.comm.engine import CommEngine  # loads MPI: only for more than one rank
    from ratrain.comm.shm import SharedSlots  # loads MPI too

    p = cfg.parallel
    stage, _ = coords(comm.Get_rank(), p.pp, p.dp, p.placement)
    largest = max(block_params(cfg.model, b.role) for b in
                  stage_blocks(cfg.model, p.pp, stage, p.stage_layers()))
    topo = Topology(comm, p.pp, p.dp, p.placement,
                    profile.ranks_per_node if profile.emulate else None,
                    shm_bytes=GRAD_BYTES_PER_PARAM * largest)
    slots = engine = tier_slots = None
    try:
        ledger.reserve("comm.shm", topo.shm_bytes)
        levels = None
        if profile.emulate and profile.link_bandwidth:
            slots = SharedSlots(topo.node_comm)
            levels = Levels.from_profile(profile, shared=slots)
        if profile.emulate and cfg.offload.enabled and profile.tier and profile.tier.bandwidth:
            tier_slots = SharedSlots(topo.node_comm)  # the node's tier, shared like its interface
        engine = CommEngine(topo, watchdog_s=watchdog_s,
                            link=NodeLinks(levels, topo) if levels is not None else None,
                            ledger=ledger, config=cfg.comm)
    except BaseException:
        _free(tier_slots)
        teardown(engine, slots, topo)
        raise
    return topo, engine, slots, tier_slots


def build_rank(cfg, comm=None, *, cap=PROFILE_CAP, watchdog_s: float | None = 300.0, load=None,
               device: Device | None = None, validate: bool = True) -> Rank:
    """This process's rank of `cfg` (see the module). `comm`: the world communicator (None or
    one rank for pp = dp = 1); `cap`: the ledger's DDR cap (default: the profile's, or on a
    GPU without one the card's memory; None: none); `watchdog_s`: the engine's watchdog;
    `device`: where it computes (default: `run.device` opened here)."""
    p = cfg.parallel
    world = p.pp * p.dp
    if world > 1 and (comm is None or comm.Get_size() != world):
        got = 1 if comm is None else comm.Get_size()
        raise ValueError(f"pp={p.pp} x dp={p.dp} needs a communicator of {world} ranks, got {got}")
    rank_id = comm.Get_rank() if comm is not None else 0
    _, my_replica = coords(rank_id, p.pp, p.dp, p.placement)
    # pure: before any buffer (this replica's micro-batches under `parallel.replica_shares`)
    plan = PipelinePlan.from_config(cfg, replica=my_replica, validate=validate)
    profile = rank_profile(cfg.platform, rank_id)  # its class's under `platform.classes`
    if device is None:  # a GPU: card local rank % visible, as the trainer's start-up picks
        device = open_device(cfg.run.device, local_rank())
    xp = device.xp
    if cap is PROFILE_CAP:  # the platform's DDR cap, else the card's memory (None on the host)
        cap = profile.ddr_bytes or device.memory_bytes
    ledger = Ledger(cap, rank_id)
    topo = engine = slots = tier_slots = tier = None
    stage = replica = 0
    if world > 1:
        topo, engine, slots, tier_slots = _open_comm(cfg, comm, profile, ledger, watchdog_s)
        stage, replica = topo.stage, topo.replica
    try:
        shards = plan.shards
        kernels = kernels_for(cfg, xp)  # which implementation runs each op: chosen once
        blocks = stage_blocks(cfg.model, p.pp, stage, p.stage_layers())
        shard = (replica, shards) if shards > 1 else None
        # the memory tier (offload.*): its files, and the optimizer state that lives there
        tier, external = open_tier(cfg, profile, rank_id, held_elements(blocks, shard), tier_slots)
        state = StageState(blocks, cfg.precision, ledger, xp, cfg.init.seed, shard=shard,
                           kernels=kernels, external=external)
        if load is not None:
            load(state)
        ctx = ExecContext(cfg.model, cfg.precision, xp, ledger=ledger,
                          threads=local_threads(cfg, comm), kernels=kernels,
                          head_chunk_bytes=cfg.run.head_chunk_mib << 20)
        pacer = Pacer(profile) if profile.emulate else None
        executor = Executor(cfg, plan, topo, state, ctx, engine, ledger, pacer=pacer,
                            resources={offload.NAME: tier})
        # measured and chosen here, at the same point on every rank (collective when sharded)
        executor.set_recompute(*fit_rank_recompute(executor))
        for runner in executor.runners.values():  # the passes' (the peer copies' first fill)
            runner.start()
    except BaseException:
        if tier is not None:
            tier.store.close()
        _free(tier_slots)
        teardown(engine, slots, topo)
        raise
    return Rank(cfg, profile, topo, ledger, state, ctx, engine, executor, slots, device,
                tier_slots)


__all__ = ["PROFILE_CAP", "Rank", "build_rank", "local_threads", "shard_state"]
