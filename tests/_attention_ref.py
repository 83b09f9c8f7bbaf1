"""The reference a fused attention is measured against: the tiled path
(`flash_attention_forward/backward`) in fp32 on the fused one's rounded operands, and the
relative error of a result against it (tests/test_cudnn_sdpa.py, benchmarks/gpu.py attention).
"""

from __future__ import annotations

import numpy as np

try:  # the attention backends' module, once the backend seam holds the tiled kernels
    from ratrain.exec.attention import flash_attention_backward, flash_attention_forward
except ImportError:
    from ratrain.exec.kernels import flash_attention_backward, flash_attention_forward


def tiled_fp32(q, k, v, do, xp, block=128):
    """(o, lse, dq, dk, dv), all fp32, of the tiled path by tiles of `block` on q, k, v, do
    (any float dtype, taken as fp32: exactly the values a half operand holds)."""
    q, k, v, do = (a.astype(np.float32, copy=False) for a in (q, k, v, do))
    o, cache = flash_attention_forward(q, k, v, xp, block)
    if hasattr(cache, "lse"):  # the backend seam's AttentionCache; the backward takes the tile
        return (o, cache.lse, *flash_attention_backward(do, cache, xp, block))
    return (o, cache[4], *flash_attention_backward(do, cache, xp))  # (q, k, v, o, lse, block)


def rel_err(a, ref, xp) -> float:
    """||a - ref|| / ||ref|| over all elements, in fp32 (the issue's "within 1e-3 of")."""
    a, ref = a.astype(np.float32), ref.astype(np.float32)
    return float(xp.linalg.norm((a - ref).ravel()) / xp.linalg.norm(ref.ravel()))
