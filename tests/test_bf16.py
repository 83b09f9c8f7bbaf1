"""precision: bf16 on the CPU and the stand-in: bfloat16 (ml_dtypes') views and activations,
fp32 masters and arithmetic, no loss scaling. The casts are ml_dtypes' bit for bit, 16-bit GEMM
operands run as fp32 tiles on the host and round like cuBLAS on the stand-in, a short run
tracks fp32, and a bf16 Hugging Face model trains in bf16 from exactly its file's bits.
(Policies bitwise equal in bf16: tests/test_executor.py at 1 x 1, tests/test_executor_mpi.py
and tests/test_device_mpi.py at pp 2 x dp 2; exact resume: tests/test_train.py.)"""

from dataclasses import replace

import numpy as np
import pytest

from ratrain.config import OptimConfig, act_itemsize, is_half
from ratrain.device.standin import standin
from ratrain.exec import fused
from ratrain.exec.gemm import matmul
from ratrain.exec.kernels import BF16
from ratrain.exec.optim import LossScaler
from ratrain.runtime.rank import build_rank
from tests._executor_util import global_batch, tiny_config, train


def test_bf16_is_a_half_precision_without_loss_scaling():
    assert is_half("bf16") and is_half("fp16") and not is_half("fp32")
    assert act_itemsize("bf16") == act_itemsize("fp16") == 2 == act_itemsize("fp32") // 2
    scaler = LossScaler.from_config(OptimConfig(loss_scale_init=1024.0), "bf16")
    assert not scaler.enabled and scaler.scale == 1.0
    assert scaler.update(True) and scaler.scale == 1.0  # a non-finite step is skipped, unscaled
    assert OptimConfig().nonfinite_limit("bf16") == OptimConfig().nonfinite_limit("fp32") == 1


def test_casts_are_ml_dtypes_bit_for_bit():
    """fused's float32 <-> bfloat16 casts against ml_dtypes': every bfloat16 as the high half
    with low halves at and around the rounding ties, random floats, infinities and NaNs (the
    whole 2**32 float32 patterns were checked once, see fused's comment)."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    rng = np.random.default_rng(0)
    bits = np.concatenate([(hi[:, None] | low).ravel(),
                           rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)])
    src = bits.view(np.float32)
    got = np.empty(src.shape, BF16)
    with np.errstate(invalid="ignore"):
        want = src.astype(BF16)
    assert fused.cast(src, BF16).view(np.uint16).tolist() == want.view(np.uint16).tolist()
    fused.assign(got, src)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    back = fused.cast(want, np.float32)
    assert np.array_equal(back.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_host_gemm_takes_bf16_operands_as_fp32_tiles():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((37, 64), dtype=np.float32).astype(BF16)
    b = rng.standard_normal((64, 29), dtype=np.float32).astype(BF16)
    want = a.astype(np.float32) @ b.astype(np.float32)
    got = matmul(a, b)  # one tile: the sgemm of the converted operands
    assert got.dtype == np.float32 and np.array_equal(got, want)
    tiles = matmul(a, b, scratch_bytes=4 * 64 * 8)  # several tiles each way
    np.testing.assert_allclose(tiles, want, rtol=1e-5, atol=1e-5)


def test_standin_gemm_rounds_bf16_like_cublas():
    """A device's bf16 x bf16 GEMM accumulates in fp32 and rounds once to bf16 (numpy's, with
    ml_dtypes, would hand back fp32)."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 16), dtype=np.float32).astype(BF16)
    b = rng.standard_normal((16, 4), dtype=np.float32).astype(BF16)
    got = standin.matmul(standin.asarray(a), standin.asarray(b))
    assert got.dtype == BF16
    assert np.array_equal(got.get().view(np.uint16),
                          (a.astype(np.float32) @ b.astype(np.float32)).astype(BF16).view(np.uint16))


@pytest.mark.parametrize("device", ["cpu", "standin"])
def test_bf16_tracks_fp32(device):
    """Ten steps of the tiny model at lr 1e-2: bf16's losses within 2% of fp32's (measured:
    0.7% on the CPU, 0.5% on the stand-in; fp16's 1.3% and 0.7%)."""
    out = {}
    for precision in ("fp32", "bf16"):
        cfg = tiny_config(m=2, precision=precision, steps=10)
        res, state, ex = train(replace(cfg, run=replace(cfg.run, device=device)))
        out[precision] = [r.loss for r in res]
        if precision == "bf16":
            assert all(r.loss_scale == 1.0 and not r.skipped for r in res)
            assert ex.ctx.dtype == BF16 and state.view_dtype == BF16
    assert out["bf16"] != out["fp32"]  # it did round
    np.testing.assert_allclose(out["bf16"], out["fp32"], rtol=2e-2)


def test_a_bf16_hf_model_trains_in_bf16_from_its_files_bits(tmp_path):
    """Exported in bf16 and imported, the masters hold the file's values exactly, so the bf16
    working views are the file's bits; the model then trains in bf16."""
    from ratrain.hf import export_hf, load_hf_params

    cfg = tiny_config(m=2, precision="bf16", steps=2)
    rng = np.random.default_rng(3)
    ref = build_rank(replace(cfg, precision="fp32"), None, cap=None)
    params = {n: a + 0.01 * rng.standard_normal(a.shape).astype(np.float32)
              for n, a in ref.state.named_master()}
    ref.close()
    out = export_hf(params, cfg.model, str(tmp_path / "hf"), dtype="bf16")
    loaded = load_hf_params(out, cfg.model)
    rank = build_rank(cfg, None, cap=None, load=lambda state: state.load_named(loaded))
    try:
        block = rank.state.block_names[1]
        view = rank.state.materialize_view(block)
        a, b = rank.state.block_range(block)
        file_bits = np.concatenate([loaded[n].reshape(-1) for n in rank.state.names
                                    if a <= rank.state.param_range(n)[0] < b]).astype(BF16)
        assert np.array_equal(view.view(np.uint16), file_bits.view(np.uint16))
        res = [rank.executor.run_step(s, global_batch(cfg, s)) for s in range(2)]
        assert all(np.isfinite(r.loss) and not r.skipped for r in res)
    finally:
        rank.close()
