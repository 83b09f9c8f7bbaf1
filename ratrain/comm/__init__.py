"""Communication: who talks to whom, and every byte that moves between ranks.

Owns: the topology of the pp x dp grid, its placement on ranks, nodes and local ranks, and its
sub-communicators; the shim's two link levels resolved per message (`topology`); messages on the
wire, chunked under the shim's link throttle (`wire`); the generator protocol of operations and
their drivers (`progress`); point-to-point verbs named by direction (`p2p`); ring and tree
collectives written on point-to-point (`ring`, `tree`), hierarchical ones on shared-memory
windows inside a node and point-to-point chains across nodes (`hier`, its windows in `shm`),
MPI's own as the reference only (`mpiref`); the registry of these algorithms, each with its
operations, its documented order and its cost terms, and the one rule that chooses among them,
shared with the planner (`algos`); what each algorithm costs, pure arithmetic (`model`); the
collective calls by algorithm name (`collectives`, buffers and reductions in `arrays`); the
engine thread that overlaps communication with compute, with its operation timeout (`engine`);
the benchmark `python -m ratrain.comm.bench`. The job's abort, watchdog and control plane live
in `ratrain.job`.

May import: `ratrain.shim` (the link model and throttle, the allocator), `ratrain.config` (the
`comm` section: the all-reduce algorithm, the message log), `ratrain.job.faults` (elastic
mode: a lost peer ends a wait); mpi4py and numpy. Never exec,
lifecycle, plan or the commands. Importing this package does not initialise MPI; the
submodules that need it import mpi4py.MPI (which does); `algos`, `model`, `arrays` and
`topology` never do. No `RATRAIN_*` variable is read here (the config's `comm` section says
how a rank communicates); only the launcher's own (a node's rank count, srun's node).

Importing it sets `OMPI_MCA_osc=^ucx` unless the environment sets OMPI_MCA_osc: the shared-memory
windows of `shm` need Open MPI's `sm` one-sided component, and the pip wheel's UCX component
prints an error on every rank when it is asked first (MPI reads it at initialisation, which
happens later, when a submodule imports mpi4py.MPI).
"""

import os

os.environ.setdefault("OMPI_MCA_osc", "^ucx")
