"""``prepare``'s memory and speed targets (issue 28), on inputs it makes and deletes itself.

    python benchmarks/prepare.py memory [--jsonl-mb 2000] [--text-mb 200] [--workers N]
    python benchmarks/prepare.py throughput [--mb 20] [--rounds 3] [--workers N]

Both train a byte-level BPE tokenizer of vocabulary 8192 (``tokenizers``) on the Python standard
library's sources and make their inputs from those sources, under a fresh folder in ``--dir``
(default /tmp; it checks the free space first) that is deleted at the end, whatever happens.

memory
    A jsonl of ``--jsonl-mb`` MB (documents of 2-20 KB) and one text file of ``--text-mb`` MB
    (one document), each prepared by ``python -m ratrain.data prepare`` in a child process;
    the child's peak RSS (its VmHWM, which it reports as it exits) and its MB/s. Target: at most 1.5 GiB for
    2 GB of jsonl and for the 200 MB file. ``--also-mb`` adds a smaller jsonl, to show the peak
    does not grow with the corpus.
throughput
    ``prepare`` against a bare ``Tokenizer.encode_batch`` loop over the same documents (batches
    of 1000) with the same number of threads (``RAYON_NUM_THREADS`` = ``--workers`` for the
    loop, ``--workers`` encoding threads for prepare), in one process, interleaved round by
    round, for documents of 2 KB and of 20 KB. prepare reads its documents from a jsonl (in the
    page cache) and writes token files; the loop only encodes. Target: prepare's documents/s at
    least 0.8x the loop's.

Each case prints one JSON object; the last line is the summary (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def stdlib_texts(limit: int = 40 << 20) -> list[str]:
    """The standard library's .py sources (sorted), up to `limit` characters."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        try:
            t = p.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(t)
        total += len(t)
        if total >= limit:
            break
    return out


def train_tokenizer(path: Path, texts: list[str], vocab: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts[:400], trainer)
    tok.save(str(path))
    return path


def make_docs(texts: list[str], total_chars: int, lo: int, hi: int, seed: int = 0):
    """Documents of `lo`..`hi` characters cut from `texts`, each with its own first line, until
    `total_chars`."""
    import random

    rng = random.Random(seed)
    corpus = "\n".join(texts)
    done, i = 0, 0
    while done < total_chars:
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(corpus) - n)
        doc = f"# document {i}\n" + corpus[start:start + n]
        yield doc
        done += len(doc)
        i += 1


def write_jsonl(path: Path, docs) -> int:
    n = 0
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
            n += 1
    return n


# The child reports its own peak: /proc/self/status's VmHWM, the high-water mark of the
# address space exec gave it. (wait4's ru_maxrss would not do: Linux carries the maximum over
# exec, so it holds this big parent's RSS, copied at fork.)
RUNNER = """import runpy, sys
sys.argv = ["ratrain.data", *sys.argv[1:]]
try:
    runpy.run_module("ratrain.data", run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    sys.stderr.write("peak_rss_kib " + hwm.split()[1] + "\\n")
"""


def run_prepare(args: list[str]) -> dict:
    """`python -m ratrain.data prepare ARGS` in a child: its peak RSS, time and summary."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", RUNNER, "prepare", *args, "--quiet"],
                       capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"prepare failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    kib = int(p.stderr.split("peak_rss_kib ")[-1].split()[0])
    return {"peak_rss_bytes": kib * 1024, "wall_s": wall, "summary": p.stdout.strip()}


def free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def memory(args, work: Path, tok: Path, texts: list[str]) -> list[dict]:
    need = int((args.jsonl_mb + args.text_mb + args.also_mb) * 1e6 * 1.7)
    if free_bytes(work) < need:
        raise SystemExit(f"{work}: {free_bytes(work) / 1e9:.1f} GB free, the inputs and their "
                         f"tokens need about {need / 1e9:.1f} GB: give --dir elsewhere")
    cases = []
    sizes = [("jsonl", args.also_mb)] if args.also_mb else []
    sizes += [("jsonl", args.jsonl_mb), ("text", args.text_mb)]
    for kind, mb in sizes:
        if not mb:
            continue
        path = work / (f"docs-{mb:g}mb.jsonl" if kind == "jsonl" else f"one-{mb:g}mb.txt")
        if kind == "jsonl":
            docs = write_jsonl(path, make_docs(texts, int(mb * 1e6), 2000, 20000))
        else:
            docs, left = 1, int(mb * 1e6)
            with open(path, "w") as f:
                while left > 0:
                    for t in texts:
                        f.write(t[:left])
                        left -= len(t[:left])
        out = work / "out"
        r = run_prepare([str(path), "--tokenizer", str(tok), "--out", f"{out}/",
                         "--val-fraction", "0", "--workers", str(args.workers)])
        size = path.stat().st_size
        case = {"case": f"{kind}-{mb:g}MB", "input_bytes": size, "documents": docs,
                "peak_rss_bytes": r["peak_rss_bytes"],
                "peak_rss_gib": round(r["peak_rss_bytes"] / GIB, 3),
                "mb_per_s": round(size / 1e6 / r["wall_s"], 3), "wall_s": round(r["wall_s"], 1),
                "workers": args.workers, "target_gib": 1.5,
                "meets_target": r["peak_rss_bytes"] <= 1.5 * GIB}
        print(json.dumps(case), flush=True)
        cases.append(case)
        path.unlink()
        shutil.rmtree(out)
    return cases


def throughput(args, work: Path, tok_path: Path, texts: list[str]) -> list[dict]:
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # the loop's threads, before any use
    from tokenizers import Tokenizer

    from ratrain.data import prepare

    tok = Tokenizer.from_file(str(tok_path))
    cases = []
    for name, lo, hi in (("2KB", 1500, 2500), ("20KB", 15000, 25000)):
        docs = list(make_docs(texts, int(args.mb * 1e6), lo, hi, seed=1))
        src = work / f"docs-{name}.jsonl"
        write_jsonl(src, docs)
        loop, ours = [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for i in range(0, len(docs), 1000):
                tok.encode_batch(docs[i:i + 1000], add_special_tokens=False)
            loop.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prepare([str(src)], out=work / f"out-{name}-{r}", tokenizer=str(tok_path),
                    val_fraction=0.0, workers=args.workers)
            ours.append(time.perf_counter() - t0)
            shutil.rmtree(work / f"out-{name}-{r}")
        lm, om = sorted(loop)[len(loop) // 2], sorted(ours)[len(ours) // 2]
        case = {"case": name, "documents": len(docs), "mb": round(src.stat().st_size / 1e6, 2),
                "workers": args.workers, "loop_docs_per_s": round(len(docs) / lm, 1),
                "prepare_docs_per_s": round(len(docs) / om, 1),
                "prepare_mb_per_s": round(sum(map(len, docs)) / 1e6 / om, 3),
                "prepare_over_loop": round(lm / om, 3), "rounds_loop_s": loop,
                "rounds_prepare_s": ours, "target": 0.8}
        print(json.dumps(case), flush=True)
        cases.append(case)
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["memory", "throughput"])
    ap.add_argument("--dir", default="/tmp", help="where the inputs go (deleted afterwards)")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--jsonl-mb", type=float, default=2000)
    ap.add_argument("--text-mb", type=float, default=200)
    ap.add_argument("--also-mb", type=float, default=0,
                    help="memory: also a jsonl of this size first (the peak must not grow)")
    ap.add_argument("--mb", type=float, default=20, help="throughput: MB of documents per case")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ratrain-bench-prepare-", dir=args.dir))
    try:
        texts = stdlib_texts()
        tok = train_tokenizer(work / "tokenizer.json", texts)
        cases = (memory if args.what == "memory" else throughput)(args, work, tok, texts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.what == "memory":
        summary = {"peak_rss_gib_max": max(c["peak_rss_gib"] for c in cases),
                   "meets_target": all(c["meets_target"] for c in cases)}
    else:
        summary = {"prepare_over_loop_min": min(c["prepare_over_loop"] for c in cases),
                   "meets_target": all(c["prepare_over_loop"] >= 0.8 for c in cases)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
