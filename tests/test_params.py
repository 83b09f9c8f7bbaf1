"""StageState: flat buffers, views, gradients, ledger accounting, split-independent init."""

import numpy as np
import pytest

from ratrain.config import ModelConfig
from ratrain.exec.params import StageState
from ratrain.exec.spec import init_param, model_blocks, stage_blocks
from ratrain.shim.ledger import Ledger

M = ModelConfig(vocab_size=32, hidden=16, layers=4, heads=4, kv_heads=2, ffn_hidden=24, seq_len=8)


def full_state(precision="fp32", model=M, seed=7):
    return StageState(model_blocks(model), precision, Ledger(), seed=seed)


def held_bytes(state):
    return state.nbytes()


def test_layout_is_contiguous_in_block_order():
    st = full_state()
    assert st.block_names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert st.size == M.num_params()
    pos = 0
    for b in st.blocks:
        a, e = st.block_range(b.name)
        assert a == pos and e - a == b.size
        for p in b.params:
            pa, pe = st.param_range(p.name)
            assert pa == pos and pe - pa == p.size
            pos = pe
    assert pos == st.size


def test_init_matches_spec_and_views_alias_master():
    st = full_state(seed=11)
    for b in st.blocks:
        master = st.master(b.name)
        for p in b.params:
            np.testing.assert_array_equal(master[p.local], init_param(p, 11))
            assert master[p.local].dtype == np.float32
    # in fp32 the view is the master slice: writing one shows in the other
    v = st.view("layers.1")
    v["attn.wq"][0, 0] = 42.0
    assert st.master("layers.1")["attn.wq"][0, 0] == 42.0
    assert dict(st.named_master())["layers.1.attn.wq"][0, 0] == 42.0


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_init_is_independent_of_split(pp):
    ref = dict(full_state(seed=5).named_master())
    union = {}
    for s in range(pp):
        st = StageState(stage_blocks(M, pp, s), "fp32", Ledger(), seed=5)
        for name, arr in st.named_master():
            assert name not in union
            union[name] = arr.copy()
    assert union.keys() == ref.keys()
    for name, arr in ref.items():
        np.testing.assert_array_equal(union[name], arr)


def test_ledger_accounts_exactly_what_is_held_fp16():
    led = Ledger()
    st = StageState(stage_blocks(M, 2, 1), "fp16", led, seed=1)
    n = st.size
    assert led.by_tag() == {"params.master": 4 * n, "optim.m": 4 * n, "optim.v": 4 * n}
    assert led.current == held_bytes(st)
    blk = st.block_names[0]
    with pytest.raises(RuntimeError, match="not materialised"):
        st.view(blk)
    flat = st.materialize_view(blk)
    assert flat.dtype == np.float16
    size = st.block(blk).size
    assert led.in_use(f"params.view.{blk}") == 2 * size
    view = st.view(blk)
    for local, arr in st.master(blk).items():
        assert view[local].dtype == np.float16 and view[local].shape == arr.shape
        np.testing.assert_array_equal(view[local], arr.astype(np.float16))
    g = st.alloc_grad(blk)
    assert g.dtype == np.float32 and not g.any()
    assert led.in_use(f"grads.{blk}") == 4 * size
    with pytest.raises(RuntimeError, match="already allocated"):
        st.alloc_grad(blk)
    assert led.current == held_bytes(st)
    # the gradient dict views the flat buffer
    st.grad(blk)["attn.wk"][...] = 1.0
    a, _ = st.param_range(f"{blk}.attn.wk")
    b0, _ = st.block_range(blk)
    assert st.grad_flat(blk)[a - b0] == 1.0
    # materialising again refreshes the cast after a master change, without a new allocation
    st.master(blk)["attn_norm"][...] = 3.0
    st.materialize_view(blk)
    assert (st.view(blk)["attn_norm"] == 3.0).all()
    assert led.in_use(f"params.view.{blk}") == 2 * size
    st.drop_view(blk)
    st.free_grad(blk)
    assert led.by_tag() == {"params.master": 4 * n, "optim.m": 4 * n, "optim.v": 4 * n}
    assert led.current == held_bytes(st)
    st.close()
    assert led.current == 0


def test_fp32_views_allocate_nothing():
    led = Ledger()
    st = StageState(model_blocks(M), "fp32", led)
    before = led.current
    st.materialize_view("layers.0")
    st.drop_view("layers.0")
    assert led.current == before
    assert np.shares_memory(st.view_flat("head"), st.master_buf)


def test_load_named_and_state_dict_roundtrip():
    a = full_state(seed=1)
    b = StageState(stage_blocks(M, 2, 0), "fp16", Ledger(), seed=2)
    b.materialize_view("embed")
    b.load_named(dict(a.named_master()))  # extra names (the other stage) are ignored
    for name, arr in b.named_master():
        np.testing.assert_array_equal(arr, dict(a.named_master())[name])
    np.testing.assert_array_equal(b.view("embed")["weight"], a.master("embed")["weight"].astype(np.float16))
    a.buffer("m")[...] = np.arange(a.size, dtype=np.float32)
    sd = a.state_dict()
    c = StageState(model_blocks(M), "fp32", Ledger(), seed=3)
    c.load_state_dict(sd)
    for kind in ("master", "m", "v"):
        np.testing.assert_array_equal(c.buffer(kind), a.buffer(kind))
    with pytest.raises(KeyError, match="missing"):
        b.load_named({"embed.weight": np.zeros((32, 16), np.float32)})
    bad = dict(a.named_master())
    bad["layers.0.attn.wq"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="layers.0.attn.wq"):
        b.load_named(bad)


def test_initial_params_and_errors():
    ref = dict(full_state(seed=9).named_master())
    st = StageState(model_blocks(M), "fp32", Ledger(), seed=0, initial=ref)
    for name, arr in st.named_master():
        np.testing.assert_array_equal(arr, ref[name])
    with pytest.raises(KeyError, match="not on this stage"):
        st.view("layers.9")
    with pytest.raises(RuntimeError, match="alloc_grad"):
        st.grad("embed")
    with pytest.raises(ValueError, match="precision"):
        StageState(model_blocks(M), "fp8", Ledger())


def test_tied_embeddings_have_no_head_weight():
    m = ModelConfig(vocab_size=32, hidden=16, layers=1, heads=4, kv_heads=4, ffn_hidden=24,
                    tie_embeddings=True)
    st = StageState(model_blocks(m), "fp32", Ledger())
    assert "head.weight" not in st.names and st.size == m.num_params()
