"""Token files, the default corpus, and the batches of the design's data contract.

Owns: the token file format, its sidecar and the names beside it, writing, opening and scanning
token files (`tokens`); tokenizers, byte-level or a local Hugging Face tokenizer.json
(`tokenizer`); the text ``prepare`` reads, named files and folders or the default corpus's
standard-library sources (`sources`); ``prepare`` itself (`prepare`); the default corpus
prepared on first use (`corpus`); the batches of a step, random access by step, and the eval
batches (`dataset`); the trainer's check of its token files before any work (`checks`); the
CLI ``python -m ratrain.data prepare|info`` (`__main__`).

May import: `ratrain.config`, `ratrain.fileio` (every file is written through its one
atomic-write protocol) and third-party packages (numpy; `tokenizers` only when a Hugging Face
tokenizer is asked for; `pyarrow` for parquet and Arrow inputs and `zstandard` for .zst ones,
the `data` extra, only when such an input is given). Nothing else of ratrain: collectives come in as a `comm` argument (the
default corpus's rank-0 word is two point-to-point calls on it), and schedules are not its
business.

    python -m ratrain.data prepare                        # default corpus -> data/stdlib/train.bin
    python -m ratrain.data prepare docs.jsonl.zst --tokenizer tok.json --out data/web/train.bin
    paths = check_data(cfg, comm)                         # before any work: DataError names the fix
    train, ev = open_datasets(cfg, paths)
    inputs, targets = train.batch_for_step(step, replica)  # (M, B, T) int64 each
"""

from ratrain.data.blend import BlendedDataset
from ratrain.data.checks import (
    DataPaths,
    SourcePaths,
    check_data,
    data_resume_problem,
    open_datasets,
    open_eval_sets,
    record_tokenizer,
)
from ratrain.data.corpus import default_tokens_path, ensure_default_corpus
from ratrain.data.dataset import BatchLayout, TokenDataset, eval_batches
from ratrain.data.prepare import DEFAULT_VAL_FRACTION, Prepared, default_out, prepare
from ratrain.data.sources import DEFAULT_CORPUS_BYTES, stdlib_files
from ratrain.data.tokenfile import open_tokens, resolve_tokens, write_tokens
from ratrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_of_meta
from ratrain.data.tokens import (
    FORMAT,
    DataError,
    dtype_for_vocab,
    file_sha256,
    read_meta,
    scan_max_id,
    sidecar_path,
    val_path,
)

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "DEFAULT_VAL_FRACTION",
    "FORMAT",
    "BatchLayout",
    "BlendedDataset",
    "ByteTokenizer",
    "DataError",
    "DataPaths",
    "HFTokenizer",
    "Prepared",
    "SourcePaths",
    "TokenDataset",
    "check_data",
    "data_resume_problem",
    "default_out",
    "default_tokens_path",
    "dtype_for_vocab",
    "ensure_default_corpus",
    "eval_batches",
    "file_sha256",
    "load_tokenizer",
    "open_datasets",
    "open_eval_sets",
    "open_tokens",
    "prepare",
    "read_meta",
    "record_tokenizer",
    "resolve_tokens",
    "scan_max_id",
    "sidecar_path",
    "stdlib_files",
    "tokenizer_of_meta",
    "val_path",
    "write_tokens",
]
