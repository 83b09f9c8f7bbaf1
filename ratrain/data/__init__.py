"""Token files, the default corpus, and the batches of the design's data contract.

Owns, module by module:

- `tokens`: what every token file shares: its dtypes, the JSON sidecar, the names beside a
  file (the sidecar, the held-out split), hashing and scanning for the largest id.
- `megatron`: Megatron-LM's ``.idx``, read and checked against its ``.bin``, and written.
- `tokenfile`: what a data path names (a Megatron prefix, either of its files, or a flat
  nanoGPT ``.bin``), and opening and writing token files in either layout.
- `tokenizer`: tokenizers, byte-level or a local Hugging Face tokenizer.json.
- `readers`: the documents ``prepare`` reads from named files and folders (text, jsonl,
  parquet, Arrow), streamed.
- `default_corpus`: the default corpus, the standard library's ``.py`` sources to prepare.
- `encode`: documents to tokens, in order, on worker threads, in bounded memory.
- `sink`: a token file while ``prepare`` writes it, committed whole or not at all.
- `progress`: how ``prepare`` shows its progress.
- `prepare`: ``prepare`` itself, documents to a train file and its held-out split.
- `corpus`: the default corpus prepared on first use, under a lock, rank 0 first.
- `dataset`: the batches of a step over one token file, by random access, and eval batches.
- `blend`: a mixture of token files (the config's ``data.sources``), blended by weight.
- `rundata`: a run's token files, resolved and checked before any work, then opened.
- `runtokenizer`: the tokenizer a run's data was prepared with, recorded in its config.
- `__main__`: the CLI ``python -m ratrain.data prepare|info``.
- this `__init__`: the package's face, the names a caller imports from ``ratrain.data``.

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
from ratrain.data.corpus import default_tokens_path, ensure_default_corpus
from ratrain.data.dataset import BatchLayout, TokenDataset, eval_batches
from ratrain.data.default_corpus import DEFAULT_CORPUS_BYTES, stdlib_files
from ratrain.data.prepare import DEFAULT_VAL_FRACTION, Prepared, default_out, prepare
from ratrain.data.rundata import (
    DataPaths,
    SourcePaths,
    check_data,
    data_resume_problem,
    open_datasets,
    open_eval_sets,
)
from ratrain.data.runtokenizer import record_tokenizer
from ratrain.data.tokenfile import held_out_beside, open_tokens, resolve_tokens, write_tokens
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
    "held_out_beside",
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
