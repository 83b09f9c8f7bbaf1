"""Passes over the step: each a rewrite of a policy's step lists, one feature apiece.

A policy places the pipeline's and the lifecycle's actions (`lifecycle.policies`). A feature
that changes where bytes wait or what is synchronised, without changing the policy, is a pass:
the plan (`lifecycle.pipeline.PipelinePlan`) builds every stage's lists with the policy, then
hands them to each of its passes in turn. Partial synchronization (`partial`), offload to
the memory tier (`offload`) and elastic mode's peer copies of a sharded optimizer state
(`mirror`) are the ones so far. A pass is a `Pass` with five parts:

- `check(policy, stages, passes)`: refuse a configuration it cannot run with, in one line
  naming the keys and the fix;
- `rewrite(lists, info, phase, policy)`: a stage's lists for one phase of its `period` (steps
  after which its lists repeat; 1 for most), as (first, carried, flush);
- `validator(life)`, `memory(walk)`, `simulator(flat)`: the handlers the validator
  (`lifecycle.validate`), the memory model (`lifecycle.memory`) and the planner's simulator
  (`plan.events`) use for the pass's own actions (`actions`), and any hooks on the others.

Every interpreter builds its table with the plan's passes (`schedule.dispatch_table`), so a
pass that leaves one of its actions unhandled fails when the table is made. The run-time side
of a pass, its runner in the executor, lives apart, in `runtime.passes`, under the same name.

A pass joins from anywhere with `register`, as collectives and attention backends do:

    register("mine", lambda cfg, blocks: Mine() if ... else None)   # the plan-time side
    runtime.passes.register("mine", MyRunner)                       # the run-time side

`passes_of(cfg, blocks)` gives the passes a config asks for, in the order they were registered
(partial, then offload, then those registered later): each rewrites what the one before left.
"""

from ratrain.lifecycle.passes import mirror, offload, partial
from ratrain.lifecycle.passes.base import (
    Handlers,
    Lists,
    Pass,
    named,
    passes_of,
    period_of,
    register,
    registered,
    unregister,
)

# the built-in passes, in their order: partial first (offload then places its transfers around
# the averages too)
register(partial.NAME, partial.of_config)
register(offload.NAME, offload.of_config)
register(mirror.NAME, mirror.of_config)

__all__ = ["Handlers", "Lists", "Pass", "mirror", "named", "offload", "partial", "passes_of", "period_of", "register", "registered",
           "unregister"]
