"""ExecContext: what the block kernels need besides their inputs.

It carries the array module `xp`, the `ModelConfig`, the dtype of activations and weight views
(float32, float16 or bfloat16: `dtype`, `half`) and of the arithmetic (`compute`), the rank's kernel table (`kernels`: which implementation runs
each op, attention included, chosen once in `exec.backends`), RoPE tables cached per sequence
length, the DDR ledger (GEMM scratch and transient workspace are accounted there while a block
runs) and the compute threads.

Threads: a micro-batch of B sequences is cut into `min(B, BATCH_CHUNKS)` contiguous chunks
whatever the thread count (`split`), and `threads` (run.threads; 0 = auto = the usable cores;
a rank built by `runtime.rank` shares them with the node's other ranks) Python threads run
the chunks, each thread a contiguous group of them, every GEMM on single-threaded BLAS (numpy
releases the GIL in matmul and most ufunc loops). Weight-gradient partials of the chunks are
summed in chunk order. So every reduction (the GEMMs' own, inside a chunk of fixed shape, and
the sum over chunks) has an order fixed by the batch alone: the results are bitwise the same
whatever `threads` is. (Multi-threaded BLAS is not used even with one chunk: OpenBLAS's results
for small shapes change with its thread count; measured here, a (3, 100) @ (100, 70) sgemm.)
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from ratrain.config import ModelConfig, RunConfig
from ratrain.config.run import head_once_refused
from ratrain.device import kind_of
from ratrain.exec.backends import Kernels, default_kernels, kernels_for
from ratrain.exec.kernels import DTYPES, is_half_dtype, rope_tables


def auto_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores)


class _Blas:
    """Sets the BLAS thread count of numpy's BLAS (threadpoolctl), cheaply, per region."""

    def __init__(self):
        self._libs = None

    def libs(self):
        if self._libs is None:
            try:
                from threadpoolctl import ThreadpoolController

                self._libs = [c for c in ThreadpoolController().lib_controllers
                              if c.user_api == "blas"]
            except Exception:  # pragma: no cover - threadpoolctl missing or broken
                self._libs = []
        return self._libs

    @contextlib.contextmanager
    def limit(self, n: int):
        libs = self.libs()
        before = [lib.get_num_threads() for lib in libs]
        for lib in libs:
            lib.set_num_threads(n)
        try:
            yield
        finally:
            for lib, b in zip(libs, before):
                lib.set_num_threads(b)


BLAS = _Blas()  # numpy's BLAS thread count, per region


def sgemm_rate(threads: int, n: int = 1024):
    """A function that times one (n x n) @ (n x n) float32 GEMM with `threads` BLAS threads and
    returns its rate in flop/s: the host's measured peak (benchmarks, MFU on `host`)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)

    def once() -> float:
        with BLAS.limit(threads):
            t = time.perf_counter()
            np.matmul(a, b, out=c)
            return 2 * n**3 / max(time.perf_counter() - t, 1e-9)

    return once


BATCH_CHUNKS = 4  # a micro-batch runs as at most this many chunks, whatever the thread count
# Each device's bound on the fp32 logits of one head chunk (`run.head_chunk_mib: 0`). The host's
# is a core's cache: the head is GEMM-bound there, and its transient memory is DDR. A device's
# is 16 times that: at 16 MiB the 124M model's head (vocab 32000, 8192 tokens) makes 63 chunks
# each way a step, each a GEMM and half a dozen small launches, 1,770 device operations a step
# more than at 256 MiB (benchmarks/launches.py, bf16), each some microseconds of the host's
# time on a card; at 256 MiB 4 chunks each way, GEMMs of 2048 rows, and a transient of about
# 640 MiB (10 bytes a logit there: `head.head_workspace_nbytes`).
HEAD_CHUNK_BYTES = {"cpu": 16 << 20, "gpu": 256 << 20, "standin": 256 << 20}


def head_once(mode: str, out16: bool, device: str, precision: str) -> bool:
    """Whether `run.head: mode` computes the head once: where a device's GEMMs and kernels
    write 16 bits (`out16`), auto and once; chunks never; once refused elsewhere."""
    if mode not in RunConfig.HEADS:
        raise ValueError(f"run.head={mode!r}: expected one of {', '.join(RunConfig.HEADS)}")
    if mode == "once" and not out16:
        raise ValueError(head_once_refused(device, precision))
    return out16 and mode != "chunks"


class ExecContext:
    """Execution context of the block kernels (their interface: `exec.layers`).

    `kernels`: the rank's table (`exec.backends.kernels_for`); without one, the `auto` table
    of `xp` and `precision`. `host`: whether it computes on the host (numpy), asked once."""

    def __init__(
        self,
        model: ModelConfig,
        precision: str = "fp32",
        xp=np,
        ledger=None,
        threads: int = 0,
        head_chunk_bytes: int | None = None,
        kernels: Kernels | None = None,
        head: str = "auto",
    ):
        if precision not in DTYPES:
            raise ValueError(f"precision={precision!r}: expected fp32, fp16 or bf16 (fp64: tests)")
        self.kernels = kernels if kernels is not None else default_kernels(xp, precision, model)
        if self.kernels.device != kind_of(xp):
            raise ValueError(f"a kernel table for {self.kernels.device} given to a context "
                             f"computing on {kind_of(xp)}")
        self.host = self.kernels.host
        self.xp = xp
        self.model = model
        self.precision = precision
        self.dtype = DTYPES[precision]
        self.half = is_half_dtype(self.dtype)  # 16-bit activations and views (fp16, bf16)
        # arithmetic inside a block: fp32, or fp64 for finite-difference tests
        self.compute = np.dtype(np.float64 if precision == "fp64" else np.float32)
        self.ledger = ledger
        self.threads = threads if threads > 0 else auto_threads()
        # the 16-bit dtype of the layers' GEMMs in fp16 and bf16 (both operands in it, fp32
        # accumulation), else None: a device's always (tensor cores), a host's where its BLAS
        # takes the dtype natively (`run.blas`, `Kernels.native`); otherwise the host keeps
        # fp32 GEMMs (16-bit operands converted by tiles, `exec.gemm`)
        self.gemm_half = self.dtype if self.half and self.kernels.native(self.dtype) else None
        # the 16-bit layout between GEMMs (`exec.layers`): wherever the GEMMs are 16-bit (a
        # device's, with its GEMMs into fp32 by cuBLAS's GemmEx, `exec.devgemm`; a host's on
        # oneMKL)
        self.half_layout = self.gemm_half is not None
        # where a device's kernels write a 16-bit GEMM operand themselves (`exec.deventries`:
        # they read and write 16 bits): the dtype the layers give such outputs (the norms', RoPE's
        # into the attention's 16-bit q and k, SwiGLU's, the backward's dgate|dup and dq|dk|dv),
        # else None (fp32 outputs, cast where a GEMM takes 16 bits). The same bits either way
        self.out16 = self.gemm_half if not self.host else None
        # bound on the fp32 logits of one head chunk: the device's unless given
        self.head_chunk_bytes = head_chunk_bytes or HEAD_CHUNK_BYTES[self.kernels.device]
        # whether the head computes its logits once, 16-bit and whole (`exec.head`, `run.head`)
        self.head_once = head_once(head, self.out16 is not None, self.kernels.device, precision)
        self._rope: dict[int, tuple] = {}
        self._pool = None

    @classmethod
    def from_config(cls, cfg, xp=np, ledger=None, **kw) -> ExecContext:
        kw.setdefault("kernels", kernels_for(cfg, xp))
        kw.setdefault("head_chunk_bytes", cfg.run.head_chunk_mib << 20)  # 0: the device's
        kw.setdefault("head", cfg.run.head)
        return cls(cfg.model, cfg.precision, xp, ledger, cfg.run.threads, **kw)

    # -- numerics ---------------------------------------------------------------------------

    def rope(self, seq_len: int):
        """(cos, sin), each (T, D) in the compute dtype, for `seq_len` tokens (cached)."""
        if seq_len not in self._rope:
            m = self.model
            self._rope[seq_len] = rope_tables(seq_len, m.head_dim, m.rope_theta, self.xp,
                                              self.compute)
        return self._rope[seq_len]

    # -- ledger -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def scratch(self, tag: str, nbytes: int):
        """Account `nbytes` of transient memory under `tag` while the block runs."""
        if self.ledger is None or nbytes <= 0:
            yield
            return
        self.ledger.reserve(tag, nbytes)
        try:
            yield
        finally:
            self.ledger.unreserve(tag, nbytes)

    # -- threads ----------------------------------------------------------------------------

    def split(self, batch: int) -> list[slice]:
        """The batch's contiguous chunks: `min(batch, BATCH_CHUNKS)` of them on the CPU (one on
        a GPU), a function of the batch alone (never of the thread count)."""
        n = min(BATCH_CHUNKS, batch) if self.host else 1
        return [slice(batch * i // n, batch * (i + 1) // n) for i in range(max(n, 1))]

    def parts(self) -> int:
        """How many pieces to cut purely elementwise work into (copies, additions): one per
        thread. Never use it to decide an order of reduction."""
        return max(1, self.threads) if self.host else 1

    def map(self, fn, items):
        """[fn(item) for item in items]: the items in up to `threads` threads, each thread a
        contiguous group of them in order, every BLAS call single-threaded."""
        items = list(items)
        if not self.host:
            return [fn(it) for it in items]
        n = min(self.threads, len(items))
        with BLAS.limit(1):
            if n <= 1:
                return [fn(it) for it in items]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="ratrain-exec")
            bounds = [len(items) * i // n for i in range(n + 1)]
            groups = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            futures = [self._pool.submit(lambda g: [fn(it) for it in g], g) for g in groups[1:]]
            try:
                first = [fn(it) for it in groups[0]]
            finally:
                wait(futures)  # never leave a worker running past this region
            return first + [r for f in futures for r in f.result()]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["BATCH_CHUNKS", "BLAS", "HEAD_CHUNK_BYTES", "ExecContext", "auto_threads",
           "head_once", "sgemm_rate"]
