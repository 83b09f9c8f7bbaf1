"""The checkpoint CLI: `python -m ratrain.checkpoint show PATH [--verify]`."""

from __future__ import annotations

import argparse
import sys

import ratrain.checkpoint
from ratrain.checkpoint.show import show


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.checkpoint",
                                 description=ratrain.checkpoint.__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("show", help="print a checkpoint's step, topology, config, files, checks")
    sp.add_argument("path", help="a checkpoint directory (ckpt-NNNNNN) or a checkpoints directory")
    sp.add_argument("--verify", action="store_true", help="also check every file's SHA-256")
    args = ap.parse_args(argv)
    return show(args.path, verify=args.verify)


if __name__ == "__main__":
    sys.exit(main())
