"""Elastic mode: the job survives a lost rank (MPI's fault tolerance, ULFM).

Owns: whether the MPI and the launch can deliver it (`launch`: Open MPI's ULFM under
`mpirun --with-ft ulfm`, refused in one line otherwise); what the survivors agree and the
smaller job they go on as (`recover`: who is lost, the step that holds, the new layout and
where each part of the state comes from); the state moved from the old layout to the new one
in memory (`reshard`). A lost peer is noticed by `ratrain.job.faults`; the trainer's loop
(`ratrain.train.survive`) runs the recovery and builds the new job; the copies of a sharded
optimizer state that make a lost segment recoverable are a pass over the step
(`lifecycle.passes.mirror`, `runtime.passes.mirror`).

May import: `ratrain.lifecycle` (the new plan's sharding), `ratrain.comm` (the grid),
`ratrain.exec` (segments), `ratrain.job` (faults, exit codes), `ratrain.config`; mpi4py.
Never plan, runtime or the commands (the training command drives it).
"""
