"""The lifecycle: a training step as data, placed by policies, checked, and run.

Owns: the action vocabulary, its names and the pure 1F1B / GPipe builders (`schedule`); the
policies that place gradient syncs, updates, views and recomputation per block and stage
(`policies`); partial synchronization's parameter averages in place of the gradient syncs
(`partial`); a pipeline decided once as data, made from the config with no MPI and no
buffer, validated once, that the executor, the planner, the benches and the grid all take
(`pipeline.PipelinePlan`); the validator (`validate`) and the grid printer (`grid`); the memory model of one
rank, played over its action lists (`memory`), and the activation sizes measured from the
kernels (`measure`); offload to the memory tier as lifecycle actions, where they go, what they
hold and which layers to offload (`offload`), and the executor's side of them (`offloader`); the
executor that runs a rank's lists (`executor`) with its stage compute
(`compute`), its pipeline messages (`mailbox`), the step's global facts (`facts`) and whole
blocks for checkpoints (`fullstate`); timelines out (`trace`); the one way to build a rank
(`rank`); `python -m ratrain.lifecycle.bench` (grids, memory and timing of the policies).

May import: `ratrain.comm`, `ratrain.exec`, `ratrain.shim`, `ratrain.config`,
`ratrain.fileio`, `ratrain.device` (batches in, sums and losses out, full state to the host).
Never plan or the commands (the planner builds on this package, not the
other way round). A policy changes when things happen, never what is computed.
"""
