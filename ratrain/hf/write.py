"""Writing a Hugging Face LlamaForCausalLM directory (the command is `ratrain.export`).

    export_hf(params, model, out_dir, dtype="bf16", tokenizer=tok)   # see `export_hf`

What OUT_DIR receives, each file through `ratrain.fileio` (temporary name, fsync, rename),
`config.json` last: `model.safetensors` (the weights in `dtype`: fp32, or fp16 / bf16 rounded
to nearest even), `config.json` (a LlamaConfig through the key map of `hf.format`, transformers
4.x and 5.x keys), `generation_config.json` (bos/eos ids), and the tokenizer files when given a
Hugging Face tokenizer. `hf.read.load_hf_params` of the directory gives the arrays back (bitwise
for fp32).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

from ratrain.config import ModelConfig
from ratrain.device import to_host
from ratrain.fileio import atomic_path, atomic_write
from ratrain.hf.format import CONFIG, DTYPES, GENERATION, INDEX, KEYS, SINGLE, HFError
from ratrain.hf.read import expected_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>")


# --------------------------------------------------------------------------------------------
# What is written
# --------------------------------------------------------------------------------------------


def hf_config_dict(model: ModelConfig, max_position_embeddings: int | None = None,
                   dtype: str = "fp32", special: Mapping | None = None) -> dict:
    """A LlamaConfig as config.json (transformers 4.x and 5.x keys). `special`: bos_token_id /
    eos_token_id, when known."""
    torch_dtype = DTYPES[dtype][2]
    max_pos = max_position_embeddings or model.max_positions or model.seq_len
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{key: getattr(model, field) for key, field in KEYS.items()},
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_pos),
        "rope_theta": model.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},  # 5.x
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
        **{k: v for k, v in (special or {}).items() if v is not None},
    }


def to_dtype(arr: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 `arr` as the bytes of `dtype`: float32, float16, or bfloat16 as uint16 (round to
    nearest even; NaN stays NaN)."""
    if dtype == "fp32":
        return arr
    if dtype == "fp16":
        return arr.astype("<f2")
    u = arr.view(np.uint32)
    bf = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")  # nearest even
    bf[np.isnan(arr)] = 0x7FC0
    return bf


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], dtype: str = "fp32") -> None:
    """Write {name: fp32 array} as one safetensors file of `dtype` (the format: an 8-byte
    little-endian header length, a JSON header padded with spaces to 8 bytes, the raw data)."""
    code = DTYPES[dtype][0]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        n = arr.size * (4 if dtype == "fp32" else 2)
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset,
                                                                                 offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(to_dtype(arr, dtype)).tobytes())


def _prepare_out(out_dir: str, force: bool) -> None:
    """An empty (or new) OUT_DIR; with `force`, the files of a sharded checkpoint removed."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        entries = sorted(os.listdir(out_dir))
        if not force:
            raise HFError(
                f"--hf {out_dir}: the directory is not empty ({len(entries)} entries: "
                f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}): choose a new "
                "directory, or pass --force to write over it"
            )
        index = os.path.join(out_dir, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                shards = set(json.load(f).get("weight_map", {}).values())
            for name in sorted(shards) + [INDEX]:
                if os.path.exists(os.path.join(out_dir, os.path.basename(name))):
                    os.remove(os.path.join(out_dir, os.path.basename(name)))
    elif os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HFError(f"--hf {out_dir}: exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)


def _write_tokenizer(out_dir: str, tok, max_pos: int) -> dict:
    """Copy a Hugging Face tokenizer into OUT_DIR with the files AutoTokenizer reads; return
    its special token ids ({bos_token_id, eos_token_id})."""
    atomic_write(os.path.join(out_dir, TOKENIZER_FILES[0]), tok.raw)  # the bytes that were checked
    bos = next((t for t in BOS_TOKENS if tok.token_id(t) is not None), None)
    special = {k: v for k, v in (("bos_token", bos), ("eos_token", tok.eot_token)) if v}
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_pos,
            "clean_up_tokenization_spaces": False, "add_bos_token": False, **special}
    atomic_write(os.path.join(out_dir, TOKENIZER_FILES[1]), json.dumps(tcfg, indent=2) + "\n")
    atomic_write(os.path.join(out_dir, TOKENIZER_FILES[2]), json.dumps(special, indent=2) + "\n")
    return {"bos_token_id": tok.token_id(bos) if bos else None, "eos_token_id": tok.eot_id}


def export_hf(
    params: Mapping[str, np.ndarray],
    model: ModelConfig,
    out_dir: str,
    max_position_embeddings: int | None = None,
    *,
    dtype: str = "fp32",
    force: bool = False,
    tokenizer=None,
    special: Mapping | None = None,
) -> str:
    """Write `params` ({global name: array}, every parameter of `model`) as a Hugging Face
    LlamaForCausalLM directory (see the module doc). `tokenizer`: a `ratrain.data.HFTokenizer`
    to ship, or None; `special`: bos/eos token ids when no tokenizer gives them (an imported
    model's). Returns out_dir."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    by_global = {g: (hf, shape) for hf, (g, shape) in expected_tensors(model).items()}
    missing = [g for g in by_global if g not in params]
    if missing:
        raise KeyError(f"export: parameter {missing[0]!r} missing ({len(missing)} missing)")
    extra = [g for g in params if g not in by_global]
    if extra:
        raise KeyError(f"export: {extra[0]!r} is not a parameter of this model")
    tensors = {}
    for g, (hf_name, shape) in by_global.items():
        arr = np.ascontiguousarray(to_host(params[g]), dtype=np.float32)
        if arr.shape != shape:
            raise ValueError(f"export: {g!r} has shape {arr.shape}, expected {shape}")
        tensors[hf_name] = arr
    max_pos = int(max_position_embeddings or model.max_positions or model.seq_len)
    _prepare_out(out_dir, force)
    write_safetensors(os.path.join(out_dir, SINGLE), tensors, dtype)
    ids = dict(special or {})
    if tokenizer is not None:
        ids.update({k: v for k, v in _write_tokenizer(out_dir, tokenizer, max_pos).items()
                    if v is not None})
    gen = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    atomic_write(os.path.join(out_dir, GENERATION), json.dumps(gen, indent=2) + "\n")
    text = json.dumps(hf_config_dict(model, max_pos, dtype, ids), indent=2) + "\n"
    atomic_write(os.path.join(out_dir, CONFIG), text)
    return out_dir


__all__ = ["export_hf", "hf_config_dict", "to_dtype", "write_safetensors"]
