"""Export ratrain weights as a Hugging Face LlamaForCausalLM directory.

    python -m ratrain.export --hf OUT_DIR --checkpoint PATH [--dtype fp32|fp16|bf16] [--force]
    python -m ratrain.export --hf OUT_DIR --config tiny [--set k=v ...]   # its newest checkpoint
    python -m ratrain.export --hf OUT_DIR --config tiny --init            # its initial weights

`--checkpoint PATH` is a committed checkpoint (`.../ckpt-000100`) or a checkpoints directory
(its newest committed checkpoint is taken); its shards are verified (sizes and SHA-256) first.
With `--config` alone, the newest committed checkpoint of that run is exported; with `--init`
the run's initial weights (`init.seed`, or `init.from_hf`).

What OUT_DIR receives, each file through `ratrain.fileio` (temporary name, fsync, rename),
`config.json` last:
  model.safetensors        the weights in `--dtype` (fp32 by default; fp16 and bf16 rounded to
                           nearest even from the fp32 masters)
  config.json              a LlamaConfig (transformers 4.x and 5.x keys), its torch_dtype, and
                           bos/eos token ids when known; `max_position_embeddings` is
                           `--max-positions`, else `model.max_positions` (an imported model's
                           own), else `model.seq_len`
  generation_config.json   the bos/eos ids `generate` stops on
  tokenizer.json, tokenizer_config.json, special_tokens_map.json
                           when the run's tokenizer (`data.tokenizer`, checked against
                           `data.tokenizer_sha256`) is a Hugging Face tokenizer.json, so that
                           `AutoTokenizer.from_pretrained(OUT_DIR)` loads it (`--tokenizer PATH`
                           names another, `--tokenizer none` writes none); a byte-level run has
                           no tokenizer files (its ids are UTF-8 bytes)
`transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)` loads it; `init.from_hf: OUT_DIR`
imports it back (bitwise for fp32). A non-empty OUT_DIR is refused unless `--force`, which
writes over the files above and removes a sharded checkpoint (index and shards) that would
shadow model.safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

import numpy as np

from ratrain.api import committed_path, newest_committed
from ratrain.checkpoint import checkpoint_root, load_checkpoint, verify_checkpoint
from ratrain.config import Config, ConfigError, ModelConfig, load_config, replace
from ratrain.data import DataError, load_tokenizer
from ratrain.exec.spec import init_param, model_blocks
from ratrain.fileio import atomic_path, atomic_write
from ratrain.hf import (
    CONFIG,
    INDEX,
    SINGLE,
    HFError,
    expected_tensors,
    load_hf_params,
    read_hf_config,
    resolve_model_config,
)

DTYPES = {"fp32": ("F32", "float32"), "fp16": ("F16", "float16"), "bf16": ("BF16", "bfloat16")}
GENERATION = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>")


# --------------------------------------------------------------------------------------------
# What is written
# --------------------------------------------------------------------------------------------


def hf_config_dict(model: ModelConfig, max_position_embeddings: int | None = None,
                   dtype: str = "fp32", special: Mapping | None = None) -> dict:
    """A LlamaConfig as config.json (transformers 4.x and 5.x keys). `special`: bos_token_id /
    eos_token_id, when known."""
    torch_dtype = DTYPES[dtype][1]
    max_pos = max_position_embeddings or model.max_positions or model.seq_len
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden,
        "intermediate_size": model.ffn_hidden,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_pos),
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},  # 5.x
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": model.tie_embeddings,
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
        arr = params[g]
        if hasattr(arr, "get"):  # cupy -> host
            arr = arr.get()
        arr = np.ascontiguousarray(arr, dtype=np.float32)
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


# --------------------------------------------------------------------------------------------
# Where the weights and the tokenizer come from
# --------------------------------------------------------------------------------------------


def initial_params(cfg) -> dict[str, np.ndarray]:
    """{global name: fp32} of a config's initial weights (random init or init.from_hf)."""
    if cfg.init.from_hf:
        return load_hf_params(cfg.init.from_hf, resolve_model_config(cfg.model, cfg.init.from_hf))
    return {p.name: init_param(p, cfg.init.seed) for b in model_blocks(cfg.model) for p in b.params}


def checkpoint_params(path: str) -> tuple[dict[str, np.ndarray], Config, int]:
    """(master weights by global name, the run's config, step) of a verified committed
    checkpoint (or the newest in a checkpoints directory)."""
    path = committed_path(path)
    problems = verify_checkpoint(path)
    if problems:
        raise ValueError(f"{path}: damaged checkpoint, not exported: " + "; ".join(problems))
    ck = load_checkpoint(path, buffers=("master",))
    return ck["master"], ck["config"], ck["step"]


def run_tokenizer(cfg: Config, override: str | None = None):
    """The Hugging Face tokenizer to ship: `override` (a path, or "none"), else the run's
    `data.tokenizer` (checked against its SHA-256); None for byte-level or unknown."""
    if override is not None:
        return None if override in ("none", "byte") else load_tokenizer(override)
    spec = cfg.data.tokenizer
    if spec in ("", "byte"):
        return None
    if not os.path.exists(spec):
        raise DataError(
            f"the run's tokenizer {spec} (data.tokenizer) is gone: pass --tokenizer PATH to ship "
            "that file from elsewhere, or --tokenizer none"
        )
    return load_tokenizer(spec, cfg.data.tokenizer_sha256, stored=True)


def imported_special(cfg: Config) -> dict:
    """bos/eos token ids of an imported model's config.json (when it is still there)."""
    hf_dir = cfg.init.from_hf
    if not hf_dir or not os.path.isfile(os.path.join(hf_dir, CONFIG)):
        return {}
    src = read_hf_config(hf_dir)
    return {k: src.get(k) for k in ("bos_token_id", "eos_token_id") if src.get(k) is not None}


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def _parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m ratrain.export",
        description="Export ratrain weights (a checkpoint, or a config's initial weights) as a "
        "Hugging Face LlamaForCausalLM directory: model.safetensors, config.json, "
        "generation_config.json and the run's tokenizer files.",
    )
    ap.add_argument("--hf", required=True, metavar="OUT_DIR",
                    help="output directory (new or empty; see --force)")
    ap.add_argument("--checkpoint", metavar="PATH",
                    help="a committed checkpoint, or a checkpoints directory (its newest)")
    ap.add_argument("--config", metavar="FILE",
                    help="a run's config (path or shipped job name): its newest checkpoint, or "
                    "with --init its initial weights")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value (with --config; repeatable)")
    ap.add_argument("--init", action="store_true",
                    help="export the config's initial weights instead of a checkpoint")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                    help="dtype of model.safetensors (default fp32; fp16/bf16 round to nearest)")
    ap.add_argument("--max-positions", type=int, default=None, metavar="N",
                    help="config.json's max_position_embeddings (default: model.max_positions, "
                    "the imported model's, else model.seq_len)")
    ap.add_argument("--tokenizer", default=None, metavar="PATH|none",
                    help="tokenizer.json to ship (default: the run's data.tokenizer; none: no "
                    "tokenizer files)")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty OUT_DIR (replacing what export writes)")
    return ap.parse_args(argv)


def _source(args) -> tuple[dict, Config, str]:
    """(params, config, what) the arguments name."""
    if args.checkpoint and (args.config or args.init):
        raise ValueError("give either --checkpoint or --config [--init], not both")
    if args.checkpoint:
        params, cfg, step = checkpoint_params(args.checkpoint)
        return params, cfg, f"checkpoint step {step}"
    if not args.config:
        raise ValueError("nothing to export: give --checkpoint PATH or --config FILE")
    cfg = load_config(args.config, args.overrides)
    if args.init:
        if cfg.init.from_hf:
            cfg = replace(cfg, model=resolve_model_config(cfg.model, cfg.init.from_hf))
        return initial_params(cfg), cfg, "initial weights"
    root = checkpoint_root(cfg.checkpoint, cfg.run.dir)
    newest = newest_committed(root)
    if newest is None:
        raise FileNotFoundError(
            f"no committed checkpoint under {root}: pass --checkpoint PATH, or --init to export "
            "the initial weights"
        )
    params, cfg, step = checkpoint_params(newest)
    return params, cfg, f"checkpoint step {step}"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.max_positions is not None and args.max_positions < 1:
            raise ValueError(f"--max-positions={args.max_positions} must be >= 1")
        params, cfg, what = _source(args)
        tok = run_tokenizer(cfg, args.tokenizer)
        out = export_hf(params, cfg.model, args.hf, args.max_positions, dtype=args.dtype,
                        force=args.force, tokenizer=tok, special=imported_special(cfg))
    except (ConfigError, HFError, FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(int(a.size) for a in params.values())
    files = sorted(os.listdir(out))
    print(f"exported {what}: {n} parameters ({args.dtype}) to {out} ({', '.join(files)})")
    if tok is None:
        print("no tokenizer files: the run is byte-level (ids are UTF-8 bytes) or its tokenizer "
              "is unknown (--tokenizer PATH ships one)")
    return 0


__all__ = ["checkpoint_params", "export_hf", "hf_config_dict",
           "initial_params", "main", "run_tokenizer", "to_dtype", "write_safetensors"]

if __name__ == "__main__":
    sys.exit(main())
