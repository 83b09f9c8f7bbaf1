"""The reduce board: small all-reduces of a one-node communicator through shared memory.

A message-passing all-reduce of a few bytes costs log2(p) exchanges, each a round trip through
MPI and, from Python, a few microseconds of interpreter work per rank; on a node with fewer
cores than ranks every rank's work is on the critical path (4 ranks on 2 cores, calls back to
back: 31 us against MPI_Allreduce's 6). The board does it in one compiled call per rank:

    post   write x into this rank's slot of round t, then its counter (a release store)
    wait   until every rank's counter is >= t (acquire loads), yielding the core between checks
    fold   read every rank's slot and reduce them in the tree's order (`collectives`: y[i] =
           x[i] + x[i+m] for i < p - m, then pairwise over rank order), every rank itself, so
           every rank holds the same bits, the message tree's bits.

Layout, in one window held by the communicator's rank 0: p round counters, one per 64-byte
line, then per rank two slots of `BOARD_BYTES`. Round t uses slot t mod 2: a rank posts round
t + 2 only after it finished round t + 1, which needed every rank's post of round t + 1, which
each made after it finished reading round t. Rounds are numbered on every rank alike because
collectives on one communicator run in the same order on every rank.

The kernels are compiled by numba (the `fast` extra; `boardkernel`, imported with the first
board, so a process without boards never imports numba; `RATRAIN_FUSED=0` turns the path off
like the fused kernels, `RATRAIN_BOARD=0` the board alone); without it the tree's messages carry every all-reduce. Only the work dtypes
whose payload is its own work dtype (float32, float64, int32, int64) and arrays of up to
`BOARD_BYTES` take the board; `attach(comm)` (collective) makes a communicator's board, kept
as an MPI attribute of the communicator and freed with it.

A blocking round waits at most `WAIT_S` for the other ranks' posts (`set_wait_limit`, which the
communication engine calls with `comm.timeout`), then raises `TimeoutError` naming the round:
like the engine's operations it never hangs on a stopped peer. With `comm.timeout: 0` (no
watchdog) the limit stays at its default, the config's default timeout, since nothing else
would watch a blocking round.
"""

from __future__ import annotations


import numpy as np
from mpi4py import MPI

from ratrain.fastpath import FastPath

from . import model
from .progress import wait_for

BOARD_BYTES = 64 << 10  # the largest payload (bytes) an all-reduce takes through the board
LINE = 64  # one counter per cache line
SPINS = 2000  # yields a blocking call spends in the kernel before it polls from Python
DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))
OPCODES = {np.add: 0, np.maximum: 1, np.minimum: 2}  # the kernel's op by ufunc ...
_CODES = {"sum": 0, "max": 1, "min": 2}  # ... and by name


# Off by default: whole training steps ran 2-8% slower with it than with the tree's messages
# (benchmarks/board_step.py, docs/BENCHMARKS.md); RATRAIN_BOARD=1 turns it on.
_state = FastPath("RATRAIN_BOARD", default_on=False)


def enabled() -> bool:
    """Whether this process may use boards (numba importable, not turned off)."""
    return _state.on


def why_off() -> str:
    """Why boards are off ("" when on)."""
    return _state.why_off


def available() -> bool:
    """Whether numba imports, so that a board could be used (`forced`)."""
    return _state.available


def forced():
    """All-reduces in the block take the board where it fits (tests; numba must import)."""
    return _state.forced()


def disabled():
    """All-reduces in the block take the messages (tests compare the two; every rank alike)."""
    return _state.disabled()


def _on_one_node(comm) -> bool:
    """Whether this rank shares memory with every rank of `comm` (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    one = node.Get_size() == comm.Get_size()
    node.Free()
    return one


WAIT_S = 300.0  # the longest a blocking round waits for a peer (seconds; `set_wait_limit`)


def set_wait_limit(seconds: float | None) -> None:
    """Bound blocking rounds by `seconds` (`comm.timeout`); 0 or None keeps the default."""
    global WAIT_S
    if seconds:
        WAIT_S = float(seconds)


class Board:
    """The board of a one-node communicator (collective to make and to `free`)."""

    def __init__(self, comm):
        self.kernel = _kernel()  # numba imported now: boards are on
        p, self.rank = comm.Get_size(), comm.Get_rank()
        head = p * LINE
        self.nbytes = head + 2 * p * BOARD_BYTES
        self.win = MPI.Win.Allocate_shared(self.nbytes if self.rank == 0 else 0, LINE, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch: Sync orders the zeroing
        mem = np.frombuffer(self.win.Shared_query(0)[0], np.uint8)[: self.nbytes]
        if self.rank == 0:
            mem[:] = 0
        self.win.Sync()
        self.counters = mem[:head].view(np.int64)[:: LINE // 8]
        slots = mem[head:]
        self.typed = {d: slots.view(d).reshape(p, 2, -1) for d in DTYPES}  # every rank's 2 slots
        self.p = p
        self.taken = self.done = 0  # rounds begun / finished on this rank
        self.owner = id(comm)  # the communicator it belongs to (its key in `_BOARDS`)
        comm.Barrier()
        self.win.Sync()  # the rounds' own ordering: the kernel's release stores, acquire loads

    def allreduce(self, x: np.ndarray, opcode: int, slots=None, kernel=None) -> None:
        """All-reduce x (1-D, contiguous, a DTYPES dtype, <= BOARD_BYTES) in place, blocking.
        `slots` (`typed[x.dtype]`) and `kernel` (the compiled round, `_entry`'s or the
        dispatcher) as a plan of the fast path has them."""
        if self.done != self.taken:  # rounds of the engine in flight: this one comes after
            wait_for(lambda: self.done == self.taken, WAIT_S, f"board round {self.taken}")
        t = self.taken = self.taken + 1
        s = self.typed[x.dtype] if slots is None else slots
        rnd = self.kernel.run_round
        if not (kernel or rnd)(self.counters, s, self.rank, t, x, opcode, True, SPINS):
            wait_for(lambda: rnd(self.counters, s, self.rank, t, x, opcode, False, 0), WAIT_S,
                     f"rank {self.rank}: board all-reduce round {t}")
        self.done = t

    def allreduce_op(self, x: np.ndarray, opcode: int):
        """`allreduce` as an operation (`progress`): rounds in the order they are begun."""
        t = self.taken = self.taken + 1
        if self.done != t - 1:
            yield lambda: self.done == t - 1
        s, rnd = self.typed[x.dtype], self.kernel.run_round
        if not rnd(self.counters, s, self.rank, t, x, opcode, True, 0):
            yield lambda: rnd(self.counters, s, self.rank, t, x, opcode, False, 0)
        self.done = t

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


_KEY: list = []  # the MPI attribute key under which a communicator keeps its board
_BOARDS: dict = {}  # id(comm) -> (comm, its board): the blocking calls' lookup (`allreduce`)


def _free(_comm, _key, board) -> None:
    if isinstance(board, Board):
        _BOARDS.pop(board.owner, None)
        for k in [k for k in _PLANS if k[0] == board.owner]:
            del _PLANS[k]
        board.free()


def _key() -> int:
    if not _KEY:
        _KEY.append(MPI.Comm.Create_keyval(delete_fn=_free))
    return _KEY[0]


def attach(comm):
    """The board of `comm`, made now if it has none (collective: every rank calls it at the
    same point), or None where boards do not apply: a rank of its own, ranks on several nodes,
    or boards off on some rank."""
    b = comm.Get_attr(_key())
    if b is None:
        # every rank makes the same collective calls, whatever its own switch says
        ok = comm.Get_size() > 1 and \
            comm.allreduce(int(_on_one_node(comm) and enabled()), op=MPI.MIN) == 1
        b = Board(comm) if ok else False
        comm.Set_attr(_key(), b)
        if b:
            _BOARDS[b.owner] = (comm, b)
    return b or None


_PLANS: dict = {}  # (id(comm), dtype, nbytes, op, auto) -> (comm, board, slots, opcode, kernel)
PLANS_MAX = 256  # a few kinds of small buffer in practice: the cache is cleared past this


def _kernel():
    """The module of the compiled round (`boardkernel`): numba is imported with it."""
    from . import boardkernel  # loads numba: only once a board is made

    return boardkernel


def _entry(counters, slots, dtype):
    """The compiled round for these arrays and 1-D buffers of `dtype`, called without numba's
    type dispatch (a fifth of a blocking call's CPU time), or the dispatcher itself where
    numba's compile results are not reachable that way. Its callers pass exactly these types:
    C-contiguous, aligned, writeable 1-D buffers of `dtype`, Python ints and bools."""
    k = _kernel()
    try:
        t, numba = k.types, k.numba
        sig = (numba.typeof(counters), numba.typeof(slots), t.int64, t.int64,
               t.Array(numba.from_dtype(dtype), 1, "C"), t.int64, t.boolean, t.int64)
        if sig not in k.run_round.overloads:
            k.run_round.compile(sig)
        return k.run_round.overloads[sig].entry_point
    except Exception:  # noqa: BLE001 - numba's internals moved: the dispatcher is always right
        return k.run_round


def _plan(buf, comm, op: str, auto: bool):
    """What a blocking all-reduce of arrays like `buf` with `op` on `comm` needs, made once:
    (comm, board, slots, opcode, kernel); (comm, None, ...) when such arrays do not fit, or
    when `auto` and the model picks the ring for them (`model.cheapest`, as `collectives`'
    `auto` does without a link); None while `comm` has no board (then nothing is kept:
    `attach` may make one later)."""
    e = _BOARDS.get(id(comm))
    if e is None or e[0] is not comm:
        return None
    b = e[1]
    s = b.typed.get(buf.dtype)
    code = _CODES.get(op)
    if s is None or code is None or buf.nbytes > BOARD_BYTES or \
            auto and model.cheapest(buf.nbytes, b.p) != "tree":
        plan = (comm, None, None, None, None)
    else:
        plan = (comm, b, s, code, _entry(b.counters, s, buf.dtype))
    if len(_PLANS) >= PLANS_MAX:
        _PLANS.clear()
    _PLANS[(id(comm), buf.dtype, buf.nbytes, op, auto)] = plan
    return plan


def allreduce(buf: np.ndarray, comm, op, auto: bool = False) -> bool:
    """All-reduce `buf` in place through the board `attach` made for `comm`, blocking, with
    the least work per call (where ranks outnumber cores every rank's interpreter time is on
    the critical path): True when done, False when `buf` must go another way (no board, it
    does not fit, or `auto` and the model picks the ring). For callers without a link, a
    node group or message logging."""
    if type(op) is not str:  # MPI.SUM or a ufunc: the other path
        return False
    plan = _PLANS.get((id(comm), buf.dtype, buf.nbytes, op, auto))
    if plan is None or plan[0] is not comm:  # new, or an earlier communicator's id
        plan = _plan(buf, comm, op, auto)
        if plan is None:
            return False
    b = plan[1]
    f = buf.flags
    if b is None or not (f.c_contiguous and f.aligned and f.writeable and _state.on):
        return False
    b.allreduce(buf if buf.ndim == 1 else buf.reshape(-1), plan[3], plan[2], plan[4])
    return True


def board_of(comm):
    """The board `attach` made for `comm`, else None (never collective)."""
    return comm.Get_attr(_key()) or None


def fits(x: np.ndarray, op) -> int | None:
    """The board's opcode for all-reducing x with ufunc `op`, or None when x does not fit (the
    same on every rank for the same call: it never asks this rank's switch, which `attach`
    agrees on and `usable` reads)."""
    if x.dtype not in DTYPES or x.nbytes > BOARD_BYTES or not x.flags.c_contiguous:
        return None
    return OPCODES.get(op)


def usable(b) -> bool:
    """Whether board `b` (or None) takes the call: there is one and the path is on (off on
    every rank alike: `disabled()` in tests; a switch off on some rank gave no board)."""
    return b is not None and _state.on


__all__ = ["BOARD_BYTES", "Board", "allreduce", "attach", "board_of", "disabled", "enabled", "fits",
           "usable"]
