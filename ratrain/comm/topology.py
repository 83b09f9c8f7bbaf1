"""Topology: rank <-> (stage, replica) on the pp x dp grid, nodes, and the sub-communicators.

Placement (`parallel.placement`) says which grid axis is laid out on neighbouring ranks, hence
stays inside a node (launchers fill a node with consecutive ranks):

    pp  rank = replica * pp + stage: a replica's stages are neighbours (pipeline messages stay
        inside a node; a stage's replicas, and its gradient all-reduce, span nodes)
    dp  rank = stage * dp + replica: a stage's replicas are neighbours (the gradient
        all-reduce stays inside a node, or has many ranks per node; pipeline messages cross)

Nodes: ranks that share memory (MPI's shared-memory split) and a processor name are one node;
under the platform's emulation a node of the host can be cut into nodes of the platform's
`ranks_per_node` consecutive ranks (one host playing several nodes). Every rank knows its node,
its local rank, and each collective group's members by node (`hier.NodeGroup`: the world and
its data-parallel group), for the hierarchical collectives.

    topo = Topology(MPI.COMM_WORLD, pp=2, dp=2, placement="pp")
    topo.stage, topo.replica              # this rank's place
    topo.node, topo.local_rank            # its node (0 holds rank 0) and rank inside it
    topo.pp_comm                          # the ranks of my replica, ordered by stage
    topo.dp_comm                          # the ranks of my stage, ordered by replica
    topo.prev_rank, topo.next_rank        # neighbours in pp_comm (None at the pipeline's ends)
    topo.group(topo.dp_comm)              # the NodeGroup of a communicator (None for pp_comm)
"""

from __future__ import annotations

import os

import numpy as np

PLACEMENTS = ("pp", "dp")
WORLD_BYTES = 64 << 10  # the world group carries the step's facts: a few KiB


def grid(pp: int, dp: int, placement: str = "pp") -> np.ndarray:
    """World ranks by (replica, stage)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    if placement == "pp":
        return np.arange(pp * dp).reshape(dp, pp)
    return np.arange(pp * dp).reshape(pp, dp).T


def coords(rank: int, pp: int, dp: int = 1, placement: str = "pp") -> tuple[int, int]:
    """(stage, replica) of a world rank."""
    if placement == "pp":
        return rank % pp, rank // pp
    return rank // dp, rank % dp


def pack_nodes(hosts, ranks_per_node: int | None = None) -> list[int]:
    """Node ids (0 holds rank 0, numbered by first rank) of ranks whose hosts are `hosts`
    (any hashable, by world rank): one node per host, or each host's ranks cut into nodes of
    `ranks_per_node` consecutive ranks."""
    seen: dict = {}
    count: dict = {}
    out = []
    for h in hosts:
        local = count.get(h, 0)
        count[h] = local + 1
        key = (h, local // ranks_per_node) if ranks_per_node else h
        out.append(seen.setdefault(key, len(seen)))
    return out


def srun_node(rank: int, size: int, env=os.environ) -> str | None:
    """The node of the allocation srun started this rank on (`SLURM_NODEID`), when srun
    started the ranks themselves (`SLURM_PROCID` is the world rank and the step has the world's
    tasks); None otherwise (mpirun's ranks inherit their daemon's Slurm variables)."""
    if env.get("SLURM_PROCID") != str(rank) or env.get("SLURM_STEP_NUM_TASKS") != str(size):
        return None
    return env.get("SLURM_NODEID") or None


def host_keys(found: list) -> list:
    """The host of every rank from what each found (`find_hosts`): (processor name, lowest rank
    sharing memory with it), split further by srun's node when srun placed every rank. A node
    is ranks that can share memory windows, so a node never spans MPI's shared-memory groups: on
    real nodes srun's nodes and those groups agree; two slurmd on one host are not real nodes
    (there MPI's locality, from each slurmd's PMIx server, put the four ranks of `-N 2
    --ntasks-per-node=2` in groups of 1+1+2, and a window over srun's two nodes fails with
    MPI_ERR_RMA_SHARED), so they keep MPI's groups."""
    return [(mine, slurm) for mine, slurm in found]


def find_hosts(comm) -> list:
    """The host of every rank of `comm` (`host_keys`); collective."""
    from mpi4py import MPI  # comm is an MPI communicator: MPI is loaded already

    shm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = shm.allreduce(comm.Get_rank(), op=MPI.MIN)
    shm.Free()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return host_keys(comm.allgather(((MPI.Get_processor_name(), leader), srun_node(rank, size))))


class Topology:
    def __init__(self, comm, pp: int, dp: int, placement: str = "pp",
                 ranks_per_node: int | None = None, shm_bytes: int = 1 << 20):
        """Collective over `comm`. `ranks_per_node`: cut each host's ranks into nodes of that
        many (None: one node per host); `shm_bytes`: the largest buffer the data-parallel
        group's collectives usually carry (sizes its staging window)."""
        from ratrain.comm.hier import NodeGroup  # loads MPI: comm is MPI's

        assert isinstance(pp, int) and pp >= 1, f"pp must be a positive integer, got {pp!r}"
        assert isinstance(dp, int) and dp >= 1, f"dp must be a positive integer, got {dp!r}"
        world = comm.Get_size()
        assert world == pp * dp, (
            f"world size {world} != pp x dp = {pp} x {dp} = {pp * dp}: launch {pp * dp} ranks or "
            "change parallel.pp / parallel.dp"
        )
        self.comm = comm
        self.pp, self.dp, self.world, self.placement = pp, dp, world, placement
        self.rank = comm.Get_rank()
        self.grid = grid(pp, dp, placement)
        self.stage, self.replica = coords(self.rank, pp, dp, placement)
        assert self.grid[self.replica, self.stage] == self.rank
        # Split is collective: every rank calls each, in the same order.
        self.pp_comm = comm.Split(color=self.replica, key=self.stage)
        self.dp_comm = comm.Split(color=self.stage, key=self.replica)
        self.pp_comm.Set_name(f"pp[replica {self.replica}]")
        self.dp_comm.Set_name(f"dp[stage {self.stage}]")
        assert self.pp_comm.Get_rank() == self.stage and self.pp_comm.Get_size() == pp
        assert self.dp_comm.Get_rank() == self.replica and self.dp_comm.Get_size() == dp
        self.is_first = self.stage == 0
        self.is_last = self.stage == pp - 1
        self.prev_rank = None if self.is_first else self.stage - 1  # in pp_comm
        self.next_rank = None if self.is_last else self.stage + 1  # in pp_comm

        hosts = find_hosts(comm)
        self.node_of = pack_nodes(hosts, ranks_per_node)
        self.node = self.node_of[self.rank]
        self.nodes = max(self.node_of) + 1
        mine = [w for w in range(world) if self.node_of[w] == self.node]
        self.local_rank, self.local_size = mine.index(self.rank), len(mine)
        self.node_comm = comm.Split(color=self.node, key=self.rank)
        self.node_comm.Set_name(f"node[{self.node}]")
        dp_nodes = [self.node_of[int(w)] for w in self.grid[:, self.stage]]
        self.world_group = NodeGroup(comm, self.node_of, nbytes=WORLD_BYTES)
        self.dp_group = NodeGroup(self.dp_comm, dp_nodes, nbytes=shm_bytes)

    def world_rank(self, stage: int, replica: int) -> int:
        assert 0 <= stage < self.pp and 0 <= replica < self.dp, (
            f"(stage {stage}, replica {replica}) is outside the {self.pp} x {self.dp} grid"
        )
        return int(self.grid[replica, stage])

    def group(self, comm):
        """The NodeGroup of `comm` (the world or the data-parallel communicator), else None."""
        if comm == self.dp_comm:
            return self.dp_group
        if comm == self.comm:
            return self.world_group
        return None

    def nodes_of(self, comm) -> list[int]:
        """The node of each rank of `comm` (a communicator of this topology's world's ranks)."""
        ranks = comm.Get_group().Translate_ranks(list(range(comm.Get_size())), self.comm.Get_group())
        return [self.node_of[w] for w in ranks]

    @property
    def shm_bytes(self) -> int:
        """Bytes of shared memory this rank holds for the collectives' staging."""
        return self.world_group.staging.nbytes + self.dp_group.staging.nbytes

    def describe(self) -> str:
        """`2 nodes x 4 ranks` (or the ranks of each node when they differ)."""
        sizes = [self.node_of.count(n) for n in range(self.nodes)]
        if len(set(sizes)) == 1:
            return f"{self.nodes} node{'s' * (self.nodes > 1)} x {sizes[0]} rank{'s' * (sizes[0] > 1)}"
        return f"{self.nodes} nodes of {'+'.join(map(str, sizes))} ranks"

    def free(self) -> None:
        for group in (self.dp_group, self.world_group):
            group.free()
        for c in (self.node_comm, self.pp_comm, self.dp_comm):
            c.Free()

    def __repr__(self) -> str:
        return (f"Topology(rank {self.rank} = stage {self.stage} of {self.pp}, "
                f"replica {self.replica} of {self.dp}, node {self.node} of {self.nodes})")


class NodeLinks:
    """The shim's two link levels (`ratrain.shim.link.Levels`) resolved per message: a message
    between ranks of one node crosses the sender's intra-node link, one between nodes the
    node's interface. `latency`, `bandwidth`, `time_scale`, `chunk_bytes` and `intra` are the
    levels' (what cost models and the collectives' pacing ask)."""

    def __init__(self, levels, topology: Topology):
        self.levels, self.topo = levels, topology
        self.intra, self.inter = levels.intra, levels.inter
        self.latency, self.bandwidth = levels.latency, levels.bandwidth
        self.time_scale, self.chunk_bytes = levels.time_scale, levels.chunk_bytes
        self._nodes: dict[int, list[int]] = {}  # communicator handle -> node of each rank

    def resolve(self, comm, peer: int):
        """The link a message between this rank and rank `peer` of `comm` crosses."""
        key = comm.py2f()
        nodes = self._nodes.get(key)
        if nodes is None:
            nodes = self._nodes[key] = self.topo.nodes_of(comm)
        return self.levels.level(nodes[peer] == nodes[comm.Get_rank()])

    def __repr__(self) -> str:
        return f"NodeLinks({self.levels})"


def teardown(engine=None, slots=None, topo=None) -> None:
    """End what a rank opened for its messages, in the one safe order: the engine's thread
    first (it may still use the communicators), the node's interface slots, then the
    topology's communicators. Any of them may be None (never opened)."""
    if engine is not None:
        engine.close()
    if slots is not None:
        slots.free()
    if topo is not None:
        topo.free()


__all__ = ["NodeLinks", "PLACEMENTS", "Topology", "coords", "find_hosts", "grid", "pack_nodes",
           "teardown"]
