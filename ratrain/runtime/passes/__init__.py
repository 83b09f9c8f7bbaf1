"""The run-time side of the passes over the step (`lifecycle.passes`): each pass's runner.

The executor (`runtime.executor`) makes one runner per pass its plan holds, from this registry
by the pass's name, and merges each runner's `handlers()` into its own table, so a plan whose
pass has no runner, or a runner that leaves one of the pass's actions unhandled, fails when the
executor is made. A runner may also change how the step treats gradients: `seed_count`,
`norm_partials` and `step_norm` (see `Runner`), as partial synchronization's replicas keep
their own. The built-in runners: `offload` (the memory tier's transfers, `Offloader`),
`partial` (the parameter averages, `Averager`) and `mirror` (elastic mode's peer copies of a
sharded optimizer state, `Mirror`).

    register("mine", lambda executor, p, resource: MyRunner(...))   # beside lifecycle.passes'
"""

from ratrain.lifecycle.passes import mirror as mirror_pass
from ratrain.lifecycle.passes import offload as offload_pass
from ratrain.lifecycle.passes import partial as partial_pass
from ratrain.runtime.passes.base import Runner, register, runners_for, unregister
from ratrain.runtime.passes.mirror import Mirror
from ratrain.runtime.passes.offload import Offloader
from ratrain.runtime.passes.partial import Averager

register(partial_pass.NAME, Averager.of_executor)
register(offload_pass.NAME, Offloader.of_executor)
register(mirror_pass.NAME, Mirror.of_executor)

__all__ = ["Averager", "Mirror", "Offloader", "Runner", "register", "runners_for", "unregister"]
