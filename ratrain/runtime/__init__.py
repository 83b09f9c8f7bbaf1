"""The runtime: a rank built from its plan, and the executor that runs the plan's lists.

Owns: the one way to build a rank (`rank.build_rank`); the executor that runs a rank's lists
through one `{type: handler}` table (`executor`), with its stage compute (`compute`), its
pipeline messages (`mailbox`), the step's global facts (`facts`), whole blocks for checkpoints
(`fullstate`), device arrays through host buffers for MPI (`staged`) and its timeline
(`trace`); what this rank's blocks keep, measured, and its recovery choice (`measure`); each
pass's runner (`passes`: the memory tier's transfers, partial synchronization's averages);
`python -m ratrain.runtime.bench` (grids, memory and timing of the policies).

The plan-time side, the step as data that this package runs, is `ratrain.lifecycle`: nothing
here decides where an action goes, only how it runs.

May import: `ratrain.lifecycle` (the plans it runs), `ratrain.comm`, `ratrain.exec`,
`ratrain.shim`, `ratrain.config`, `ratrain.fileio`, `ratrain.device` (batches in, sums and
losses out, full state to the host). Never plan or the commands.
"""
