"""The data CLI: ``python -m ratrain.data prepare|info``.

::

    python -m ratrain.data prepare                        # default corpus -> data/stdlib/train.bin
    python -m ratrain.data prepare notes/ a.txt --out data/mine/train.bin --val-fraction 0.1
    python -m ratrain.data prepare docs/ --tokenizer path/to/tokenizer.json   # <|endoftext|> between
    python -m ratrain.data prepare notes/ --eot 0         # byte-level, NUL after each document
    python -m ratrain.data info data/stdlib/train.bin
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import ratrain.data
from ratrain.data.prepare import DEFAULT_VAL_FRACTION, prepare
from ratrain.data.sources import DEFAULT_CORPUS_BYTES
from ratrain.data.tokens import DataError, dtype_name, open_tokens, scan_max_id, val_path


def _info(path: str) -> str:
    p, dt, meta, n = open_tokens(path, None, "token file")
    top, _ = scan_max_id(np.memmap(p, dtype=dt, mode="r"))
    lines = [f"{p}: {n} tokens, {dtype_name(dt)}, largest id {top}",
             f"sidecar: {json.dumps(meta) if meta else 'none (plain nanoGPT layout)'}"]
    v = val_path(p)
    if v.exists():
        lines.append(f"held-out split: {v}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.data",
                                 description=ratrain.data.__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser(
        "prepare", help="text files / folders -> token files (no inputs: the default corpus)",
        description="Tokenize text into PATH and its held-out split val_path(PATH). With no "
        "inputs, the default corpus: the Python standard library's .py sources.",
    )
    pp.add_argument("inputs", nargs="*", help="text files or folders (recursive, sorted)")
    pp.add_argument("--out", default=None,
                    help="train token file (a folder means FOLDER/train.bin); default "
                    "data/stdlib/train.bin, or data/<first input>/train.bin")
    pp.add_argument("--tokenizer", default="byte",
                    help="'byte' (default, vocab 256) or a Hugging Face tokenizer.json")
    pp.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                    help="tail of the token stream held out (default 0.05; 0 = none)")
    pp.add_argument("--max-bytes", type=int, default=None,
                    help=f"cap on text read (default {DEFAULT_CORPUS_BYTES} for the default "
                    "corpus, none otherwise)")
    pp.add_argument("--eot", default="auto", metavar="auto|none|ID",
                    help="what ends each document: auto (default: the tokenizer's end-of-text "
                    "token, e.g. <|endoftext|>; none for byte), none (concatenate), or a token id "
                    "(e.g. 0 for byte: NUL)")
    ip = sub.add_parser("info", help="describe a token file")
    ip.add_argument("path", help="a token file (.bin)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.max_bytes,
                    log=print, eot=args.eot)
        else:
            print(_info(args.path))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
