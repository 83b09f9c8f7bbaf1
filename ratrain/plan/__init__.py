"""The planner: what a layout costs on the platform, at scales no machine here runs.

Owns: the cost model of every action, from the platform's rates, with nodes (ranks per node
sharing an interface, the grid's placement: `cost.NodeLayout`) (`cost`); calibration of the
compute rate to a measured run (`calibrate`); what the planner plays for a layout, its blocks,
action lists and recompute choices (`steps`); each stage's peak memory (`memory`, over the
lifecycle's memory model); one run's memory plan against the cap, checked before it starts
(`check`, for `train --dry-run`); the discrete-event simulator (`simulate`, its event loop in
`events`); full against partial synchronization on a link (`sync`); the search over layouts
under the DDR cap and weak scaling (`search`); the same with a memory tier below the DDR,
offload as a recovery choice (`tierplan`, the tier in the simulator: `tiersim`); a lower
bound of a simulated step, which lets both searches skip what cannot be among their best
(`prune`); the planner
for mixed clusters, layer splits and replica shares by each rank's class (`hetero`); the command
`python -m ratrain.plan`.

May import: `ratrain.lifecycle` (the schedules and the memory model are the runtime's own),
`ratrain.exec` (model shapes and flops), `ratrain.comm.algos` (the collective algorithms'
registry and the rule that chooses, the runtime's), `ratrain.comm.model` (collective costs) and
`ratrain.comm.topology` (the grid's placement on ranks; none of them loads MPI),
`ratrain.shim` (profiles), `ratrain.config`, `ratrain.job.metrics` (calibration reads a run's step times). Never train or the other commands; nothing below it
imports it.
"""
