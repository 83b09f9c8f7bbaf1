"""Offload to the memory tier as lifecycle actions: where they go, what they hold, what to offload.

A fourth recovery choice beside keeping, recomputing selectively and recomputing fully: a layer
whose choice is `offload` keeps everything its forward saves (as `none`), but not in the DDR:
its saved activations are written to the tier (`platform.tier`) right after its forward and
fetched back right before its backward. A block's optimizer state may live in the tier too
(`offload.optimizer`: AdamW's moments, or moments and fp32 masters), fetched before its update
and written back after it. Nothing computed changes, only where bytes wait.

Placement (`place`, pure, on one stage's step or flush list; `PipelinePlan.build` applies it):

- activations, double-buffered along the rank's compute events (a block's part of a compute
  action): `Offload(L, mb)` after L's forward, its `WaitOffload` after the next compute event
  (the write runs under it), so one layer is written while the next computes; `Fetch(L, mb)`
  before the compute event that precedes L's backward and `WaitFetch` just before L's backward
  (the read runs under that event), so one layer is read while another runs backward;
- optimizer state, double-buffered along the list's updates: the first block's `Fetch` right
  after the last compute before the updates (under the syncs' waits and the norm barrier), each
  next block's while the previous one updates, each `Offload` after the update (masters: after
  the view cast that follows it), its `WaitOffload` after the next update, the last before the
  next compute action; with masters offloaded a view cast without an update before it fetches
  the master read-only (`what="master"`) and drops it after the cast.

`MemoryTier` gives the memory model (`lifecycle.memory`) its handlers for these actions (bytes in
the DDR and in the tier); `choose_recovery` picks each layer's choice under the DDR cap for
`schedule.recompute: auto` (the executor at start-up, with measured sizes, and the planner, with
sizes from shapes: the same rule); `hidden_layers` is `offload.activations: auto`'s rule for how
many layers the tier can take without showing (their transfers under the stage's compute).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

from ratrain.exec.params import shard_size
from ratrain.exec.spec import block_flops, block_role
from ratrain.lifecycle import schedule as sched
from ratrain.lifecycle.schedule import (
    Fetch,
    Forward,
    MaterializeView,
    Offload,
    Update,
    WaitFetch,
    WaitOffload,
)

OFFLOAD = "offload"  # the recovery choice of an offloaded layer
STATE_MODES = ("off", "moments", "masters")
STATE_TIER_BYTES = {"off": 0, "moments": 8, "masters": 12}  # per parameter of the own segment


def kernel_recompute(choice: str) -> str:
    """What the kernels re-run for a recovery choice (an offloaded layer keeps everything)."""
    return "none" if choice == OFFLOAD else choice


# -- placement ----------------------------------------------------------------------------------


def place(actions, blocks, offloaded=frozenset(), state: str = "off"):
    """`actions` (one step or flush list of a stage of `blocks`) with the tier's transfers in
    place for the `offloaded` layers and the optimizer `state` mode (see the module)."""
    actions = tuple(actions)
    if offloaded:
        actions = _place_activations(actions, tuple(blocks), frozenset(offloaded))
    if state != "off":
        actions = _place_state(actions, masters=state == "masters")
    return actions


def _compute_events(actions, blocks):
    """[(index of the compute action, block, forward?, mb)] in run order."""
    out = []
    for i, a in enumerate(actions):
        if a.group != "compute":
            continue
        fwd = isinstance(a, Forward)
        for b in (blocks if fwd else reversed(blocks)):
            out.append((i, b, fwd, a.mb))
    return out


def _place_activations(actions, blocks, offloaded):
    events = _compute_events(actions, blocks)
    pre, post = defaultdict(list), defaultdict(list)
    written: dict[tuple[str, int], tuple[str, int]] = {}  # (L, mb) -> where its wait went
    pending = None
    for k, (_, b, fwd, mb) in enumerate(events):
        if pending is not None:  # the previous write ran under this event: wait for it now
            if not fwd and (b, mb) == pending:  # this is its own backward: wait first
                pre[k].append(WaitOffload(*pending))
                written[pending] = ("pre", k)
            else:
                post[k].append(WaitOffload(*pending))
                written[pending] = ("post", k)
            pending = None
        if fwd and b in offloaded:
            post[k].append(Offload(b, mb))
            pending = (b, mb)
    if pending is not None:  # cannot happen in a step (a backward follows every forward)
        post[len(events) - 1].append(WaitOffload(*pending))
        written[pending] = ("post", len(events) - 1)
    for k, (_, b, fwd, mb) in enumerate(events):
        if fwd or b not in offloaded:
            continue
        at = ("pre", max(k - 1, 0))  # the read runs under the previous compute event
        done = written[(b, mb)]
        if (done[1], done[0] == "post") >= (at[1], at[0] == "post"):
            at = done  # right after the write's wait
        (pre if at[0] == "pre" else post)[at[1]].append(Fetch(b, mb))
        pre[k].append(WaitFetch(b, mb))
    return _repack(actions, events, pre, post)


def _repack(actions, events, pre, post):
    """The compute actions with the events' extra hooks added (after their own)."""
    extra: dict[int, tuple[list, list]] = {}
    for k, (i, b, _, _) in enumerate(events):
        p, q = extra.setdefault(i, ([], []))
        p += [(b, h) for h in pre.get(k, ())]
        q += [(b, h) for h in post.get(k, ())]
    out = []
    for i, a in enumerate(actions):
        if i in extra and (extra[i][0] or extra[i][1]):
            a = replace(a, pre=a.pre + tuple(extra[i][0]), post=a.post + tuple(extra[i][1]))
        out.append(a)
    return tuple(out)


def _place_state(actions, masters: bool):
    # visits: a block's update (with, masters offloaded, the view cast right after it), or a
    # view cast alone (masters: the master fetched read-only)
    visits: list[list] = []  # [what, block, first index, last index]
    for i, a in enumerate(actions):
        if isinstance(a, Update):
            visits.append(["state", a.block, i, i])
        elif masters and isinstance(a, MaterializeView):
            last = visits[-1] if visits else None
            if last is not None and last[0] == "state" and last[1] == a.block and all(
                    not isinstance(x, (Update, MaterializeView)) for x in actions[last[3] + 1:i]):
                last[3] = i
            else:
                visits.append(["master", a.block, i, i])
    if not visits:
        return actions
    before, after = defaultdict(list), defaultdict(list)
    first = visits[0][2]
    lead = max((i + 1 for i, a in enumerate(actions[:first]) if a.group == "compute"), default=0)
    before[lead].append(Fetch(visits[0][1], what=visits[0][0]))
    writing = None  # the last state write in flight
    for j, (what, b, i0, i1) in enumerate(visits):
        before[i0].append(WaitFetch(b, what=what))
        if j + 1 < len(visits):
            nxt = visits[j + 1]
            before[i0].append(Fetch(nxt[1], what=nxt[0]))
        if writing is not None:  # it ran under this update
            after[i0].append(WaitOffload(writing, what="state"))
            writing = None
        after[i1].append(Offload(b, what=what))
        if what == "state":
            writing = b
    if writing is not None:  # before the next compute action (or at the end)
        i1 = visits[-1][3]
        end = next((i for i in range(i1 + 1, len(actions)) if actions[i].group == "compute"),
                   len(actions))
        before[end].append(WaitOffload(writing, what="state"))
    out = []
    for i, a in enumerate(actions):
        out += before.get(i, [])
        out.append(a)
        out += after.get(i, [])
    out += before.get(len(actions), [])
    return tuple(out)


# -- the memory model's handlers ----------------------------------------------------------------


class MemoryTier:
    """Bytes the tier's transfers hold, for `lifecycle.memory`'s walk `w` (its `cur`, `bump`,
    `sizes`): a write's DDR copy until its `WaitOffload`, a read's from its `Fetch`; the tier's
    own bytes (`cur`, `peak`: the resident optimizer state plus what is in flight or parked)."""

    def __init__(self, walk, held_params: dict[str, int]):
        self.w = walk
        per = STATE_TIER_BYTES[walk.sizes.offload_state]
        self.state_bytes = {b: per * n for b, n in held_params.items()}
        self.master_bytes = {b: 4 * n for b, n in held_params.items()}
        self.cur = self.peak = sum(self.state_bytes.values())

    def handlers(self) -> dict:
        return {Offload: self._offload, WaitOffload: self._wait_offload, Fetch: self._fetch,
                sched.WaitFetch: self._wait_fetch}

    def _bytes(self, e) -> int:
        if e.what == "act":
            return self.w.sizes.kept(e.block)
        return (self.state_bytes if e.what == "state" else self.master_bytes)[e.block]

    def _tier(self, n: int) -> None:
        self.cur += n
        self.peak = max(self.peak, self.cur)

    def _offload(self, blk, e):
        if e.what == "act":
            self._tier(self._bytes(e))
        elif e.what == "master":  # a read-only copy: dropped
            self.w.cur -= self._bytes(e)

    def _wait_offload(self, blk, e):
        self.w.cur -= self._bytes(e)

    def _fetch(self, blk, e):
        self.w.cur += self._bytes(e)

    def _wait_fetch(self, blk, e):
        if e.what == "act":
            self.cur -= self._bytes(e)


class TierCheck:
    """The validator's view of the tier (`lifecycle.validate.check_lifecycle`): a layer's
    activations go out only after its forward and come back (fetched, waited for) before its
    backward; a block's offloaded state is fetched before its update, its master before a view
    cast; one write and one read of activations in flight at a time (double-buffered); nothing
    in flight or out of place at the end of a list. `fail(action, message)` raises."""

    def __init__(self, fail, offloaded=(), state: str = "off"):
        self.fail, self.offloaded, self.state = fail, frozenset(offloaded), state
        self.act: dict[tuple[str, int], str] = {}  # (layer, mb) -> in | writing | out | reading
        self.st: dict[str, str] = {}  # block -> tier | reading | in (| ...-master)

    # (action, what) -> (the state it finds, the state it leaves); act: activations of one
    # (layer, micro-batch), else the block's optimizer state (or master)
    MOVES = {
        (Offload, "act"): ("in", "writing"), (WaitOffload, "act"): ("writing", "out"),
        (Fetch, "act"): ("out", "reading"), (WaitFetch, "act"): ("reading", "in"),
        (Offload, "state"): ("in", "writing"), (WaitOffload, "state"): ("writing", "tier"),
        (Fetch, "state"): ("tier", "reading"), (WaitFetch, "state"): ("reading", "in"),
        (Fetch, "master"): ("tier", "reading-master"),
        (WaitFetch, "master"): ("reading-master", "in-master"),
        (Offload, "master"): ("in-master", "tier"),
    }

    def handlers(self) -> dict:
        return dict.fromkeys((Offload, WaitOffload, Fetch, WaitFetch), self._move)

    def _move(self, e, b, x):
        act = e.what == "act"
        table, key = (self.act, (b, e.mb)) if act else (self.st, b)
        frm, to = self.MOVES.get((type(e), e.what), (None, None))
        have = table.get(key, None if act else "tier")
        if frm is None or have != frm:
            self.fail(e, f"{e.name()} finds {key!r} {have or 'absent'}, not {frm}")
        table[key] = to
        if act and to in ("writing", "reading") and list(self.act.values()).count(to) > 1:
            self.fail(e, f"two activation {to[:-3]}s in flight (double-buffered: one)")

    def use(self, blk, e) -> None:
        """Check a compute event, an update or a view cast against the tier."""
        if blk is not None and blk in self.offloaded:
            if isinstance(e, Forward):
                self.act[(blk, e.mb)] = "in"
            elif self.act.pop((blk, e.mb), None) != "in":
                self.fail(e, f"backward of {blk} before its activations are back from the tier")
            return
        where = self.st.get(getattr(e, "block", None), "tier")
        if isinstance(e, Update) and self.state != "off" and where != "in":
            self.fail(e, f"update of {e.block} before its state is back from the tier")
        if isinstance(e, MaterializeView) and self.state == "masters" and where not in (
                "in", "in-master"):
            self.fail(e, f"view of {e.block} cast before its master is back from the tier")

    def unsettled(self) -> list[str]:
        """What is in flight, or state out of the tier: nothing may be at the end of a list."""
        busy = [f"{k}: {v}" for k, v in self.act.items() if v != "in"]
        return busy + [f"{k}: {v}" for k, v in self.st.items() if v != "tier"]


def held_params(sizes, blocks) -> dict[str, int]:
    """Parameters of each block's held segment (the whole block unless sharded)."""
    return {b: shard_size(sizes.params[b], sizes.shards) for b in blocks}


# -- which layers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierRates:
    """What `offload.activations: auto` weighs: the tier's `bandwidth` (B/s per node, None: not
    modelled), `latency` (s per transfer), the `sharing` ranks of a node, and the rank's
    `compute_flops` (None: not known, the tier is taken as free)."""

    bandwidth: float | None = None
    latency: float = 0.0
    sharing: int = 1
    compute_flops: float | None = None

    @classmethod
    def of_profile(cls, profile) -> TierRates:
        """The rates of a rank's `shim.platform.Profile` (its tier: `platform.tier`)."""
        spec = profile.tier
        return cls(spec.bandwidth if spec is not None else None,
                   (spec.latency or 0.0) if spec is not None else 0.0,
                   profile.ranks_per_node or 1, profile.compute_flops)

    def offloadable(self, model, blocks, micro_batch: int, act_bytes: int) -> int:
        """How many of a stage's layers (`blocks`) the tier takes without showing, each moving
        `act_bytes` out and back per micro-batch under the stage's compute (`hidden_layers`)."""
        layers = sum(1 for b in blocks if block_role(b) == "layer")
        if not self.compute_flops:
            return layers
        tokens = micro_batch * model.seq_len
        flops = sum(block_flops(model, block_role(b), tokens, phase)
                    for b in blocks if block_role(b) != "embed"
                    for phase in ("forward", "backward"))
        return hidden_layers(layers, act_bytes, flops / self.compute_flops, self.bandwidth,
                             self.latency, self.sharing)


def hidden_layers(layers: int, act_bytes: int, compute_s: float, bandwidth: float | None,
                  latency: float = 0.0, sharing: int = 1) -> int:
    """`offload.activations: auto`: how many of a stage's `layers` the tier takes without
    showing. Each offloaded layer moves `act_bytes` (its saved activations) out and back per
    micro-batch; the stage computes for `compute_s` per micro-batch (forward and backward of
    its blocks), under which the tier's transfers run, at the rank's share of the node's
    `bandwidth` (`sharing` ranks) plus `latency` per transfer. None bandwidth: the tier is not
    modelled (free), every layer."""
    if not bandwidth or math.isinf(bandwidth):
        return layers
    per_layer = 2 * (latency + act_bytes * sharing / bandwidth)
    if per_layer <= 0:
        return layers
    return max(0, min(layers, int(compute_s / per_layer)))


def recovery_choice(layers, moved: int, offloadable: int) -> dict[str, str]:
    """The first `moved` layers leave the DDR: the first `offloadable` of them to the tier, the
    rest recomputed fully; the others keep everything."""
    return {b: (OFFLOAD if i < min(moved, offloadable) else "full") if i < moved else "none"
            for i, b in enumerate(layers)}


def choose_recovery(cap, sizes, lists_for, blocks, per_layer: bool = True, mode: str = "off",
                    offloadable: int | None = None, tier_cap: int | None = None, walk=None):
    """`schedule.recompute: auto` with the tier: the fewest layers moved out of the DDR (the
    first ones of the stage) whose peak fits `cap`, the first `offloadable` of them offloaded
    (`mode` auto; prefer: all of them; off: none) and the rest recomputed fully; a choice
    whose tier bytes go over `tier_cap` offloads fewer. `lists_for(offloaded)`: the stage's
    lists with those layers' transfers in place; `walk(lists, sizes) -> (peak, tier peak)`.
    Returns ({layer: choice}, peak, tier peak). `per_layer=False`: no layer or every layer."""
    layers = [b for b in blocks if b.startswith("layers.")]
    top = {"off": 0, "prefer": len(layers), "auto": len(layers) if offloadable is None
           else offloadable}[mode]
    counts = range(len(layers) + 1) if per_layer else sorted({0, len(layers)})
    best = ({}, 0, 0)
    for k in counts:
        for j in range(min(k, top), -1, -1):  # as many offloaded as the tier holds
            choice = recovery_choice(layers, k, j)
            off = frozenset(b for b, c in choice.items() if c == OFFLOAD)
            peak, tier = walk(lists_for(off), sizes.with_recompute(choice))
            if tier_cap is None or tier <= tier_cap:
                break
        best = (choice, peak, tier)
        if cap is None or peak <= cap:
            return best
    return best


__all__ = ["MemoryTier", "OFFLOAD", "TierCheck", "TierRates", "STATE_MODES", "STATE_TIER_BYTES", "choose_recovery",
           "held_params", "hidden_layers", "kernel_recompute", "place", "recovery_choice"]
