"""The lifecycle: a training step as data, placed by policies, rewritten by passes, and checked.

Owns: the action vocabulary, its names and the pure 1F1B / GPipe builders (`schedule`); the
policies that place gradient syncs, updates, views and recomputation per block and stage
(`policies`); the passes over the step, each a rewrite of the policy's lists with its own
actions (`passes`: partial synchronization's parameter averages, offload to the memory tier); a
pipeline decided once as data, made from the config with no MPI and no buffer, validated once,
that the executor, the planner, the benches and the grid all take (`pipeline.PipelinePlan`);
the validator (`validate`) and the grid printer (`grid`); the memory model of one rank, played
over its action lists (`memory`); each layer's recovery under the DDR cap, kept, recomputed or
offloaded (`recovery`).

This package is the plan-time side: pure, no MPI, no buffer. What runs a plan, the executor and
each pass's runner, is `ratrain.runtime`.

May import: `ratrain.exec` (blocks, sizes, the kernels' caches), `ratrain.config`. Never the
runtime, plan or the commands (they build on this package, not the other way round). A policy
or a pass changes when things happen and where bytes wait, never what is computed.
"""
