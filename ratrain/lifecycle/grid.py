"""Draw a schedule as a time x rank grid, so a wrong schedule is seen, not guessed.

Each rank's list is played on a unit clock (a forward takes `f` ticks, a backward `b`, messages
and lifecycle actions take none; a receive waits for its send, `GradNorm` for every rank). A cell
shows the compute started at that tick (`F mb0`: forward of micro-batch 0; the column is the
stage), followed, in brackets, by the lifecycle actions that ran during it (`[sync L3,
drop-view L3]`); a row holds what ran after the last compute of a stage. `LEGEND` explains the
words; `grid(..., legend=True)` prints it under the grid.

    >>> print(grid([Policy("ratrain").build_step(info) for info in infos]))
"""

from __future__ import annotations

from ratrain.lifecycle.schedule import (
    AllocGrad,
    Backward,
    DropView,
    Forward,
    FreeGrad,
    GradNorm,
    MaterializeView,
    RecvBackward,
    RecvForward,
    SendBackward,
    SendForward,
    SyncGrad,
    Update,
    WaitGrad,
    WaitView,
    dispatch_table,
    expand,
)

LEGEND = """\
F mbI / B mbI   forward / backward of micro-batch I through this stage's blocks
view L / gather-view L   cast block L's fp16 view from its master (and start its all-gather)
wait-view L     wait for block L's view all-gather     drop-view L   release block L's view
alloc-grad L    allocate block L's gradient            free-grad L   release it
sync L          start block L's gradient all-reduce    sync-scatter L   ... its reduce-scatter
wait-sync L     wait for that collective               update L      AdamW of block L
norm            the step's global facts (gradient norm, overflow, loss): every rank meets
L<i> = layers.<i>; embed, head as they are"""

_RECV, _SEND, _NORM, _COMPUTE, _LIFE = "recv", "send", "norm", "compute", "lifecycle"
_PLAY = dispatch_table("grid.timeline", {
    RecvForward: (_RECV, "fwd", 0), RecvBackward: (_RECV, "bwd", 0),
    SendForward: (_SEND, "fwd", +1), SendBackward: (_SEND, "bwd", -1),
    GradNorm: (_NORM,), Forward: (_COMPUTE,), Backward: (_COMPUTE,),
}, ignore=(MaterializeView, WaitView, DropView, AllocGrad, FreeGrad, SyncGrad, WaitGrad, Update),
    default=(_LIFE,))


def timeline(lists, blocks=None, f: int = 1, b: int = 1):
    """Play the lists; returns per rank a list of (tick, compute name, [lifecycle names]) cells.

    `blocks[stage]` (block names) lets compute hooks show; sends are buffered here (the
    rendezvous check lives in `validate.simulate`)."""
    pp = len(lists)
    blocks = blocks or [() for _ in range(pp)]
    t = [0] * pp
    ip = [0] * pp
    sent: dict[tuple[str, int, int], int] = {}  # (channel, receiving stage, mb) -> tick
    cells: list[list] = [[] for _ in range(pp)]
    loose: list[list[str]] = [[] for _ in range(pp)]  # lifecycle since the last compute
    loose_tick = [0] * pp  # when the first of them ran

    def add_loose(s, name):
        if not loose[s]:
            loose_tick[s] = t[s]
        loose[s].append(name)

    def flush_loose(s):
        if loose[s]:
            cells[s].append([loose_tick[s], "", loose[s]])
            loose[s] = []

    def at_norm(r):
        return ip[r] < len(lists[r]) and _PLAY[type(lists[r][ip[r]])][0] == _NORM

    while any(ip[s] < len(lists[s]) for s in range(pp)):
        progress = False
        for s in range(pp):
            while ip[s] < len(lists[s]):
                a = lists[s][ip[s]]
                what = _PLAY[type(a)]
                if what[0] == _RECV:
                    key = (what[1], s, a.mb)
                    if key not in sent:
                        break
                    t[s] = max(t[s], sent.pop(key))
                elif what[0] == _SEND:
                    sent[(what[1], s + what[2], a.mb)] = t[s]
                elif what[0] == _NORM:
                    if not all(at_norm(r) for r in range(pp)):
                        break
                    tn = max(t)
                    for r in range(pp):
                        if t[r] != tn:
                            flush_loose(r)
                        t[r] = tn
                        add_loose(r, a.name())
                        ip[r] += 1
                    progress = True
                    continue
                elif what[0] == _COMPUTE:
                    flush_loose(s)
                    hooks = [e.name() for blk, e in expand(a, blocks[s]) if blk is None]
                    cells[s].append([t[s], a.name(), hooks])
                    t[s] += f if isinstance(a, Forward) else b
                else:
                    add_loose(s, a.name())
                ip[s] += 1
                progress = True
        if not progress:
            raise ValueError("schedule is stuck (run validate.simulate for details)")
    for s in range(pp):
        flush_loose(s)
    return cells


def grid(lists, blocks=None, f: int = 1, b: int = 1, lifecycle: bool = True,
         legend: bool = False) -> str:
    """The step x rank grid as text: one row per tick, one column per stage."""
    cells = timeline(lists, blocks, f, b)
    end = max((c[0] for cs in cells for c in cs), default=0)
    rows: dict[int, list[str]] = {}
    for s, cs in enumerate(cells):
        for tick, name, life in cs:
            text = name
            if lifecycle and life:
                text = (text + " " if text else "") + "[" + ", ".join(life) + "]"
            if not text:
                continue
            row = rows.setdefault(tick, [""] * len(cells))
            row[s] = (row[s] + " " + text).strip()
    width = max([len(x) for r in rows.values() for x in r] + [6])
    head = "tick | " + " | ".join(f"stage {s}".ljust(width) for s in range(len(cells)))
    lines = [head, "-" * len(head)]
    for tick in range(end + 1):
        if tick in rows:
            lines.append(f"{tick:4d} | " + " | ".join(x.ljust(width) for x in rows[tick]))
    if legend:
        lines += ["", LEGEND]
    return "\n".join(line.rstrip() for line in lines)


__all__ = ["LEGEND", "grid", "timeline"]
