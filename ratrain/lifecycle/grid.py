"""Draw a schedule as a time x rank grid, so a wrong schedule is seen, not guessed.

Each rank's list is played on a unit clock (a forward takes `f` ticks, a backward `b`, messages
and lifecycle actions take none; a receive waits for its send, `GradNorm` for every rank). A cell
shows the compute started at that tick (`F mb0`: forward of micro-batch 0; the column is the
stage), followed, in brackets, by the lifecycle actions that ran during it (`[sync L3,
drop-view L3]`); a row holds what ran after the last compute of a stage. `LEGEND` explains the
words; `grid(..., legend=True)` prints it under the grid.

    >>> plan = PipelinePlan.from_config(cfg)             # lifecycle.pipeline: no buffers
    >>> print(grid(plan.steps(2)[1], plan.blocks))      # a step after a step: plan.grid()
"""

from __future__ import annotations

from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.schedule import dispatch_table, expand

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
    sched.RecvForward: (_RECV, "fwd", 0), sched.RecvBackward: (_RECV, "bwd", 0),
    sched.SendForward: (_SEND, "fwd", +1), sched.SendBackward: (_SEND, "bwd", -1),
    sched.GradNorm: (_NORM,), sched.Forward: (_COMPUTE,), sched.Backward: (_COMPUTE,),
}, ignore=(sched.MaterializeView, sched.WaitView, sched.DropView, sched.AllocGrad, sched.FreeGrad, sched.SyncGrad, sched.WaitGrad, sched.Update),
   default=(_LIFE,), others=(_LIFE,))  # a pass's actions: lifecycle, like these


class _Player:
    """Plays every rank's list on the unit clock (see the module); `cells[s]` is the result."""

    def __init__(self, lists, blocks, f, b):
        self.lists, self.blocks, self.f, self.b = lists, blocks, f, b
        pp = len(lists)
        self.t, self.ip = [0] * pp, [0] * pp
        self.sent: dict[tuple[str, int, int], int] = {}  # (channel, receiving stage, mb) -> tick
        self.cells: list[list] = [[] for _ in range(pp)]
        self.loose: list[list[str]] = [[] for _ in range(pp)]  # lifecycle since the last compute
        self.loose_tick = [0] * pp  # when the first of them ran

    def add_loose(self, s, name):
        if not self.loose[s]:
            self.loose_tick[s] = self.t[s]
        self.loose[s].append(name)

    def flush_loose(self, s):
        if self.loose[s]:
            self.cells[s].append([self.loose_tick[s], "", self.loose[s]])
            self.loose[s] = []

    def current(self, s):
        return self.lists[s][self.ip[s]] if self.ip[s] < len(self.lists[s]) else None

    def play(self, s) -> bool:
        """Advance stage `s` by one action; False when it must wait (a receive, the norm)."""
        a = self.current(s)
        what = _PLAY[type(a)]
        t = self.t
        if what[0] == _RECV:
            key = (what[1], s, a.mb)
            if key not in self.sent:
                return False
            t[s] = max(t[s], self.sent.pop(key))
        elif what[0] == _SEND:
            self.sent[(what[1], s + what[2], a.mb)] = t[s]
        elif what[0] == _NORM:  # every rank meets: all advance together
            if not all(self.current(r) is not None and _PLAY[type(self.current(r))][0] == _NORM
                       for r in range(len(t))):
                return False
            tn = max(t)
            for r in range(len(t)):
                if t[r] != tn:
                    self.flush_loose(r)
                t[r] = tn
                self.add_loose(r, a.name())
                self.ip[r] += 1
            return True
        elif what[0] == _COMPUTE:
            self.flush_loose(s)
            hooks = [e.name() for blk, e in expand(a, self.blocks[s]) if blk is None]
            self.cells[s].append([t[s], a.name(), hooks])
            t[s] += self.f if isinstance(a, sched.Forward) else self.b
        else:
            self.add_loose(s, a.name())
        self.ip[s] += 1
        return True


def timeline(lists, blocks=None, f: int = 1, b: int = 1):
    """Play the lists; returns per rank a list of (tick, compute name, [lifecycle names]) cells.

    `blocks[stage]` (block names) lets compute hooks show; sends are buffered here (the
    rendezvous check lives in `validate.simulate`)."""
    pp = len(lists)
    player = _Player(lists, blocks or [() for _ in range(pp)], f, b)
    while any(player.current(s) is not None for s in range(pp)):
        progress = False
        for s in range(pp):
            while player.current(s) is not None and player.play(s):
                progress = True
        if not progress:
            raise ValueError("schedule is stuck (run validate.simulate for details)")
    for s in range(pp):
        player.flush_loose(s)
    return player.cells


def grid(lists, blocks=None, f: int = 1, b: int = 1, lifecycle: bool = True,
         legend: bool | str = False) -> str:
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
        lines += ["", legend if isinstance(legend, str) else LEGEND]
    return "\n".join(line.rstrip() for line in lines)


def legend(passes=()) -> str:
    """`LEGEND` with the words of `passes` (each pass's `legend`, where it has one)."""
    extra = [p.legend for p in passes if getattr(p, "legend", "")]
    return "\n".join([LEGEND, *extra])


__all__ = ["LEGEND", "grid", "legend", "timeline"]
