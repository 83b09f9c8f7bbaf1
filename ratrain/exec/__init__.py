"""Execution on one rank: the model's arithmetic, with no communication.

Owns: what the model is made of, its blocks, parameters, stage split and flops (`spec`); the
plain reference kernels `forward(x, ..., xp) -> (y, cache)` / `backward(dy, cache, xp)` over
numpy or cupy (`kernels`, with each precision's dtype), the GEMM entries (`gemm`: numpy's BLAS
and its 16-bit tiles, the reference; oneMKL's, on the host's BLAS libraries of `blas`), attention
behind its seam (`attention`: the backend interface, its cache, the tiled kernels and cuDNN's as
a backend), the fast paths (`fused`, numba on the host; `devkernels`, numba-cuda kernels on a
GPU, launched through `devlaunch`, which imports numba-cuda on first use; `cudnn_sdpa`, cuDNN's
fused attention through nvidia-cudnn-frontend, imported on first use) and the table that picks,
once per rank, which implementation runs each op (`backends`, with the registry of attention
backends); the blocks built from them with their caches and recompute choices (`layers`; the
head, its loss and its vocabulary walk, `head`), the execution context of threads, dtypes, the
kernel table and RoPE tables (`context`); the blocks' calls as device graphs, a slot
per micro-batch in flight (`graphs`); a stage's flat buffers of masters, moments, views and
gradients (`params`); AdamW, clipping, the LR schedule and loss scaling (`optim`).

May import: `ratrain.config` (the model's and optimizer's sections), `ratrain.fastpath` (numba,
loaded once), `ratrain.device` (the array module's kind, transfers and syncs) and third-party
numerics (numpy, ml_dtypes' bfloat16, threadpoolctl; cupy when given as `xp`; numba-cuda in
`devlaunch`; nvidia-cudnn-frontend's `cudnn` in `cudnn_sdpa`; oneMKL's library, opened by
ctypes in `blas`). Never MPI, comm, lifecycle or
plan: buffers are allocated through a ledger passed in, never imported.
"""
