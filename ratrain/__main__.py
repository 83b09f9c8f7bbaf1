"""The `ratrain` command: one subcommand per `python -m ratrain.*` entry point.

    ratrain train --config tiny                    # = python -m ratrain.train --config tiny
    ratrain eval --checkpoint runs/tiny/checkpoints
    ratrain generate --checkpoint runs/tiny/checkpoints --prompt "def main("
    ratrain jobs                                   # the example jobs shipped with ratrain
    ratrain SUBCOMMAND --help                      # that command's own help

Installed as a console script (`pip install ratrain` puts `ratrain` on PATH); `python -m ratrain`
is the same. Each subcommand runs its module exactly as `python -m` would (`runpy`, with the
rest of the command line as its arguments), so behaviour, exit codes and MPI use are the
module's own: `mpirun -n 4 ratrain train --config tiny --set parallel.pp=2 --set parallel.dp=2`.
The modules are named here, not imported: a command imports no other command.
"""

from __future__ import annotations

import runpy
import sys

from ratrain.config import JOBS, shipped_jobs

COMMANDS = {  # subcommand: (module, what it does)
    "train": ("ratrain.train", "train a model (alone, under mpirun or srun)"),
    "eval": ("ratrain.eval", "loss and perplexity of a checkpoint on a token file"),
    "generate": ("ratrain.generate", "continue a prompt with a trained model"),
    "export": ("ratrain.export", "write a checkpoint as a Hugging Face model directory"),
    "data": ("ratrain.data", "prepare token files from text (prepare), describe one (info)"),
    "checkpoint": ("ratrain.checkpoint", "show (and verify) a checkpoint"),
    "compare": ("ratrain.compare", "compare two runs' loss curves"),
    "plan": ("ratrain.plan", "plan a model's layout at scale (cost model, simulator)"),
    "bench": ("ratrain.bench", "single-rank throughput against PyTorch eager"),
    "comm-bench": ("ratrain.comm.bench", "collective and point-to-point benchmark (mpirun)"),
    "lifecycle-bench": ("ratrain.runtime.bench", "schedule grid, memory, and timing"),
    "config-doc": ("ratrain.configdoc", "print docs/CONFIG.md (every config key)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: ratrain SUBCOMMAND [ARGS...]   (ratrain SUBCOMMAND --help for its flags)",
             "", "subcommands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += [f"  {'jobs':<{width}}  list the example jobs shipped with ratrain (--config NAME)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "jobs":
        print("\n".join(f"{j:<18} {JOBS / (j + '.yaml')}" for j in shipped_jobs()))
        return 0
    if name not in COMMANDS:
        print(f"error: unknown subcommand {name!r}\n{usage()}", file=sys.stderr)
        return 2
    module = COMMANDS[name][0]
    sys.argv = [f"ratrain {name}", *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the module's own exit status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
