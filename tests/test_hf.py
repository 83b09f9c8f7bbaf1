"""Hugging Face import/export: exact round trips, transformers interop, clear errors."""

import json
import os

import numpy as np
import pytest

from ratrain.config import ModelConfig, replace
from ratrain.exec.params import StageState
from ratrain.exec.spec import model_blocks, stage_blocks
from ratrain.hf import export_hf
from ratrain.hf import (
    HFError,
    check_hf,
    hf_max_positions,
    hf_model_config,
    load_hf_params,
    read_safetensors_header,
    resolve_model_config,
)
from ratrain.shim.ledger import Ledger
from tests._prereq import need

M = ModelConfig(vocab_size=48, hidden=32, layers=3, heads=4, kv_heads=2, ffn_hidden=40, seq_len=16,
                rope_theta=500000.0, norm_eps=1e-5)


def random_params(model=M, seed=0):
    rng = np.random.default_rng(seed)
    return {p.name: rng.standard_normal(p.shape).astype(np.float32)
            for b in model_blocks(model) for p in b.params}


def hf_names(model=M):
    return {p.name: p.hf_name for b in model_blocks(model) for p in b.params}


def rewrite_config(d, **changes):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None and k.startswith("-"):
            cfg.pop(k[1:], None)
        else:
            cfg[k] = v
    with open(path, "w") as f:
        json.dump(cfg, f)


def rewrite_weights(d, fn):
    """Apply fn to the {hf name: array} of d's model.safetensors and write it back."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(d, "model.safetensors")
    tensors = fn(load_file(path))
    save_file(tensors, path)


# --------------------------------------------------------------------------------------------
# without torch
# --------------------------------------------------------------------------------------------


def test_export_then_import_is_exact(tmp_path):
    params = random_params()
    out = export_hf(params, M, str(tmp_path / "hf"))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert resolve_model_config(replace(M, layers=1, hidden=8), out) == replace(
        M, max_positions=M.seq_len)
    assert hf_max_positions(out) == M.seq_len
    back = load_hf_params(out, M)
    assert back.keys() == params.keys()
    for name, arr in params.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], arr)
    # only the requested names (one pipeline stage's)
    names = StageState(stage_blocks(M, 2, 1), "fp32", Ledger()).names
    part = load_hf_params(out, M, names=names)
    assert list(part) == names
    st = StageState(stage_blocks(M, 2, 1), "fp32", Ledger(), initial=part)
    for name, arr in st.named_master():
        np.testing.assert_array_equal(arr, params[name])


def test_reexport_needs_force_and_overwrites_atomically(tmp_path):
    out = str(tmp_path / "hf")
    export_hf(random_params(seed=1), M, out)
    with pytest.raises(HFError, match="not empty.*--force"):
        export_hf(random_params(seed=2), M, out)
    np.testing.assert_array_equal(load_hf_params(out, M)["embed.weight"],
                                  random_params(seed=1)["embed.weight"])  # untouched
    export_hf(random_params(seed=2), M, out, max_position_embeddings=4096, force=True)
    # no temp files left
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    np.testing.assert_array_equal(load_hf_params(out, M)["embed.weight"],
                                  random_params(seed=2)["embed.weight"])
    assert hf_max_positions(out) == 4096


def test_tied_embeddings_roundtrip(tmp_path):
    m = replace(M, tie_embeddings=True)
    params = random_params(m)
    assert "head.weight" not in params
    out = export_hf(params, m, str(tmp_path / "hf"))
    header, _ = read_safetensors_header(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in header
    assert hf_model_config(out)["tie_embeddings"] is True
    back = load_hf_params(out, m)
    for name, arr in params.items():
        np.testing.assert_array_equal(back[name], arr)
    # a tied checkpoint that still carries lm_head.weight imports (the copy is ignored)
    rewrite_weights(out, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"]})
    assert load_hf_params(out, m).keys() == params.keys()


def test_dtypes_fp16_bf16_f64(tmp_path):
    from safetensors.numpy import save_file

    out = export_hf(random_params(), M, str(tmp_path / "hf"))
    src = load_hf_params(out, M)
    names = hf_names()
    # fp16 and f64 through safetensors.numpy; bf16 written by hand (numpy has no bfloat16)
    f16 = {names[g]: a.astype(np.float16) for g, a in src.items()}
    save_file(f16, os.path.join(out, "model.safetensors"))
    got = load_hf_params(out, M)
    for g, a in src.items():
        np.testing.assert_array_equal(got[g], a.astype(np.float16).astype(np.float32))
    bf16_bits = {g: (a.view(np.uint32) >> 16).astype(np.uint16) for g, a in src.items()}
    _write_bf16(os.path.join(out, "model.safetensors"), {names[g]: b for g, b in bf16_bits.items()})
    got = load_hf_params(out, M)
    for g, bits in bf16_bits.items():
        expect = (bits.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(got[g], expect)
    save_file({names[g]: a.astype(np.float64) for g, a in src.items()},
              os.path.join(out, "model.safetensors"))
    for g, a in load_hf_params(out, M).items():
        np.testing.assert_array_equal(a, src[g])


def _write_bf16(path, tensors):
    """A safetensors file of BF16 tensors from their raw uint16 bit patterns."""
    header, off, blobs = {}, 0, []
    for name, bits in tensors.items():
        raw = np.ascontiguousarray(bits, "<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(bits.shape),
                        "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def test_transformers4_style_config(tmp_path):
    out = export_hf(random_params(), M, str(tmp_path / "hf"))
    rewrite_config(out, **{"-rope_parameters": None, "rope_theta": 1234.0, "-head_dim": None,
                           "-num_key_value_heads": None, "num_attention_heads": 4})
    vals = hf_model_config(out)
    assert vals["rope_theta"] == 1234.0 and vals["kv_heads"] == 4  # defaults to heads
    rewrite_config(out, rope_parameters={"rope_type": "default", "rope_theta": 99.0})
    assert hf_model_config(out)["rope_theta"] == 99.0  # 5.x nesting wins


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}}, "llama3"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 16}, "head_dim=16"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, changes, match):
    out = export_hf(random_params(), M, str(tmp_path / "hf"))
    rewrite_config(out, **changes)
    with pytest.raises(HFError, match=match):
        hf_model_config(out)


def test_seq_len_and_model_mismatch(tmp_path):
    out = export_hf(random_params(), M, str(tmp_path / "hf"), max_position_embeddings=16)
    with pytest.raises(HFError, match="seq_len=32 exceeds max_position_embeddings=16"):
        resolve_model_config(replace(M, seq_len=32), out)
    with pytest.raises(HFError, match="seq_len=32 exceeds"):
        load_hf_params(out, replace(M, seq_len=32))
    with pytest.raises(HFError, match="model.kv_heads=4 but config.json says 2"):
        load_hf_params(out, replace(M, kv_heads=4))


def test_weight_mismatches_name_tensor_and_file(tmp_path):
    out = export_hf(random_params(), M, str(tmp_path / "hf"))
    path = os.path.join(out, "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_weights(out, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(HFError, match=rf"missing tensor '{name}'.*model.safetensors"):
        check_hf(out, M)  # the start-up check: headers only
    with pytest.raises(HFError, match=rf"missing tensor '{name}'.*model.safetensors"):
        load_hf_params(out, M)
    out = export_hf(random_params(), M, out, force=True)
    rewrite_weights(out, lambda t: {**t, name: np.zeros((3, 3), np.float32)})
    with pytest.raises(HFError, match=rf"{path}: tensor '{name}' has shape \(3, 3\), expected"):
        load_hf_params(out, M)
    out = export_hf(random_params(), M, out, force=True)
    rewrite_weights(out, lambda t: {**t, "model.layers.7.mlp.up_proj.weight": t[name]})
    with pytest.raises(HFError, match=r"unexpected tensor 'model.layers.7.mlp.up_proj.weight'"):
        load_hf_params(out, M)
    os.remove(path)
    with pytest.raises(HFError, match="no model.safetensors"):
        load_hf_params(out, M)
    os.remove(os.path.join(out, "config.json"))
    with pytest.raises(HFError, match="config.json: missing"):
        hf_model_config(out)
    with pytest.raises(KeyError, match="missing"):
        export_hf({}, M, str(tmp_path / "x"))


def test_truncated_file_is_refused(tmp_path):
    out = export_hf(random_params(), M, str(tmp_path / "hf"))
    path = os.path.join(out, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(HFError, match="truncated"):
        check_hf(out, M)
    with pytest.raises(HFError, match="truncated"):
        load_hf_params(out, M)


# --------------------------------------------------------------------------------------------
# against transformers
# --------------------------------------------------------------------------------------------


def tiny_llama(tie=False, seed=0):
    torch = need("torch")
    transformers = need("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=M.vocab_size, hidden_size=M.hidden, num_hidden_layers=M.layers,
        num_attention_heads=M.heads, num_key_value_heads=M.kv_heads,
        intermediate_size=M.ffn_hidden, max_position_embeddings=64, rms_norm_eps=M.norm_eps,
        rope_theta=M.rope_theta, tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.torch
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_import_from_transformers_is_exact(tmp_path, shard):
    model = tiny_llama()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(tmp_path), **kwargs)
    files = os.listdir(tmp_path)
    if shard:
        assert "model.safetensors.index.json" in files
        assert sum(f.endswith(".safetensors") for f in files) > 2
    m = resolve_model_config(ModelConfig(seq_len=64), str(tmp_path))
    assert m == replace(M, seq_len=64, max_positions=64)  # config.json: max_position_embeddings
    ref = model.state_dict()
    got = load_hf_params(str(tmp_path), m)
    for g, hf in hf_names().items():
        np.testing.assert_array_equal(got[g], ref[hf].numpy(), err_msg=g)
    # a stage reads only its tensors
    names = [n for n in got if n.startswith("layers.2.")]
    assert list(load_hf_params(str(tmp_path), m, names)) == names


@pytest.mark.torch
def test_import_bf16_checkpoint(tmp_path):
    torch = need("torch")
    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    header, _ = read_safetensors_header(str(tmp_path / "model.safetensors"))
    assert {h["dtype"] for h in header.values()} == {"BF16"}
    got = load_hf_params(str(tmp_path), replace(M, seq_len=64))
    ref = model.state_dict()
    for g, hf in hf_names().items():
        np.testing.assert_array_equal(got[g], ref[hf].float().numpy(), err_msg=g)


@pytest.mark.torch
@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers(tmp_path, tie):
    torch = need("torch")
    transformers = need("transformers")
    m = replace(M, tie_embeddings=tie)
    params = random_params(m, seed=5)
    out = export_hf(params, m, str(tmp_path / "hf"))
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    sd = model.state_dict()
    for g, hf in hf_names(m).items():
        np.testing.assert_array_equal(sd[hf].numpy(), params[g], err_msg=g)
    if tie:
        np.testing.assert_array_equal(sd["lm_head.weight"].numpy(), params["embed.weight"])
    assert model.config.rope_parameters["rope_theta"] == M.rope_theta
    assert model.config.rms_norm_eps == M.norm_eps
    # the same model as a transformers-built one with these weights: identical logits
    ref = tiny_llama(tie=tie)
    ref.load_state_dict({hf: torch.tensor(params[g]) for g, hf in hf_names(m).items()},
                        strict=False)
    ids = torch.arange(12).reshape(1, 12) % M.vocab_size
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    # and transformers' own save of it imports back exactly
    model.save_pretrained(str(tmp_path / "again"))
    back = load_hf_params(str(tmp_path / "again"), m)
    for g, a in params.items():
        np.testing.assert_array_equal(back[g], a)


# --------------------------------------------------------------------------------------------
# python -m ratrain.export
# --------------------------------------------------------------------------------------------


def _job(tmp_path, **init):
    import yaml

    cfg = {
        "model": {"vocab_size": M.vocab_size, "hidden": M.hidden, "layers": M.layers,
                  "heads": M.heads, "kv_heads": M.kv_heads, "ffn_hidden": M.ffn_hidden,
                  "seq_len": M.seq_len, "rope_theta": M.rope_theta, "norm_eps": M.norm_eps},
        "init": {"seed": 17, **init},
        "run": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_export_cli_initial_weights(tmp_path, capsys):
    from ratrain.exec.spec import init_param
    from ratrain.export import main

    job = _job(tmp_path)
    out = str(tmp_path / "hf")
    assert main(["--hf", out, "--config", job, "--init"]) == 0
    assert "exported initial weights" in capsys.readouterr().out
    got = load_hf_params(out, M)
    for b in model_blocks(M):
        for p in b.params:
            np.testing.assert_array_equal(got[p.name], init_param(p, 17))
    # from_hf initial weights export back to the same tensors
    job2 = _job(tmp_path, from_hf=out)
    assert main(["--hf", str(tmp_path / "hf2"), "--config", job2, "--init"]) == 0
    again = load_hf_params(str(tmp_path / "hf2"), M)
    for name, arr in got.items():
        np.testing.assert_array_equal(again[name], arr)
    # no checkpoint yet: a clear error, non-zero exit
    assert main(["--hf", str(tmp_path / "hf3"), "--config", job]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    assert main(["--hf", str(tmp_path / "hf3")]) == 2


def test_export_cli_from_checkpoint(tmp_path, capsys):
    from ratrain.checkpoint import save_checkpoint
    from ratrain.config import load_config
    from ratrain.export import main

    cfg = load_config(_job(tmp_path))
    st = StageState(model_blocks(M), "fp32", Ledger(), seed=3)
    root = str(tmp_path / "run" / "checkpoints")
    save_checkpoint(root, 5, cfg, st.state_dict(), {"step": 5}, log=lambda _: None)
    out = str(tmp_path / "hf")
    assert main(["--hf", out, "--checkpoint", root]) == 0
    assert "checkpoint step 5" in capsys.readouterr().out
    got = load_hf_params(out, M)
    for name, arr in st.named_master():
        np.testing.assert_array_equal(got[name], arr)
    assert main(["--hf", str(tmp_path / "hf2"), "--config", _job(tmp_path)]) == 0
    # a damaged shard is refused, naming the file
    shard = next(f for f in os.listdir(os.path.join(root, "ckpt-000005")) if f.endswith(".h5"))
    with open(os.path.join(root, "ckpt-000005", shard), "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"xxxxxxxxxx")
    assert main(["--hf", str(tmp_path / "hf3"), "--checkpoint", root]) == 2
    assert shard in capsys.readouterr().err


@pytest.mark.torch
def test_exported_model_gives_ratrain_loss_in_transformers(tmp_path):
    """Issue 4's target: export -> transformers -> the same numbers as ratrain (fp32)."""
    torch = need("torch")
    transformers = need("transformers")
    from ratrain.exec.context import ExecContext
    from ratrain.exec.head import head_forward
    from ratrain.exec.layers import embed_forward, layer_forward

    m = replace(M, seq_len=12)
    st = StageState(model_blocks(m), "fp32", Ledger(), seed=4)
    for name, arr in st.named_master():  # norms away from 1
        if name.endswith("norm"):
            arr[...] = np.random.default_rng(1).uniform(0.5, 1.5, arr.shape)
    out = export_hf(dict(st.named_master()), m, str(tmp_path / "hf"))
    ids = np.random.default_rng(2).integers(0, m.vocab_size, (2, m.seq_len + 1))
    ctx = ExecContext(m, "fp32")
    x, _ = embed_forward(ids[:, :-1], st.view("embed"), ctx)
    for i in range(m.layers):
        x, _ = layer_forward(x, st.view(f"layers.{i}"), ctx)
    loss, _ = head_forward(x, ids[:, 1:], st.view("head"), ctx)
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids[:, :-1])).logits
        ref = torch.nn.functional.cross_entropy(
            logits.reshape(-1, m.vocab_size), torch.tensor(ids[:, 1:]).reshape(-1)
        )
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)


def test_export_fp16_bf16_round_to_nearest_even(tmp_path):
    from ratrain.hf import to_dtype

    params = random_params()
    out = export_hf(params, M, str(tmp_path / "f16"), dtype="fp16")
    back = load_hf_params(out, M)
    for name, arr in params.items():
        np.testing.assert_array_equal(back[name], arr.astype(np.float16).astype(np.float32))
    out = export_hf(params, M, str(tmp_path / "bf16"), dtype="bf16")
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
    back = load_hf_params(out, M)
    for name, arr in params.items():
        b = back[name]
        assert not (b.view(np.uint32) & 0xFFFF).any()  # bf16 values, widened exactly
        np.testing.assert_allclose(b, arr, rtol=2.0**-8)
    # ties go to the even mantissa; NaN stays NaN
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), np.nan, 3.0], np.float32)
    got = (to_dtype(x, "bf16").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got[[0, 1, 2, 4]], [1.0, 1 + 2**-6, -1.0, 3.0])
    assert np.isnan(got[3])


def test_export_force_replaces_a_sharded_checkpoint(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00001.safetensors").write_bytes(b"x")
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    (out / "README.md").write_text("mine")
    with pytest.raises(HFError, match="not empty"):
        export_hf(random_params(), M, str(out))
    export_hf(random_params(), M, str(out), force=True)
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "generation_config.json",
                                       "model.safetensors"]
    np.testing.assert_array_equal(load_hf_params(str(out), M)["embed.weight"],
                                  random_params()["embed.weight"])
