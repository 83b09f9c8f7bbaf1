"""A mixture of token files (``data.sources``), blended deterministically by weight.

The rule (Megatron-LM's ``BlendedDataset``, ``build_blending_indices``): with the weights
normalised to sum to 1, stream sample ``k`` is taken from the source furthest behind its
weight, ``argmax_d (w_d * max(k, 1) - c_d(k))`` (the first on a tie), where ``c_d(k)`` counts
the samples source ``d`` gave before ``k``; it is that source's stream position ``c_d(k)`` (its
own windows, epochs and shuffle: ``TokenDataset`` with ``stream=d``). Every source's share of
the first ``n`` samples is within one sample of ``w_d * n``, and the same weights give the same
sequence of sources as Megatron-LM.

Random access, exact by construction
    Sample ``k``'s source depends only on ``k`` and the weights, so a step's batch is a pure
    function of the step, as for one file (``dataset``): a run resumed at any step and on any
    layout reads what the uninterrupted run read. The counts ``c(k)`` are computed by running the
    rule from the nearest known point (``_anchors``: every ``ANCHOR`` samples, kept as they are
    passed; or where the last read ended, as training reads on); a checkpoint records the counts at its position (``state_dict``), which a resumed
    run takes as its first anchor (``load_state_dict``) instead of replaying the rule from 0.

What a checkpoint records, to notice a changed mixture
    ``state_dict(step)``: the step, the sample position and every source's counts there, and
    what makes the sequence: each source's weight, token count and SHA-256 (from its sidecar),
    order, seed and seq_len. ``resume_problem`` compares that with the run's mixture.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

from ratrain.data.dataset import Batches, TokenDataset
from ratrain.data.tokens import DataError

ANCHOR = 1 << 14  # samples between the kept counts


def normalise(weights) -> np.ndarray:
    """The weights divided by their sum (float64), as Megatron-LM normalises them."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or (w <= 0).any() or not np.isfinite(w).all():
        raise DataError(f"mixture weights {list(weights)} must be positive numbers")
    return w / w.sum()


def blend(weights: np.ndarray, counts, start: int, n: int) -> tuple[np.ndarray, np.ndarray,
                                                                     list[int]]:
    """Samples ``[start, start + n)`` given the counts at `start`: (source of each, its position
    in that source, the counts after). The reference rule, one sample at a time."""
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    src = np.empty(n, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    d_range = range(1, len(w))
    for i in range(n):
        x = float(max(start + i, 1))
        best, top = 0, w[0] * x - c[0]
        for d in d_range:
            e = w[d] * x - c[d]
            if e > top:
                best, top = d, e
        src[i], pos[i] = best, c[best]
        c[best] += 1
    return src, pos, c


class BlendedDataset(Batches):
    """Batches over a weighted mixture of `sources` (see the module doc)."""

    def __init__(self, sources: list[TokenDataset], weights, names: list[str]):
        if not sources:
            raise DataError("a mixture needs at least one source (data.sources)")
        self.sources, self.names = list(sources), list(names)
        self.weights = normalise(weights)
        first = sources[0]
        for s in sources[1:]:
            if (s.seq_len, s.layout) != (first.seq_len, first.layout):  # pragma: no cover
                raise DataError("every source of a mixture needs the same seq_len and layout")
        self.layout, self.seq_len = first.layout, first.seq_len
        self.order, self.seed = first.order, first.seed
        self._anchors: dict[int, list[int]] = {0: [0] * len(sources)}
        self._known = [0]  # the anchors' positions, sorted
        self._cursor = (0, [0] * len(sources))  # where the last read ended, and the counts
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg, paths, check_ids: bool = True) -> BlendedDataset:
        """The training mixture of `cfg` over the resolved `paths` (``rundata.SourcePaths``)."""
        srcs = [TokenDataset.from_config(cfg, p.tokens, check_ids=check_ids, stream=i,
                                         label=f"data.sources[{i}].tokens")
                for i, p in enumerate(paths)]
        return cls(srcs, [p.weight for p in paths], [p.name for p in paths])

    # -- which source, which window ------------------------------------------------------------

    def counts_at(self, k: int) -> list[int]:
        """Every source's count of samples before stream position `k`."""
        with self._lock:
            base = self._known[bisect.bisect_right(self._known, k) - 1]
            counts = self._anchors[base]
            if base < self._cursor[0] <= k:  # reading on from where the last read ended
                base, counts = self._cursor
            while base - base % ANCHOR + ANCHOR <= k:  # keep an anchor every ANCHOR samples
                step = ANCHOR - base % ANCHOR
                _, _, counts = blend(self.weights, counts, base, step)
                base += step
                self._remember(base, counts)
        _, _, counts = blend(self.weights, counts, base, k - base)
        return counts

    def assign(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in it) of stream positions ``[start, start + count)``."""
        src, pos, after = blend(self.weights, self.counts_at(start), start, count)
        with self._lock:
            self._cursor = (start + count, after)
        return src, pos

    def _read(self, start: int, count: int) -> np.ndarray:
        src, pos = self.assign(start, count)
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for d, s in enumerate(self.sources):
            sel = src == d
            if sel.any():
                out[sel] = s.windows_at(pos[sel])
        return out

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def num_windows(self) -> int:
        return sum(s.num_windows for s in self.sources)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sources)

    @property
    def path(self) -> str:
        return " + ".join(f"{n}={s.path} x {w:.3g}" for n, s, w in
                          zip(self.names, self.sources, self.weights))

    def epoch(self, step: int) -> float:
        return step * self.layout.global_batch / self.num_windows

    def mixture(self) -> list[dict]:
        """What makes the sequence of samples, per source (compared on resume)."""
        return [{"weight": float(w), "num_tokens": s.num_tokens,
                 "sha256": (s.meta or {}).get("sha256", "")}
                for s, w in zip(self.sources, self.weights)]

    def state_dict(self, step: int) -> dict:
        """The data position of a checkpoint taken before step `step` (see the module doc)."""
        k = step * self.layout.global_batch
        return {"step": int(step), "order": self.order, "seed": self.seed,
                "seq_len": self.seq_len, "global_batch": self.layout.global_batch,
                "position": k, "counts": self.counts_at(k), "names": self.names,
                "sources": self.mixture()}

    def load_state_dict(self, state: dict | None) -> None:
        """Take a checkpoint's counts as a known point of the rule (checked to be possible: they
        add up to its position and each is within one sample of its weight's share)."""
        if not state or "counts" not in state:
            return
        k, counts = int(state["position"]), [int(c) for c in state["counts"]]
        if len(counts) != len(self.sources) or sum(counts) != k or \
                np.abs(np.asarray(counts) - self.weights * k).max() > len(counts):
            raise DataError(f"the checkpoint's data position (counts {counts} at sample {k}) is "
                            "not one this mixture reaches: the mixture changed; see "
                            "data.sources")
        with self._lock:
            self._remember(k, counts)

    def _remember(self, k: int, counts: list[int]) -> None:
        if k not in self._anchors:
            bisect.insort(self._known, k)
        self._anchors[k] = counts

    def __repr__(self) -> str:
        return f"BlendedDataset({self.path}, layout={self.layout})"


def resume_problem(saved: dict | None, current: dict) -> str:
    """Why a checkpoint's data position (`saved`, a ``state_dict``) does not continue the run's
    data (`current`, the same at the same step), or "" when it does. Only the mixture is
    compared (a single file's position is its step alone)."""
    saved = saved or {}
    if "sources" not in saved and "sources" not in current:
        return ""
    if "sources" not in saved or "sources" not in current:
        was = "a mixture (data.sources)" if "sources" in saved else "a single file (data.tokens)"
        return f"the checkpoint was trained on {was} and this run is not"
    for key in ("order", "seed", "seq_len"):
        if saved.get(key) != current.get(key):
            return f"data.{key} was {saved.get(key)!r} and is now {current.get(key)!r}"
    a, b = saved["sources"], current["sources"]
    if len(a) != len(b):
        return f"the mixture had {len(a)} sources and has {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if abs(x["weight"] - y["weight"]) > 1e-12:
            return f"source {i}'s share was {x['weight']:.6g} and is now {y['weight']:.6g}"
        if x["num_tokens"] != y["num_tokens"] or (x["sha256"] and y["sha256"] and
                                                  x["sha256"] != y["sha256"]):
            return (f"source {i}'s tokens changed ({x['num_tokens']} tokens, sha256 "
                    f"{x['sha256'][:12]} -> {y['num_tokens']}, {y['sha256'][:12]})")
    return ""


__all__ = ["ANCHOR", "BlendedDataset", "blend", "normalise", "resume_problem"]
