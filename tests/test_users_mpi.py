"""Evaluating a checkpoint at pp 2 x dp 2 gives the loss the training run's eval logged at that
step (the same layout: bitwise), and one process gives it within float reassociation."""

import json
import os

import numpy as np
import pytest

from ratrain import api
from ratrain.checkpoint import checkpoint_config
from ratrain.train import Trainer, parse_args, startup

TINY = """
model: {vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {pp: 2, dp: 2, micro_batch: 2, num_micro_batches: 2}
optim: {lr: 1.0e-2, warmup_steps: 2}
checkpoint: {interval: 2, resume: never}
run: {steps: 4, log_interval: 1, threads: 1}
"""


@pytest.mark.mpi(min_size=4)
def test_eval_at_pp2_dp2_matches_the_training_eval(mpi_group, tmp_path_factory):
    comm = mpi_group(4)
    d = str(tmp_path_factory.mktemp("evalmpi")) if comm.Get_rank() == 0 else None
    d = comm.bcast(d, root=0)
    if comm.Get_rank() == 0:
        from ratrain.data import write_tokens

        rng = np.random.default_rng(0)
        write_tokens(os.path.join(d, "train.bin"), rng.integers(0, 64, 20000), vocab_size=64)
        write_tokens(os.path.join(d, "val.bin"), rng.integers(0, 64, 4000), vocab_size=64)
        with open(os.path.join(d, "job.yaml"), "w") as f:
            f.write(TINY + f"data: {{tokens: {d}/train.bin, eval_interval: 2, eval_batches: 3}}\n")
    comm.Barrier()
    args = parse_args(["--config", f"{d}/job.yaml", "--set", f"run.dir={d}/run"])
    assert Trainer(startup(args, comm), comm).run() == 0
    logged = None
    if comm.Get_rank() == 0:
        with open(f"{d}/run/eval.jsonl") as f:
            logged = {r["step"]: r["eval_loss"] for r in map(json.loads, f)}
    logged = comm.bcast(logged, root=0)
    assert sorted(logged) == [2, 4]
    for step in (2, 4):
        path, cfg, got_step = checkpoint_config(f"{d}/run/checkpoints/ckpt-00000{step}")
        assert got_step == step and (cfg.parallel.pp, cfg.parallel.dp) == (2, 2)
        res = api.evaluate(api.eval_layout(cfg, 4), comm, path)
        assert res.loss == logged[step]  # every rank: bitwise the training run's eval
        if comm.Get_rank() == 0:  # one process, pp 1 x dp 1, the same windows
            one = api.evaluate(api.eval_layout(cfg, 1), None, path)
            assert one.loss == pytest.approx(logged[step], rel=1e-6)
        comm.Barrier()
