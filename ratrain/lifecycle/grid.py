"""Draw a schedule as a time x rank grid, so a wrong schedule is seen, not guessed.

Each rank's list is played on a unit clock (a forward takes `f` ticks, a backward `b`, messages
and lifecycle actions take none; a receive waits for its send, `GradNorm` for every rank). A cell
shows the compute started at that tick (`1F0`: stage 1, forward of micro-batch 0), followed by the
lifecycle actions that ran during it (`S3`: start the sync of layers.3; `Ue`: update embed; see
`schedule.py` for the letters); a row `end` holds what runs after the last compute.

    >>> print(grid([Policy("ratrain").build_step(info) for info in infos]))
"""

from __future__ import annotations

from ratrain.lifecycle.schedule import (
    Backward,
    Forward,
    GradNorm,
    RecvBackward,
    RecvForward,
    SendBackward,
    SendForward,
    expand,
)


def timeline(lists, blocks=None, f: int = 1, b: int = 1):
    """Play the lists; returns per rank a list of (tick, label, [lifecycle labels]) cells.

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

    def add_loose(s, label):
        if not loose[s]:
            loose_tick[s] = t[s]
        loose[s].append(label)

    def flush_loose(s):
        if loose[s]:
            cells[s].append([loose_tick[s], "", loose[s]])
            loose[s] = []

    while any(ip[s] < len(lists[s]) for s in range(pp)):
        progress = False
        for s in range(pp):
            while ip[s] < len(lists[s]):
                a = lists[s][ip[s]]
                if isinstance(a, (RecvForward, RecvBackward)):
                    key = ("fwd" if isinstance(a, RecvForward) else "bwd", s, a.mb)
                    if key not in sent:
                        break
                    t[s] = max(t[s], sent.pop(key))
                elif isinstance(a, SendForward):
                    sent[("fwd", s + 1, a.mb)] = t[s]
                elif isinstance(a, SendBackward):
                    sent[("bwd", s - 1, a.mb)] = t[s]
                elif isinstance(a, GradNorm):
                    if not all(
                        ip[r] < len(lists[r]) and isinstance(lists[r][ip[r]], GradNorm)
                        for r in range(pp)
                    ):
                        break
                    tn = max(t)
                    for r in range(pp):
                        if t[r] != tn:
                            flush_loose(r)
                        t[r] = tn
                        add_loose(r, "N")
                        ip[r] += 1
                    progress = True
                    continue
                elif isinstance(a, (Forward, Backward)):
                    flush_loose(s)
                    hooks = [e.label(s) for blk, e in expand(a, blocks[s]) if blk is None]
                    cells[s].append([t[s], a.label(s), hooks])
                    t[s] += f if isinstance(a, Forward) else b
                else:
                    add_loose(s, a.label(s))
                ip[s] += 1
                progress = True
        if not progress:
            raise ValueError("schedule is stuck (run validate.simulate for details)")
    for s in range(pp):
        flush_loose(s)
    return cells


def grid(lists, blocks=None, f: int = 1, b: int = 1, lifecycle: bool = True) -> str:
    """The step x rank grid as text: one row per tick, one column per stage."""
    cells = timeline(lists, blocks, f, b)
    end = max((c[0] for cs in cells for c in cs), default=0)
    rows: dict[int, list[str]] = {}
    for s, cs in enumerate(cells):
        for tick, label, life in cs:
            text = label
            if lifecycle and life:
                text = (text + " " if text else "") + " ".join(life)
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
    return "\n".join(line.rstrip() for line in lines)


__all__ = ["grid", "timeline"]
