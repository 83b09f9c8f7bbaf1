"""Evaluate a checkpoint: `python -m ratrain.eval --checkpoint PATH [--tokens FILE] [...]`.

Prints the mean token loss and perplexity of a checkpoint's weights on a token file (default:
the run's held-out file, `data.eval_tokens` or the val split beside `data.tokens`), over the
first `--batches` sequential batches (default `data.eval_batches`; `all`: the whole file), read
as the training run's eval reads them: so at the run's layout the loss is the one its
`eval.jsonl` holds for that step. Runs alone or under `mpirun -n N` / `srun`: the layout is the
run's when N is its pp x dp, else pp 1 x dp N with the same global batch (the same windows;
equal within float reassociation), or what `--set parallel.pp=.. --set parallel.dp=..` says.
Every input is checked on every rank before any work; bad input exits 2 with one message.

    python -m ratrain.eval --checkpoint runs/tiny/checkpoints
    mpirun -n 4 python -m ratrain.eval --checkpoint runs/tiny/checkpoints --set parallel.pp=2 --set parallel.dp=2
    python -m ratrain.eval --checkpoint runs/tiny/checkpoints --tokens data/mine/val.bin --batches all --json
"""

from __future__ import annotations

import argparse
import json
import sys

from ratrain.api import (
    InputError,
    eval_batch_count,
    eval_dataset,
    eval_layout,
    evaluate,
    on_every_rank,
    verified_checkpoint,
)
from ratrain.checkpoint import checkpoint_config, committed_path
from ratrain.job.abort import abort_on_error
from ratrain.config import with_overrides


def parse_args(argv=None):
    about = "Loss and perplexity of a checkpoint on a token file (alone, mpirun or srun)."
    ap = argparse.ArgumentParser(prog="python -m ratrain.eval", description=about)
    ap.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="a committed checkpoint, or a checkpoints directory (its newest)")
    ap.add_argument("--tokens", metavar="FILE", default=None,
                    help="token file to evaluate on (default: the run's held-out file)")
    ap.add_argument("--batches", metavar="N|all", default=None,
                    help="batches to read (default: the run's data.eval_batches; all: the file)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE",
                    help="override a value of the run's config (repeatable), e.g. "
                    "--set parallel.pp=2 or --set precision=fp32")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_args(argv)


def resolve(args, world: int):
    """(checkpoint path, config laid out on `world` ranks, batches); raises on bad input."""
    path, cfg, step = checkpoint_config(args.checkpoint)
    if args.overrides:
        cfg = with_overrides(cfg, args.overrides, f"{path} + --set")
    cfg = eval_layout(cfg, world)
    cfg.check_world(world)
    ds = eval_dataset(cfg, args.tokens)
    n = eval_batch_count(ds, args.batches, cfg.data.eval_batches)
    return path, cfg, step, n


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI  # after the arguments: --help needs no MPI

    comm = MPI.COMM_WORLD
    try:  # the checkpoint verified first, collectively: nothing is read from a damaged one
        path = on_every_rank(comm, committed_path, args.checkpoint)
        on_every_rank(comm, verified_checkpoint, path, comm)
        path, cfg, step, n = on_every_rank(comm, resolve, args, comm.Get_size())
    except InputError as e:
        if comm.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    with abort_on_error():
        res = evaluate(cfg, comm, path, args.tokens, n)
    if comm.Get_rank() == 0:
        p = cfg.parallel
        rec = {"checkpoint": path, "step": step, "tokens_file": res.path, "batches": res.batches,
               "tokens": res.tokens, "loss": res.loss, "perplexity": res.perplexity,
               "pp": p.pp, "dp": p.dp}
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            print(f"{path} (step {step}) on {res.path}: loss {res.loss:.6f} | perplexity "
                  f"{res.perplexity:.4f} | {res.batches} batches, {res.tokens} tokens | "
                  f"pp={p.pp} dp={p.dp}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "parse_args", "resolve"]
