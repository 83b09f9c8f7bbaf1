"""The life of a job: how it starts, is watched, stops and ends, and what it leaves behind.

Owns: the exit codes, the run directory's lock, stop signals and the wall-clock budget
(`runctl`); one failing rank stopping the job, every rank saying why (`abort`); the job's
watchdog: heartbeats, the rank that stopped answering named on every rank (`watchdog`); the
control plane's small pickled exchanges that never block inside MPI (`control`); a lost
peer, as MPI's fault tolerance reports it, noticed wherever a rank waits (`faults`, elastic
mode); the run's records: `metrics.jsonl`, `eval.jsonl` and the progress line (`metrics`), optional TensorBoard
scalars (`tblog`).

May import: `ratrain` (its version), `ratrain.fileio` (every file is written through its
protocol); mpi4py, numpy and the optional tensorboardX. Never config, shim, comm or anything
above: the trainer hands in what a job needs. Importing this package does not initialise MPI;
`abort` and `faults` import mpi4py.MPI inside their functions, `watchdog` and `control` at
their top (which does).
"""
