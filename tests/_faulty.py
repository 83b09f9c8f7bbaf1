"""`python -m ratrain.train` with a fault planted in one rank, for the elastic tests and
`benchmarks/faults_elastic.py`: `python tests/_faulty.py KIND:RANK:STEP:WHERE TRAIN_ARGS...`
(several faults separated by commas).

KIND: `kill` (SIGKILL), `stop` (SIGSTOP: a hung rank), `raise` (a Python exception); RANK:
the world rank it happens on; STEP: the 0-based training step; WHERE: the executor's handler
it happens in (`_forward`, `_backward`, `_sync_grad`, `_wait_grad`, `_grad_norm`, `_update`,
`_materialize_view`, ...) at its first call of that step, or `save` (the checkpoint write of
the step numbered STEP + 1, after its first block) or `between` (after the step, before the
stop agreement). Each rank writes the wall-clock time of the fault to `<run.dir>/fault.json`
just before it happens, so that detection can be timed from it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def plant(spec: str, run_dir: str) -> None:
    kind, rank, step, where = spec.split(":")
    rank, step = int(rank), int(step)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() != rank:
        return

    def fault():
        with open(os.path.join(run_dir, "fault.json"), "w") as f:
            json.dump({"kind": kind, "rank": rank, "step": step, "where": where,
                       "time": time.time()}, f)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise RuntimeError(f"a planted error on rank {rank} at step {step} in {where}")

    from ratrain.runtime import executor as exm

    if where == "between":
        from ratrain.train import trainer as tm

        between = tm.Trainer._agree_stop

        def stop_agreement(self, *a, **k):
            if self.step_reached == step + 1:
                fault()
            return between(self, *a, **k)

        tm.Trainer._agree_stop = stop_agreement
        return
    if where == "save":  # the sharded state's whole blocks, gathered while replica 0 writes
        full = exm.Executor.iter_full_state

        def blocks(self, *a, **k):
            for i, item in enumerate(full(self, *a, **k)):
                if i == 1 and self.step == step:
                    fault()
                yield item

        exm.Executor.iter_full_state = blocks
        return

    orig = getattr(exm.Executor, where)

    def wrapped(self, *a, **k):
        if self.step == step:
            fault()
        return orig(self, *a, **k)

    setattr(exm.Executor, where, wrapped)


def main(argv) -> int:
    specs, args = argv[0], argv[1:]
    run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run.dir="))
    for spec in specs.split(","):
        plant(spec, run_dir)
    from ratrain.train import main as train

    return train(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
