"""Batches over a token file: the design's data contract, as random access.

Windows
    The file (a Megatron ``.bin`` read as one token stream, or a flat nanoGPT file) is cut into ``W = num_tokens // (seq_len + 1)`` consecutive non-overlapping windows of
    ``seq_len + 1`` tokens (a remainder shorter than a window is never read); a window gives
    ``input = window[:-1]`` and ``target = window[1:]``. Windows are consumed as one endless stream:
    stream position ``k`` is window ``k mod W`` of epoch ``k // W`` (``order: sequential``), or
    window ``perm_e[k mod W]`` where ``perm_e = default_rng([seed, e]).permutation(W)``
    (``order: shuffled``). When the data runs out the stream wraps round to the start: a new epoch.

Batches (``TokenDataset``)
    Step ``s`` takes stream positions ``[s*G, (s+1)*G)`` with ``G = micro_batch * num_micro_batches
    * dp``; replica ``r`` takes the contiguous share ``[s*G + o_r*B, s*G + (o_r+M_r)*B)`` (its
    ``M_r`` micro-batches of ``B`` windows, ``o_r`` the micro-batches of the replicas before it:
    ``M_r = num_micro_batches`` and ``o_r = r*M`` unless ``parallel.replica_shares`` gives unequal
    shares) and micro-batch ``i`` of that replica the ``B`` positions from ``s*G + (o_r+i)*B``.
    The global batch of a step is therefore the same for every ``dp`` and every split of shares.
    Every batch is a pure function of (file, seq_len, order, seed, layout, step): random access,
    so resuming at step ``s`` replays nothing, and the data state a checkpoint needs is just the
    step (plus order and seed, which are in the config; see ``TokenDataset.state_dict``).
    Batches are ``int64`` arrays.

Mixtures
    ``blend.BlendedDataset`` keeps the same contract over several files: stream position ``k``
    is a window of one of them (``Batches`` is what both share: the layout and step -> stream
    positions; each says which windows the positions are).

Eval
    ``eval_batches(ds, n)`` are the first ``n`` sequential batches of the held-out file (windows
    from 0, in file order, whatever ``data.order`` says), wrapping if the file is short.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from ratrain.config import Config, global_batch
from ratrain.data.tokenfile import open_tokens
from ratrain.data.tokens import DataError, dtype_name, scan_max_id


@dataclass(frozen=True)
class BatchLayout:
    """How a step's windows are shared: ``dp`` replicas x ``num_micro_batches`` x ``micro_batch``,
    or replica r taking ``shares[r]`` micro-batches (adding up to ``num_micro_batches x dp``)."""

    dp: int = 1
    micro_batch: int = 1
    num_micro_batches: int = 1
    shares: tuple[int, ...] | None = None  # micro-batches per replica (None: num_micro_batches)

    def micro_batches_of(self, replica: int) -> int:
        return self.shares[replica] if self.shares else self.num_micro_batches

    def replica_windows(self, replica: int) -> int:
        return self.micro_batch * self.micro_batches_of(replica)

    def replica_start(self, replica: int) -> int:
        """Windows of the step before replica `replica`'s share."""
        before = sum(self.shares[:replica]) if self.shares else replica * self.num_micro_batches
        return self.micro_batch * before

    @property
    def global_batch(self) -> int:
        return global_batch(self.micro_batch, self.num_micro_batches, self.dp)

    def check(self) -> None:
        for key in ("dp", "micro_batch", "num_micro_batches"):
            if getattr(self, key) < 1:
                raise DataError(f"parallel.{key}={getattr(self, key)} must be >= 1")
        if self.shares is not None and (len(self.shares) != self.dp or min(self.shares) < 1 or
                                        sum(self.shares) != self.num_micro_batches * self.dp):
            raise DataError(f"parallel.replica_shares={list(self.shares)} must give each of "
                            f"dp={self.dp} replicas >= 1 micro-batch, adding up to "
                            f"{self.num_micro_batches * self.dp}")


class Batches:
    """The batch contract over an endless stream of windows (see the module doc): a subclass
    sets ``layout`` and ``seq_len`` and reads the windows at stream positions (`_read`)."""

    layout: BatchLayout
    seq_len: int

    def _read(self, start: int, count: int) -> np.ndarray:
        """The windows at stream positions ``[start, start + count)``: int64 (count, T+1)."""
        raise NotImplementedError

    def _check(self, step: int, replica: int, layout: BatchLayout) -> None:
        layout.check()
        if step < 0:
            raise DataError(f"step={step} must be >= 0")
        if not 0 <= replica < layout.dp:
            raise DataError(f"replica={replica} is outside [0, dp={layout.dp})")

    def batch_for_step(
        self,
        step: int,
        replica: int = 0,
        dp: int | None = None,
        micro_batch: int | None = None,
        num_micro_batches: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Replica `replica`'s share of step `step`: ``(inputs, targets)``, each int64 of shape
        ``(M_r, micro_batch, seq_len)`` (M_r: the replica's micro-batches). Layout arguments
        default to the dataset's (giving any of them drops its shares: equal ones)."""
        lay = self.layout
        if (dp, micro_batch, num_micro_batches) != (None, None, None):
            lay = BatchLayout(
                lay.dp if dp is None else dp,
                lay.micro_batch if micro_batch is None else micro_batch,
                lay.num_micro_batches if num_micro_batches is None else num_micro_batches,
            )
        self._check(step, replica, lay)
        start = step * lay.global_batch + lay.replica_start(replica)
        w = self._read(start, lay.replica_windows(replica))  # (M_r*B, T+1)
        w = w.reshape(lay.micro_batches_of(replica), lay.micro_batch,
                      self.seq_len + 1)  # (M_r, B, T+1)
        return np.ascontiguousarray(w[..., :-1]), np.ascontiguousarray(w[..., 1:])

    def micro_batch(self, step: int, replica: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batch `i` of replica `replica` at step `step` (the dataset's layout):
        ``(inputs, targets)``, each int64 of shape ``(micro_batch, seq_len)``."""
        lay = self.layout
        self._check(step, replica, lay)
        if not 0 <= i < lay.micro_batches_of(replica):
            raise DataError(f"micro-batch {i} is outside [0, {lay.micro_batches_of(replica)}) "
                            f"of replica {replica}")
        start = step * lay.global_batch + lay.replica_start(replica) + i * lay.micro_batch
        w = self._read(start, lay.micro_batch)  # (B, T+1)
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    def load_state_dict(self, state: dict | None) -> None:
        """What a checkpoint recorded of the data position (`state_dict`): batches are a pure
        function of the step, so a single file needs nothing of it."""


class TokenDataset(Batches):
    """Deterministic random-access batches over a token file (see the module doc for the rules).

    ``TokenDataset(path, seq_len, vocab_size, order=..., seed=..., dp=..., micro_batch=...,
    num_micro_batches=...)`` validates the file before returning: it exists, is non-empty, its
    size is a multiple of the dtype, it holds at least one window of ``seq_len + 1`` tokens, its
    sidecar's vocabulary is not larger than `vocab_size` and no id is >= `vocab_size` (a chunked
    scan over the memmap; ``check_ids=False`` skips it when ``check_data`` already did it).
    The file is read through ``np.memmap``: only the windows a batch needs are touched.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        vocab_size: int | None = None,
        *,
        order: str = "sequential",
        seed: int = 0,
        dp: int = 1,
        micro_batch: int = 1,
        num_micro_batches: int = 1,
        shares: tuple[int, ...] | None = None,
        dtype: str | None = None,
        check_ids: bool = True,
        label: str = "data.tokens",
        from_hf: str = "",
        stream: int | None = None,
    ):
        if order not in ("sequential", "shuffled"):
            raise DataError(f"data.order={order!r} is not one of: sequential, shuffled")
        if seq_len < 1:
            raise DataError(f"model.seq_len={seq_len} must be >= 1")
        self.layout = BatchLayout(dp, micro_batch, num_micro_batches,
                                  tuple(shares) if shares is not None else None)
        self.layout.check()
        self.file = open_tokens(path, dtype, label)
        self.path, self.dtype, self.meta = self.file.path, self.file.dtype, self.file.meta
        self.num_tokens = self.file.num_tokens
        self.seq_len, self.order, self.seed, self.vocab_size = seq_len, order, int(seed), vocab_size
        self.stream = stream  # a mixture's source index: its own shuffle (None: a single file)
        where = f"{label}={str(self.path)!r}"
        if self.num_tokens < seq_len + 1:
            raise DataError(
                f"{where} holds {self.num_tokens} tokens, fewer than model.seq_len + 1 = "
                f"{seq_len + 1} for one window: model.seq_len={seq_len} is above what the data "
                f"can give; lower it to at most {self.num_tokens - 1} or use more data"
            )
        meta_vocab = (self.meta or {}).get("vocab_size")
        if vocab_size is not None and meta_vocab is not None and int(meta_vocab) > vocab_size:
            raise DataError(
                f"{where} was made with a vocabulary of {meta_vocab} tokens (tokenizer "
                f"{self.meta.get('tokenizer', '?')}) but model.vocab_size={vocab_size}: "
                + _vocab_fix(meta_vocab, from_hf)
            )
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")  # (N,)
        if vocab_size is not None and check_ids:
            top, pos = scan_max_id(self.tokens, vocab_size)
            if pos is not None and int(self.tokens[pos]) < 0:
                raise DataError(f"{where}: token id {int(self.tokens[pos])} at position {pos} "
                                "is negative: the file is damaged or not a token file")
            if pos is not None:
                raise DataError(
                    f"{where}: token id {int(self.tokens[pos])} at position {pos} is >= "
                    f"model.vocab_size={vocab_size} (largest id in the file: {top}): "
                    + _vocab_fix(top + 1, from_hf)
                )
        self.num_windows = self.num_tokens // (seq_len + 1)
        self._windows = self.tokens[: self.num_windows * (seq_len + 1)].reshape(
            self.num_windows, seq_len + 1
        )  # (W, T+1), a view of the memmap
        self._perms: dict[int, np.ndarray] = {}  # the last two epochs' permutations
        self._perms_lock = threading.Lock()  # compute threads may ask for micro-batches at once

    @classmethod
    def from_config(cls, cfg: Config, path: str | os.PathLike, *, eval: bool = False,
                    check_ids: bool = True, label: str | None = None,
                    stream: int | None = None) -> TokenDataset:
        """The training (or, with `eval`, the held-out, always sequential) dataset of `cfg`."""
        m, p, d = cfg.model, cfg.parallel, cfg.data
        return cls(
            path, m.seq_len, m.vocab_size, order="sequential" if eval else d.order, seed=d.seed,
            dp=p.dp, micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
            shares=p.shares if p.replica_shares is not None else None, check_ids=check_ids,
            label=label or ("data.eval_tokens" if eval else "data.tokens"),
            from_hf=cfg.init.from_hf, stream=stream,
        )

    # -- the window stream ------------------------------------------------------------------

    def _perm(self, epoch: int) -> np.ndarray:
        """The window order of `epoch`: ``default_rng([seed, epoch]).permutation(W)`` (a
        mixture's source `i`: ``default_rng([seed, i, epoch])``)."""
        with self._perms_lock:
            perm = self._perms.get(epoch)
            if perm is None:
                key = [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]
                rng = np.random.default_rng(key)
                perm = rng.permutation(self.num_windows)
                if self.num_windows < 1 << 31:
                    perm = perm.astype(np.int32)  # half the memory; same values
                if len(self._perms) >= 2:  # a step straddles at most two epochs
                    self._perms.pop(next(iter(self._perms)))
                self._perms[epoch] = perm
            return perm

    def window_ids(self, start: int, count: int) -> np.ndarray:
        """File window indices of stream positions ``[start, start + count)`` (int64)."""
        return self.window_ids_at(np.arange(start, start + count, dtype=np.int64))

    def window_ids_at(self, k: np.ndarray) -> np.ndarray:
        """File window indices of the stream positions `k` (int64)."""
        epoch, pos = np.divmod(np.asarray(k, dtype=np.int64), self.num_windows)
        if self.order == "sequential":
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out

    def _read(self, start: int, count: int) -> np.ndarray:
        return self.windows_at(np.arange(start, start + count, dtype=np.int64))

    def windows_at(self, k: np.ndarray) -> np.ndarray:
        """The windows at stream positions `k`: int64 (len(k), T+1)."""
        return self._windows[self.window_ids_at(k)].astype(np.int64)

    # -- bookkeeping ------------------------------------------------------------------------

    def epoch(self, step: int) -> float:
        """Epochs consumed before step `step` (fractional)."""
        return step * self.layout.global_batch / self.num_windows

    def state_dict(self, step: int) -> dict:
        """The data position of a checkpoint taken before step `step`. Batches are a pure
        function of the step, so resuming needs only ``step``; the rest is recorded to notice a
        changed file or config."""
        return {
            "step": int(step), "order": self.order, "seed": self.seed, "seq_len": self.seq_len,
            "num_tokens": self.num_tokens, "global_batch": self.layout.global_batch,
            "sha256": (self.meta or {}).get("sha256", ""),
        }

    def __len__(self) -> int:
        return self.num_windows

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.path)!r}, tokens={self.num_tokens}, "
                f"windows={self.num_windows}x{self.seq_len + 1}, {dtype_name(self.dtype)}, "
                f"order={self.order}, seed={self.seed}, layout={self.layout})")


def _vocab_fix(needed: int, from_hf: str) -> str:
    """The fix for data with ids beyond the model's vocabulary: a key that takes effect."""
    if from_hf:
        return (f"the vocabulary comes from init.from_hf={from_hf!r} (its config.json; "
                "model.vocab_size does not apply): prepare the data with that model's tokenizer "
                f"(python -m ratrain.data prepare TEXT --tokenizer {from_hf})")
    return f"set model.vocab_size >= {needed}, or prepare the data with the model's tokenizer"


def eval_batches(
    dataset: TokenDataset, num_batches: int, replica: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed set of eval batches: the first `num_batches` sequential batches of `dataset`
    (windows from 0 in file order, whatever its order; wrapping if the file is short), replica
    `replica`'s share of each, shaped like training batches."""
    if num_batches < 1:
        raise DataError(f"data.eval_batches={num_batches} must be >= 1")
    seq = dataset
    if dataset.order != "sequential":
        seq = TokenDataset(
            dataset.path, dataset.seq_len, dataset.vocab_size, order="sequential",
            dp=dataset.layout.dp, micro_batch=dataset.layout.micro_batch,
            num_micro_batches=dataset.layout.num_micro_batches, shares=dataset.layout.shares,
            dtype=dtype_name(dataset.dtype),
            check_ids=False,
        )
    return [seq.batch_for_step(b, replica) for b in range(num_batches)]
