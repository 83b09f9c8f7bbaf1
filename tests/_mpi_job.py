"""Shared by the trainer's MPI tests: a tiny job (its token file and YAML) in a directory every
rank of the world sees."""

import os

import numpy as np

TINY = """
model: {vocab_size: 64, hidden: 32, layers: 4, heads: 4, kv_heads: 2, ffn_hidden: 64, seq_len: 16}
parallel: {micro_batch: 2, num_micro_batches: 4}
optim: {lr: 1.0e-2, warmup_steps: 2}
checkpoint: {resume: never}
run: {steps: 3, log_interval: 1, threads: 1}
"""


def shared_dir(comm, tmp_path_factory, name):
    """A fresh directory made by rank 0, its path on every rank."""
    path = str(tmp_path_factory.mktemp(name)) if comm.rank == 0 else None
    return comm.bcast(path, root=0)


def tiny_job(comm, tmp_path_factory, name="job", text=TINY):
    """A directory holding `t.bin` (20,000 random tokens of 64) and `job.yaml` (`text` reading
    it), written by rank 0 and seen by every rank."""
    d = shared_dir(comm, tmp_path_factory, name)
    if comm.rank == 0:
        from ratrain.data import write_tokens

        rng = np.random.default_rng(0)
        write_tokens(os.path.join(d, "t.bin"), rng.integers(0, 64, 20000), vocab_size=64)
        with open(os.path.join(d, "job.yaml"), "w") as f:
            f.write(text + f"data: {{tokens: {d}/t.bin}}\n")
    comm.Barrier()
    return d
