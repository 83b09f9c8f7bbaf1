"""The tokenizer a run's data was prepared with, recorded in the run's config.

``record_tokenizer`` fills in ``data.tokenizer`` / ``data.tokenizer_sha256`` from the sidecars
of the train files (``rundata.DataPaths``), checking them against the config when it sets them.
Every source of a mixture must agree. So a run's config, its checkpoints and its exports name
the tokenizer.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ratrain.config import Config
from ratrain.data.rundata import DataPaths
from ratrain.data.tokenizer import tokenizer_of_meta
from ratrain.data.tokens import DataError, file_sha256, read_meta


def _tokenizer_file(spec: str) -> Path:
    p = Path(spec)
    return p / "tokenizer.json" if p.is_dir() else p


def _tokenizer_of(paths: DataPaths) -> tuple[str, str]:
    """The tokenizer the train files' sidecars record (every source of a mixture agreeing)."""
    if not paths.sources:
        return tokenizer_of_meta(read_meta(paths.tokens))
    told = [(i, tokenizer_of_meta(read_meta(s.tokens))) for i, s in enumerate(paths.sources)]
    known = [(i, t) for i, t in told if t[0]]
    for i, (spec, sha) in known[1:]:
        j, (spec0, sha0) = known[0]
        if (spec == "byte") != (spec0 == "byte") or (sha and sha0 and sha != sha0):
            raise DataError(
                f"data.sources[{i}] was prepared with the tokenizer {spec} but data.sources[{j}] "
                f"with {spec0}: a mixture needs one tokenizer; prepare them with the same one")
    return known[0][1] if known else ("", "")


def record_tokenizer(cfg: Config, paths: DataPaths) -> Config:
    """`cfg` with ``data.tokenizer`` and ``data.tokenizer_sha256`` filled in from the sidecar of
    the train file (unchanged when the sidecar says nothing, e.g. a nanoGPT file). A tokenizer
    the config names must be the one the data was prepared with (DataError otherwise)."""
    d = cfg.data
    spec, sha = _tokenizer_of(paths)
    if d.tokenizer:
        mine = "byte" if d.tokenizer == "byte" else str(_tokenizer_file(d.tokenizer).resolve())
        mine_sha = "" if mine == "byte" else (
            file_sha256(mine) if Path(mine).is_file() else d.tokenizer_sha256)
        if spec and ((mine == "byte") != (spec == "byte") or (sha and mine_sha and sha != mine_sha)):
            raise DataError(
                f"data.tokenizer={d.tokenizer!r} is not the tokenizer the train data "
                f"({paths.tokens or 'data.sources'}) was prepared with ({spec}): leave "
                "data.tokenizer empty, or prepare the data with it"
            )
        spec, sha = mine, mine_sha or sha
    if d.tokenizer_sha256 and sha and d.tokenizer_sha256 != sha:
        raise DataError(
            f"data.tokenizer_sha256={d.tokenizer_sha256[:16]}... but the tokenizer {spec} hashes "
            f"to {sha[:16]}...: the file changed; prepare the data again or fix the key"
        )
    return replace(cfg, data=replace(d, tokenizer=spec, tokenizer_sha256=sha or d.tokenizer_sha256))


__all__ = ["record_tokenizer"]
