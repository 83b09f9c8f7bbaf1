"""Generate text from a trained model: `python -m ratrain.generate --checkpoint PATH --prompt TEXT`.

Loads a checkpoint (or a checkpoints directory's newest, or a Hugging Face LLaMA directory)
into this process (`ratrain.api.load`), encodes the prompt with the run's tokenizer
(`data.tokenizer`: byte-level, or the tokenizer.json the data was prepared with; `--tokenizer`
names another), and prints the prompt with its continuation: greedy with `--greedy` (or
`--temperature 0`), else sampled with temperature, top-k and top-p from `--seed`. Generation
stops after `--max-new-tokens` or at the tokenizer's end-of-text token.

    python -m ratrain.generate --checkpoint runs/tiny/checkpoints --prompt "def main(" --greedy
    python -m ratrain.generate --checkpoint runs/tiny/checkpoints --prompt "import " \\
        --max-new-tokens 80 --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1 --num-samples 2
    echo "class Foo" | python -m ratrain.generate --checkpoint runs/tiny/checkpoints --prompt -
"""

from __future__ import annotations

import argparse
import sys

from ratrain.api import load
from ratrain.config import PRECISIONS, ConfigError
from ratrain.device import DEVICES


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m ratrain.generate",
        description="Continue a prompt with a trained model (greedy, or sampled with "
        "temperature, top-k and top-p), using the run's tokenizer.",
    )
    ap.add_argument("--checkpoint", required=True, metavar="PATH",
                    help="a committed checkpoint, a checkpoints directory (its newest), or a "
                    "Hugging Face LLaMA directory")
    ap.add_argument("--prompt", required=True, help="the text to continue ('-': read stdin)")
    ap.add_argument("--max-new-tokens", type=int, default=100, metavar="N",
                    help="tokens to generate at most (default 100)")
    ap.add_argument("--greedy", action="store_true", help="take the most likely token each time")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="softmax temperature when sampling (default 1.0; 0 = greedy)")
    ap.add_argument("--top-k", type=int, default=0, metavar="K",
                    help="sample among the K most likely tokens only (default 0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, metavar="P",
                    help="sample among the fewest most likely tokens whose probability reaches "
                    "P (nucleus sampling; default 1.0: all)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--num-samples", type=int, default=1, metavar="N",
                    help="continuations to print (default 1)")
    ap.add_argument("--tokenizer", default=None, metavar="PATH|byte",
                    help="tokenizer to use instead of the run's data.tokenizer")
    ap.add_argument("--precision", choices=PRECISIONS, default=None,
                    help="arithmetic of the forward (default: the run's precision)")
    ap.add_argument("--device", default="cpu", metavar="|".join(DEVICES),
                    help="where to compute (run.device's values; default cpu, whatever device "
                         "trained the model)")
    return ap.parse_args(argv)


def _check(args) -> None:
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples={args.num_samples} must be >= 1")
    if args.temperature < 0:
        raise ValueError(f"--temperature={args.temperature} must be >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p={args.top_p} must be in (0, 1]")
    if args.top_k < 0:
        raise ValueError(f"--top-k={args.top_k} must be >= 0 (0: all)")


def main(argv=None) -> int:
    args = parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        _check(args)
        model = load(args.checkpoint, precision=args.precision, tokenizer=args.tokenizer,
                     device=args.device)
    except (ConfigError, ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with model:
        try:
            temperature = 0.0 if args.greedy else args.temperature
            for i in range(args.num_samples if temperature else 1):
                text = model.complete(prompt, args.max_new_tokens, temperature=temperature,
                                      top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)
                if args.num_samples > 1:
                    print(f"--- sample {i + 1}")
                print(text, flush=True)
        except (ConfigError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "parse_args"]
