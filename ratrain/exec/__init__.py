"""Execution on one rank: the model's arithmetic, with no communication.

Owns: what the model is made of, its blocks, parameters, stage split and flops (`spec`); pure
kernels `forward(x, ..., xp) -> (y, cache)` / `backward(dy, cache, xp)` over numpy or cupy
(`kernels`), the fp16 GEMM (`gemm`), the blocks built from them with their caches and
recompute choices (`layers`), the execution context of threads, dtypes and RoPE tables
(`context`); a stage's flat buffers of masters, moments, views and gradients (`params`); AdamW,
clipping, the LR schedule and loss scaling (`optim`); the GPU path's fused elementwise and row
kernels (`devkernels`, numba-cuda, imported on first use) and cuDNN's fused attention
(`cudnn_sdpa`: nvidia-cudnn-frontend's SDPA graphs, imported on first use).

May import: `ratrain.config` (the model's and optimizer's sections), `ratrain.fastpath` (the `FastPath`
switch of the fused kernels), `ratrain.device` (the array module's transfers and syncs) and
third-party numerics
(numpy, threadpoolctl; cupy when given as `xp`; numba-cuda in `devkernels`; nvidia-cudnn-frontend's
`cudnn` in `cudnn_sdpa`). Never MPI, comm,
lifecycle or plan: buffers are
allocated through a ledger passed in, never imported.
"""
