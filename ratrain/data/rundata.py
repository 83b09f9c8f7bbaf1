"""A run's token files, from the config to the datasets: resolved, checked, then opened.

``check_data`` resolves ``data.tokens`` (``""``: the default corpus, prepared on first use) and
``data.eval_tokens`` (``""``: the held-out split beside ``data.tokens`` when it exists), or each
source of a mixture (``data.sources``) and its held-out file, and opens each as the run will
(index, size, dtype, sidecar, every id below ``model.vocab_size``) before any work; a problem
is a ``DataError`` (a ``ConfigError``) naming the key, the value and the fix. ``open_datasets``
then opens the checked files without scanning them again (a mixture: a ``BlendedDataset``),
and ``open_eval_sets`` the held-out files the eval reads (one per source of a mixture).
``data_resume_problem`` says why a checkpoint's data position does not continue this run's
data. (The tokenizer the files were prepared with is ``runtokenizer``'s.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ratrain.config import Config
from ratrain.data.blend import BlendedDataset, normalise, resume_problem
from ratrain.data.corpus import ensure_default_corpus
from ratrain.data.dataset import TokenDataset
from ratrain.data.tokenfile import held_out_beside
from ratrain.data.tokens import DataError, val_path


@dataclass(frozen=True)
class SourcePaths:
    """One source of a mixture, resolved: its name, weight, train file and held-out file."""

    name: str
    weight: float
    tokens: Path
    eval_tokens: Path | None


@dataclass(frozen=True)
class DataPaths:
    """The resolved token files of a run (`eval_tokens` is None when there is no held-out file;
    a mixture has `sources` and neither of the two)."""

    tokens: Path | None
    eval_tokens: Path | None
    sources: tuple[SourcePaths, ...] = ()


def _beside(train: TokenDataset, key: str) -> Path | None:
    """The held-out split beside a train file, when it exists (``held_out_beside``)."""
    index = train.file.index
    v = held_out_beside(train.path, index.path if index is not None else None, key)
    return v if v.exists() else None


def _no_eval(interval: int, key: str, train: Path, fix: str) -> DataError:
    return DataError(
        f"data.eval_interval={interval} but there is no held-out file: {key} is empty and "
        f"{val_path(train)} does not exist; prepare with --val-fraction > 0, set {key}, or "
        f"{fix}")


def _check_sources(cfg: Config, check_ids: bool) -> DataPaths:
    out = []
    for i, s in enumerate(cfg.data.sources):
        train = TokenDataset.from_config(cfg, s.tokens, check_ids=check_ids, stream=i,
                                         label=f"data.sources[{i}].tokens")
        ev = Path(s.eval_tokens) if s.eval_tokens else _beside(
            train, f"data.sources[{i}].eval_tokens")
        if ev is None and cfg.data.eval_interval > 0:
            raise _no_eval(cfg.data.eval_interval, f"data.sources[{i}].eval_tokens", train.path,
                           "set data.eval_interval=0")
        if ev is not None:
            TokenDataset.from_config(cfg, ev, eval=True, check_ids=check_ids,
                                     label=f"data.sources[{i}].eval_tokens")
        out.append(SourcePaths(s.label(), s.weight, train.path, ev))
    return DataPaths(None, None, tuple(out))


def check_data(cfg: Config, comm=None, check_ids: bool = True) -> DataPaths:
    """Resolve and validate the run's token files before any work; return their paths.

    ``data.tokens: ""`` is the default corpus (prepared on first use, see
    ``ensure_default_corpus``; `comm` is passed on). ``data.eval_tokens: ""`` is the ``val_path``
    beside ``data.tokens`` when it exists. ``data.eval_interval > 0`` with no held-out file is an
    error. Raises ``DataError`` (a ``ConfigError``) naming the key, the value and the fix.
    """
    d = cfg.data
    if d.sources:
        return _check_sources(cfg, check_ids)
    tokens = Path(d.tokens) if d.tokens else ensure_default_corpus(comm=comm)
    train = TokenDataset.from_config(cfg, tokens, check_ids=check_ids)
    ev = Path(d.eval_tokens) if d.eval_tokens else _beside(train, "data.eval_tokens")
    if ev is None and d.eval_interval > 0:
        raise _no_eval(d.eval_interval, "data.eval_tokens", train.path, "set data.eval_interval=0")
    if ev is not None:
        TokenDataset.from_config(cfg, ev, eval=True, check_ids=check_ids)
    return DataPaths(train.path, ev)


def open_datasets(cfg: Config, paths: DataPaths) -> tuple[TokenDataset | BlendedDataset,
                                                          TokenDataset | None]:
    """The (train, eval) datasets of checked `paths` (no second id scan); a mixture's train
    dataset is a ``BlendedDataset`` and its eval files are ``open_eval_sets``'."""
    if paths.sources:
        return BlendedDataset.from_config(cfg, paths.sources, check_ids=False), None
    train = TokenDataset.from_config(cfg, paths.tokens, check_ids=False)
    ev = None
    if paths.eval_tokens is not None:
        ev = TokenDataset.from_config(cfg, paths.eval_tokens, eval=True, check_ids=False)
    return train, ev


def open_eval_sets(cfg: Config, paths: DataPaths) -> list[tuple[str, float, TokenDataset]]:
    """(name, weight, dataset) of every held-out file an eval reads: ("", 1.0, ...) for a single
    file; each source with one for a mixture (weights normalised over the whole mixture)."""
    if not paths.sources:
        ev = open_datasets(cfg, paths)[1]
        return [] if ev is None else [("", 1.0, ev)]
    w = normalise([s.weight for s in paths.sources])
    return [(s.name, float(wi), TokenDataset.from_config(cfg, s.eval_tokens, eval=True,
                                                         check_ids=False))
            for s, wi in zip(paths.sources, w) if s.eval_tokens is not None]


def data_resume_problem(saved: dict | None, train) -> str:
    """Why the data position a checkpoint recorded (`saved`) does not continue `train` (the
    run's train dataset), or "" (``blend.resume_problem``)."""
    return resume_problem(saved, train.state_dict(int((saved or {}).get("step", 0))))


__all__ = ["DataPaths", "SourcePaths", "check_data", "data_resume_problem", "open_datasets",
           "open_eval_sets"]
