"""The trainer's entry to the data: every token file resolved and checked before any work.

``check_data`` resolves ``data.tokens`` (``""``: the default corpus, prepared on first use) and
``data.eval_tokens`` (``""``: the held-out split beside ``data.tokens`` when it exists) and opens
each as the run will (size, dtype, sidecar, every id below ``model.vocab_size``); a problem is a
``DataError`` (a ``ConfigError``) naming the key, the value and the fix. ``open_datasets`` then
opens the checked files without scanning them again. ``record_tokenizer`` fills in
``data.tokenizer`` / ``data.tokenizer_sha256`` from the train file's sidecar (checking them
against it when the config sets them), so a run's config, its checkpoints and its exports name
the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ratrain.config import Config
from ratrain.data.corpus import ensure_default_corpus
from ratrain.data.dataset import TokenDataset
from ratrain.data.tokenizer import tokenizer_of_meta
from ratrain.data.tokens import DataError, file_sha256, read_meta, val_path


@dataclass(frozen=True)
class DataPaths:
    """The resolved token files of a run (`eval_tokens` is None when there is no held-out file)."""

    tokens: Path
    eval_tokens: Path | None


def check_data(cfg: Config, comm=None, check_ids: bool = True) -> DataPaths:
    """Resolve and validate the run's token files before any work; return their paths.

    ``data.tokens: ""`` is the default corpus (prepared on first use, see
    ``ensure_default_corpus``; `comm` is passed on). ``data.eval_tokens: ""`` is the ``val_path``
    beside ``data.tokens`` when it exists. ``data.eval_interval > 0`` with no held-out file is an
    error. Raises ``DataError`` (a ``ConfigError``) naming the key, the value and the fix.
    """
    d = cfg.data
    tokens = Path(d.tokens) if d.tokens else ensure_default_corpus(comm=comm)
    TokenDataset.from_config(cfg, tokens, check_ids=check_ids)
    if d.eval_tokens:
        ev: Path | None = Path(d.eval_tokens)
    else:
        ev = val_path(tokens) if val_path(tokens).exists() else None
    if ev is None and d.eval_interval > 0:
        raise DataError(
            f"data.eval_interval={d.eval_interval} but there is no held-out file: "
            f"data.eval_tokens is empty and {val_path(tokens)} does not exist; prepare with "
            "--val-fraction > 0, set data.eval_tokens, or set data.eval_interval=0"
        )
    if ev is not None:
        TokenDataset.from_config(cfg, ev, eval=True, check_ids=check_ids)
    return DataPaths(tokens, ev)


def open_datasets(cfg: Config, paths: DataPaths) -> tuple[TokenDataset, TokenDataset | None]:
    """The (train, eval) datasets of checked `paths` (no second id scan)."""
    train = TokenDataset.from_config(cfg, paths.tokens, check_ids=False)
    ev = None
    if paths.eval_tokens is not None:
        ev = TokenDataset.from_config(cfg, paths.eval_tokens, eval=True, check_ids=False)
    return train, ev


def _tokenizer_file(spec: str) -> Path:
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() else p


def record_tokenizer(cfg: Config, paths: DataPaths) -> Config:
    """`cfg` with ``data.tokenizer`` and ``data.tokenizer_sha256`` filled in from the sidecar of
    the train file (unchanged when the sidecar says nothing, e.g. a nanoGPT file). A tokenizer
    the config names must be the one the data was prepared with (DataError otherwise)."""
    d = cfg.data
    spec, sha = tokenizer_of_meta(read_meta(paths.tokens))
    if d.tokenizer:
        mine = "byte" if d.tokenizer == "byte" else str(_tokenizer_file(d.tokenizer).resolve())
        mine_sha = "" if mine == "byte" else (
            file_sha256(mine) if Path(mine).is_file() else d.tokenizer_sha256)
        if spec and ((mine == "byte") != (spec == "byte") or (sha and mine_sha and sha != mine_sha)):
            raise DataError(
                f"data.tokenizer={d.tokenizer!r} is not the tokenizer data.tokens={str(paths.tokens)!r}"
                f" was prepared with ({spec}): leave data.tokenizer empty, or prepare the data "
                "with it"
            )
        spec, sha = mine, mine_sha or sha
    if d.tokenizer_sha256 and sha and d.tokenizer_sha256 != sha:
        raise DataError(
            f"data.tokenizer_sha256={d.tokenizer_sha256[:16]}... but the tokenizer {spec} hashes "
            f"to {sha[:16]}...: the file changed; prepare the data again or fix the key"
        )
    return replace(cfg, data=replace(d, tokenizer=spec, tokenizer_sha256=sha or d.tokenizer_sha256))
