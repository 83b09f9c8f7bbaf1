"""Export ratrain weights as a Hugging Face LlamaForCausalLM directory: a thin command over
`ratrain.hf` (the format, both ways) and `ratrain.checkpoint` (finding and reading weights).

    python -m ratrain.export --hf OUT_DIR --checkpoint PATH [--dtype fp32|fp16|bf16] [--force]
    python -m ratrain.export --hf OUT_DIR --config tiny [--set k=v ...]   # its newest checkpoint
    python -m ratrain.export --hf OUT_DIR --config tiny --init            # its initial weights

`--checkpoint PATH` is a committed checkpoint (`.../ckpt-000100`) or a checkpoints directory
(its newest committed checkpoint is taken); its shards are verified (sizes and SHA-256) first.
With `--config` alone, the newest committed checkpoint of that run is exported; with `--init`
the run's initial weights (`init.seed`, or `init.from_hf`).

What OUT_DIR receives (`hf.write.export_hf`), each file through `ratrain.fileio` (temporary
name, fsync, rename), `config.json` last:
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
import os
import sys

import numpy as np

from ratrain.checkpoint import (
    checkpoint_root,
    committed_path,
    load_checkpoint,
    newest_committed,
    verify_checkpoint,
)
from ratrain.config import Config, ConfigError, load_config, replace
from ratrain.data import DataError, load_tokenizer
from ratrain.exec.spec import init_param, model_blocks
from ratrain.hf import (
    CONFIG,
    DTYPES,
    HFError,
    export_hf,
    load_hf_params,
    read_hf_config,
    resolve_model_config,
)

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


__all__ = ["checkpoint_params", "imported_special", "initial_params", "main", "run_tokenizer"]

if __name__ == "__main__":
    sys.exit(main())
