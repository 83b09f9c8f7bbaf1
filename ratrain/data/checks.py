"""The trainer's entry to the data: every token file resolved and checked before any work.

``check_data`` resolves ``data.tokens`` (``""``: the default corpus, prepared on first use) and
``data.eval_tokens`` (``""``: the held-out split beside ``data.tokens`` when it exists) and opens
each as the run will (size, dtype, sidecar, every id below ``model.vocab_size``); a problem is a
``DataError`` (a ``ConfigError``) naming the key, the value and the fix. ``open_datasets`` then
opens the checked files without scanning them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ratrain.config import Config
from ratrain.data.corpus import ensure_default_corpus
from ratrain.data.dataset import TokenDataset
from ratrain.data.tokens import DataError, val_path


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
