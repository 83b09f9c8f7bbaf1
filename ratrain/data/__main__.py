"""The data CLI: ``python -m ratrain.data prepare|info``.

::

    python -m ratrain.data prepare                        # default corpus -> data/stdlib/train.bin
    python -m ratrain.data prepare notes/ a.txt --out data/mine/train.bin --val-fraction 0.1
    python -m ratrain.data prepare web.jsonl.zst --tokenizer tok.json --out data/web/train.bin
    python -m ratrain.data prepare shards/ --field content --workers 8 --on-bad-record skip
    python -m ratrain.data prepare docs/ --format nanogpt  # a flat .bin, no .idx
    python -m ratrain.data info data/stdlib/train.bin     # or a Megatron prefix
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import ratrain.data
from ratrain.data.prepare import DEFAULT_VAL_FRACTION, SPLITS, prepare
from ratrain.data.readers import ON_BAD
from ratrain.data.default_corpus import DEFAULT_CORPUS_BYTES
from ratrain.data.tokenfile import LAYOUTS, open_tokens
from ratrain.data.tokens import DataError, dtype_name, scan_max_id, val_path


def _info(path: str) -> str:
    f = open_tokens(path, None, "token file")
    top, _ = scan_max_id(np.memmap(f.path, dtype=f.dtype, mode="r"))
    modes = ", each of mode 0: text" if f.index is not None and f.index.modes is not None else ""
    layout = (f"Megatron indexed dataset ({f.index.path}: {f.num_documents} documents, "
              f"{len(f.index.lengths)} sequences{modes})" if f.index is not None else
              "flat (nanoGPT layout, no index)")
    lines = [f"{f.path}: {f.num_tokens} tokens, {dtype_name(f.dtype)}, largest id {top}, {layout}",
             f"sidecar: {json.dumps(f.meta) if f.meta else 'none'}"]
    v = val_path(f.path)
    if v.exists():
        lines.append(f"held-out split: {v}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ratrain.data",
                                 description=ratrain.data.__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser(
        "prepare", help="documents -> token files (no inputs: the default corpus)",
        description="Tokenize documents into PATH and its held-out split val_path(PATH), "
        "streamed, in parallel, in bounded memory. Inputs by name: *.jsonl[.gz|.zst] (a JSON "
        "object per line), *.parquet, a folder written by datasets' save_to_disk (Arrow), any "
        "other file is one text document; folders are read recursively, sorted. With no "
        "inputs, the default corpus: the Python standard library's .py sources.",
    )
    pp.add_argument("inputs", nargs="*", help="files or folders (recursive, sorted)")
    pp.add_argument("--out", default=None,
                    help="train token file (a folder means FOLDER/train.bin); default "
                    "data/stdlib/train.bin, or data/<first input>/train.bin")
    pp.add_argument("--tokenizer", default="byte",
                    help="'byte' (default, vocab 256) or a Hugging Face tokenizer.json")
    pp.add_argument("--field", default="text",
                    help="the text field of jsonl records / column of parquet and Arrow "
                    "(default: text)")
    pp.add_argument("--format", default="megatron", choices=LAYOUTS,
                    help="megatron (default: .bin + .idx, Megatron-LM's indexed dataset) or "
                    "nanogpt (a flat .bin)")
    pp.add_argument("--workers", type=int, default=None,
                    help="threads that encode (default: the cores); the output is the same "
                    "for any number")
    pp.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                    help="documents held out (default 0.05; 0 = none)")
    pp.add_argument("--val-split", default="tail", choices=SPLITS,
                    help="tail: the last documents (default); hash: documents by a seeded hash "
                    "of their text")
    pp.add_argument("--seed", type=int, default=0, help="the seed of --val-split hash")
    pp.add_argument("--on-bad-record", default="stop", choices=ON_BAD,
                    help="a malformed or incomplete record: stop (default, naming file and "
                    "line) or skip (counted and reported)")
    pp.add_argument("--max-bytes", type=int, default=None,
                    help=f"cap on input read (default {DEFAULT_CORPUS_BYTES} for the default "
                    "corpus, none otherwise)")
    pp.add_argument("--eot", default="auto", metavar="auto|none|ID",
                    help="what ends each document: auto (default: the tokenizer's end-of-text "
                    "token, e.g. <|endoftext|>; none for byte), none (concatenate), or a token id "
                    "(e.g. 0 for byte: NUL)")
    pp.add_argument("--quiet", action="store_true", help="no progress display")
    ip = sub.add_parser("info", help="describe a token file")
    ip.add_argument("path", help="a token file (.bin) or Megatron prefix")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "prepare":
            prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.max_bytes,
                    log=print, eot=args.eot, field=args.field, layout=args.format,
                    workers=args.workers, on_bad_record=args.on_bad_record,
                    val_split=args.val_split, seed=args.seed,
                    progress=None if args.quiet else sys.stderr)
        else:
            print(_info(args.path))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written (a rerun starts afresh)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
