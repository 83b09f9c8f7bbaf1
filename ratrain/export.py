"""Export ratrain weights as a Hugging Face LlamaForCausalLM directory.

    python -m ratrain.export --hf OUT_DIR --checkpoint PATH
    python -m ratrain.export --hf OUT_DIR --config jobs/tiny.yaml [--set k=v ...]
    python -m ratrain.export --hf OUT_DIR --config jobs/tiny.yaml --init
    ... --force                     # OUT_DIR may hold files already (model files replaced)

`--checkpoint PATH` is a committed checkpoint (`.../ckpt-000100`) or a checkpoints directory
(its newest committed checkpoint is taken); its shards are verified (sizes and SHA-256) first.
With `--config` alone, the newest committed checkpoint of that run is exported; with `--init`
the run's initial weights (`init.seed`, or `init.from_hf`). The output is fp32
`model.safetensors` + `config.json` (see `ratrain.hf.export_hf`), written atomically, which
`transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)` loads; `init.from_hf: OUT_DIR` imports
it back bitwise.

The core is `export_hf(params, model_cfg, out_dir)` with params {global name: fp32 array}.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ratrain.checkpoint import (
    checkpoint_root,
    is_committed,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)
from ratrain.config import ConfigError, ModelConfig, load_config
from ratrain.exec.spec import init_param, model_blocks
from ratrain.hf import HFError, export_hf, load_hf_params, resolve_model_config


def initial_params(cfg) -> dict[str, np.ndarray]:
    """{global name: fp32} of a config's initial weights (random init or init.from_hf)."""
    if cfg.init.from_hf:
        return load_hf_params(cfg.init.from_hf, resolve_model_config(cfg.model, cfg.init.from_hf))
    return {p.name: init_param(p, cfg.init.seed) for b in model_blocks(cfg.model) for p in b.params}


def _newest_committed(root: str) -> str | None:
    done = [p for _, p in list_checkpoints(root) if is_committed(p)]
    return done[-1] if done else None


def checkpoint_params(path: str) -> tuple[dict[str, np.ndarray], ModelConfig, int]:
    """(master weights by global name, model config, step) of a verified committed checkpoint."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if not is_committed(path):
        newest = _newest_committed(path)
        if newest is None:
            raise FileNotFoundError(
                f"{path}: neither a committed checkpoint (no manifest.json) nor a directory "
                "holding one"
            )
        path = newest
    problems = verify_checkpoint(path)
    if problems:
        raise ValueError(f"{path}: damaged checkpoint, not exported: " + "; ".join(problems))
    ck = load_checkpoint(path, buffers=("master",))
    return ck["master"], ck["config"].model, ck["step"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ratrain.export", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--hf", required=True, metavar="OUT_DIR", help="output directory")
    ap.add_argument("--checkpoint", metavar="PATH", help="a checkpoint or checkpoints directory")
    ap.add_argument("--config", metavar="FILE", help="a run config (its checkpoints or init)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value (with --config)")
    ap.add_argument("--init", action="store_true",
                    help="export the config's initial weights instead of a checkpoint")
    ap.add_argument("--force", action="store_true",
                    help="export into a directory that is not empty (its model files replaced)")
    args = ap.parse_args(argv)
    try:
        if os.path.isdir(args.hf) and os.listdir(args.hf) and not args.force:
            raise ValueError(f"--hf {args.hf}: the directory is not empty: give a new or empty "
                             "one, or add --force to replace its model files")
        if os.path.exists(args.hf) and not os.path.isdir(args.hf):
            raise ValueError(f"--hf {args.hf}: a file, not a directory")
        if args.checkpoint and (args.config or args.init):
            raise ValueError("give either --checkpoint or --config [--init], not both")
        if args.checkpoint:
            params, model, step = checkpoint_params(args.checkpoint)
            what = f"checkpoint step {step}"
        elif args.config:
            cfg = load_config(args.config, args.overrides)
            if args.init:
                params = initial_params(cfg)
                model = cfg.model
                if cfg.init.from_hf:
                    model = resolve_model_config(cfg.model, cfg.init.from_hf)
                what = "initial weights"
            else:
                root = checkpoint_root(cfg.checkpoint, cfg.run.dir)
                newest = _newest_committed(root)
                if newest is None:
                    raise FileNotFoundError(
                        f"no committed checkpoint under {root}: pass --checkpoint PATH, or "
                        "--init to export the initial weights"
                    )
                params, model, step = checkpoint_params(newest)
                what = f"checkpoint step {step}"
        else:
            raise ValueError("nothing to export: give --checkpoint PATH or --config FILE")
        out = export_hf(params, model, args.hf)
    except (ConfigError, HFError, FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(int(a.size) for a in params.values())
    print(f"exported {what}: {n} parameters to {out} (config.json, model.safetensors)")
    return 0


__all__ = ["checkpoint_params", "export_hf", "initial_params", "main"]

if __name__ == "__main__":
    sys.exit(main())
