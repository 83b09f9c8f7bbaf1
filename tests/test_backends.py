"""The kernel table (`exec.backends`): chosen once per rank from the config, recorded in the
banner; an attention backend added from outside the package (touching only the registry) runs
a training step; bad choices are refused in one line."""

from __future__ import annotations

import math
import types
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from ratrain.exec import fused, kernels, layers
from ratrain.device.standin import standin
from ratrain.exec.attention import (
    DEVICE_GROUP_BYTES,
    TILE_BYTES,
    AttentionBackend,
    AttentionCache,
    TiledAttention,
)
from ratrain.exec.backends import (
    ATTENTION,
    BackendError,
    kernel_table,
    register_attention,
    unregister_attention,
)
from ratrain.exec.context import ExecContext
from tests._executor_util import tiny_config, train


class Toy(AttentionBackend):
    """Attention through the materialised reference (`kernels.attention_*`): every (T, T)
    score at once, the logsumexp of each row kept as the cache's lse."""

    name = "toy"
    calls: Counter = Counter()

    def forward(self, q, k, v, ctx, out=None):
        self.calls["forward"] += 1
        o, (qg, kg, _, _) = kernels.attention_forward(q, k, v, ctx.xp)  # (B, H, T, D)
        if out is not None:
            out[...] = o
            o = out
        B, KV, G, T, D = qg.shape
        s = qg @ kg.swapaxes(-1, -2) / math.sqrt(D)  # (B, KV, G, T, T)
        s = s + np.triu(np.full((T, T), -np.inf, s.dtype), 1)
        lse = np.logaddexp.reduce(s, axis=-1).reshape(B, KV * G, T)  # (B, H, T)
        return o, AttentionCache(q, k, v, o, lse)

    def backward(self, do, cache, ctx):
        self.calls["backward"] += 1
        _, c = kernels.attention_forward(cache.q, cache.k, cache.v, ctx.xp)
        return kernels.attention_backward(do, c, ctx.xp)

    def workspace_nbytes(self, ctx, batch, seq_len, backward=False):
        return 3 * 4 * batch * ctx.model.heads * seq_len**2  # scores, probabilities, dP


@pytest.fixture
def toy():
    register_attention("toy", lambda device, precision: Toy(), about="the reference, in a test")
    Toy.calls.clear()
    try:
        yield Toy
    finally:
        unregister_attention("toy")
    assert "toy" not in ATTENTION


def test_a_toy_attention_from_outside_the_package_runs_a_training_step(toy):
    cfg = tiny_config(m=2, steps=2, recompute="selective")
    ref, _, _ = train(cfg)
    got, _, ex = train(replace(cfg, run=replace(cfg.run, attention="toy")))
    assert ex.ctx.kernels.names["attention"] == "toy"
    assert ex.ctx.kernels.describe().endswith(", attention toy")
    # each layer, micro-batch and batch chunk of a step (2 x 2 x 2): forward, forward again in
    # the backward (selective), backward; and at start-up one layer per recompute choice (the
    # measurement of what a layer keeps)
    n = 2 * 2 * 2 * cfg.model.layers
    assert toy.calls == {"forward": 2 * n + 3 * 2, "backward": n}
    # the same model, the softmax summed in another order: the first step's within fp32's
    # round-off; AdamW's normalised update then spreads such differences into the weights
    for (a, b), rel in zip(zip(got, ref), (1e-6, 1e-4)):
        assert a.loss == pytest.approx(b.loss, rel=rel)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=rel)


def test_the_layer_workspace_is_its_own_plus_its_attention_backends(toy):
    m = tiny_config().model
    C, H, KV, D, F = m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn_hidden
    qkv = H * D + 2 * KV * D
    per_token = 4 * C + 2 * qkv + H * D + 3 * F + 2 * C + qkv + 3 * F + H * D
    B, T, threads = 3, m.seq_len, 2
    for name, block in (("tiled-64", 64), ("tiled-1024", 1024)):
        with ExecContext(m, threads=threads, kernels=kernel_table(attention=name)) as ctx:
            # before the seam: 4 (B T per_token + 4 H block^2 min(B, threads, chunks)) bytes
            want = 4 * (B * T * per_token + 4 * H * block**2 * min(B, threads, 3))
            assert layers.layer_workspace_nbytes(ctx, B, T, backward=True) == want
            assert layers.layer_workspace_nbytes(ctx, B, 1, backward=True) == 4 * B * per_token
    with ExecContext(m, threads=threads, kernels=kernel_table(attention="toy")) as ctx:
        assert layers.layer_workspace_nbytes(ctx, B, T, backward=True) == \
            4 * B * T * per_token + 12 * B * H * T**2
    # a device's tiled backend takes the batch chunk's sequences as one group: their tiles
    table = kernel_table(standin, attention="tiled-1024")
    assert table.attention.group_bytes == DEVICE_GROUP_BYTES
    assert kernel_table(attention="tiled-1024").attention.group_bytes == TILE_BYTES
    with ExecContext(m, xp=standin, kernels=table) as ctx:
        want = 4 * (B * T * per_token + 4 * H * 1024**2 * B)
        assert layers.layer_workspace_nbytes(ctx, B, T, backward=True) == want


def test_the_table_follows_the_switches_and_names_itself():
    auto, off = kernel_table(blas="openblas"), kernel_table(fused_mode="off", blas="openblas")
    assert off.names == {"gemm": "openblas", "rmsnorm": "numpy", "rope": "numpy",
                         "swiglu": "numpy", "attention": "tiled-64", "cross_entropy": "numpy",
                         "adamw": "numpy", "grad_norm": "numpy", "cast": "numpy"}
    assert off.describe() == "kernels: numpy, blas openblas, attention tiled-64"
    assert off.host and off.rmsnorm_forward is kernels.rmsnorm_forward
    if fused.available():
        assert auto.describe() == ("kernels: fused (numba; cross-entropy numpy, grad-norm "
                                   "numpy), blas openblas, attention tiled-64")
    else:
        assert auto.names == off.names
    assert kernel_table(standin).names["attention"] == "tiled-1024"  # a device's tile
    assert kernel_table(standin).describe() == "kernels: standin, attention tiled-1024"
    tile = kernel_table(attention=TiledAttention(8))
    assert tile.names["attention"] == "tiled-8" and tile.attention.block == 8


def test_reference_ops_put_ops_back_on_their_reference():
    t = kernel_table(reference_ops=("rope", "adamw"))
    assert t.names["rope"] == t.names["adamw"] == "numpy"
    assert t.rope_forward is kernels.rope_forward and t.adamw is None
    if fused.available():
        assert t.names["swiglu"] == "fused"
        assert kernel_table(reference_ops=("rope",), blas="openblas").describe() == (
            "kernels: fused (numba; rope numpy, cross-entropy numpy, grad-norm numpy), "
            "blas openblas, attention tiled-64")
    dev = kernel_table(standin, reference_ops=("rmsnorm",))
    assert dev.names["rmsnorm"] == "standin"
    with pytest.raises(BackendError, match=r"^run.reference_ops: 'gemm' is not an op with a "
                       r"compiled kernel: use any of rmsnorm, rope, swiglu, cross_entropy, adamw, "
                       r"grad_norm, cast$"):
        kernel_table(reference_ops=("rope", "gemm"))


def test_bad_choices_are_one_line_naming_the_key(toy):
    with pytest.raises(BackendError, match=r"^run.attention='nope' is not a registered attention "
                       r"backend: use auto or one of cudnn, cudnn-count, tiled-1024, tiled-64, toy$"):
        kernel_table(attention="nope")
    gpu = types.ModuleType("cupy")  # any array module but numpy and the stand-in: a GPU's
    with pytest.raises(BackendError, match=r"^run.devkernels=sim runs the device kernels on "
                       r"run.device=standin"):
        kernel_table(gpu, devkernels_mode="sim")
    with pytest.raises(ValueError, match="a kernel table for standin given to a context "
                       "computing on cpu"):
        ExecContext(tiny_config().model, kernels=kernel_table(standin))
    with pytest.raises(ValueError, match="'toy': the name is empty, auto or taken"):
        register_attention("toy", lambda device, precision: Toy())


def test_a_context_without_a_table_passes_over_an_auto_backend_that_refuses_its_model(toy):
    """`auto` asks each backend about the model also where code builds a context without a
    config's table (tests, tools): cuDNN's refusal of head size 4 in fp16 made a GPU's default
    context fail at its first layer instead of taking the tiled path (gpu-check, H200)."""
    from ratrain.exec.backends import AUTO, default_kernels

    class Picky(Toy):
        name = "picky"

        def refuses(self, model, dtype):
            return "" if model.head_dim >= 16 else f"head size {model.head_dim} is under 16"

    register_attention("picky", lambda device, precision: Picky(), auto=("cpu",))
    try:
        assert AUTO["cpu"][0] == "picky"
        small = tiny_config().model
        wide = replace(small, hidden=16 * small.heads)
        assert small.head_dim < 16 <= wide.head_dim
        default_kernels.cache_clear()
        with ExecContext(small) as ctx:
            assert ctx.kernels.names["attention"] == "tiled-64"
            assert ctx.kernels.passed_over == {"picky": "head size 8 is under 16"}
        with ExecContext(wide) as ctx:
            assert ctx.kernels.names["attention"] == "picky"
    finally:
        unregister_attention("picky")
        default_kernels.cache_clear()
