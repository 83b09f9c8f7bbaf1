"""Offload to the memory tier, a pass over the step: where its transfers go, what they hold.

A fourth recovery choice beside keeping, recomputing selectively and recomputing fully: a layer
whose choice is `offload` keeps everything its forward saves (as `none`), but not in the DDR:
its saved activations are written to the tier (`platform.tier`) right after its forward and
fetched back right before its backward. A block's optimizer state may live in the tier too
(`offload.optimizer`: AdamW's moments, or moments and fp32 masters), fetched before its update
and written back after it. Nothing computed changes, only where bytes wait. Which layers go is
`lifecycle.recovery`'s choice; the executor's side is `runtime.passes.offload`.

Placement (`place`, pure, on one stage's step or flush list; `OffloadPass.rewrite` applies it):

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

The pass gives the validator `TierCheck` (a layer's activations out only after its forward and
back before its backward, one write and one read in flight, nothing left out at a list's end),
the memory model `MemoryTier` (bytes in the DDR and in the tier) and the simulator `TierItems`
(each transfer an item on the node's tier, `plan.tiersim`).

    p = OffloadPass(layers=(("layers.0",), ()), state="moments")   # per stage; or of_config
    plan = with_layers(plan, [("layers.1",), ()])                  # another recovery choice
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import ClassVar

from ratrain.exec.params import shard_size
from ratrain.exec.spec import block_role
from ratrain.lifecycle.passes.base import Pass, named
from ratrain.lifecycle.schedule import Action, Forward, MaterializeView, Update, block_label
from ratrain.lifecycle.validate import Extension

NAME = "offload"
STATE_MODES = ("off", "moments", "masters")
STATE_TIER_BYTES = {"off": 0, "moments": 8, "masters": 12}  # per parameter of the own segment

# -- its actions ---------------------------------------------------------------------------------

TIER_WHAT = ("act", "state", "master")


@dataclass(frozen=True)
class _Tier(Action):
    """A transfer between the DDR and the tier (`offload.*`): `what` is `act`, a layer's saved
    activations of micro-batch `mb`; `state`, the block's optimizer state (its moments, and its
    fp32 master when masters are offloaded), around its update; `master`, the block's master
    fetched read-only for a view cast (dropped, not written back)."""

    block: str
    mb: int = -1  # act: the micro-batch; -1 otherwise
    what: str = "act"
    group: ClassVar[str] = "lifecycle"

    def __post_init__(self):
        if self.what not in TIER_WHAT or (self.what == "act") != (self.mb >= 0):
            raise ValueError(f"{type(self).__name__}: what={self.what!r} mb={self.mb}: "
                             f"what is one of {TIER_WHAT}, with a micro-batch for act only")

    def verb(self) -> str:
        return self.word + ("" if self.what == "act" else f"-{self.what}")

    def name(self) -> str:
        mb = f" mb{self.mb}" if self.what == "act" else ""
        return f"{self.verb()}{mb} {block_label(self.block)}"


@dataclass(frozen=True)
class Offload(_Tier):
    """Start writing to the tier (in the tier's thread): a layer's activations after its forward
    (the DDR copy is released at `WaitOffload`), a block's optimizer state after its update;
    `master` drops the read-only copy at once (nothing is written)."""

    word: ClassVar[str] = "offload"

    def verb(self) -> str:
        return "drop-master" if self.what == "master" else super().verb()


@dataclass(frozen=True)
class WaitOffload(_Tier):
    """Wait for that write; the DDR copy is released."""

    word: ClassVar[str] = "wait-offload"


@dataclass(frozen=True)
class Fetch(_Tier):
    """Start reading back from the tier into a new DDR buffer (accounted from here): a layer's
    activations before its backward, a block's optimizer state (or master) before its use."""

    word: ClassVar[str] = "fetch"


@dataclass(frozen=True)
class WaitFetch(_Tier):
    """Wait for that read, before the first use of what it brings."""

    word: ClassVar[str] = "wait-fetch"


TIER_ACTIONS: tuple[type[Action], ...] = (Offload, WaitOffload, Fetch, WaitFetch)


# -- the pass ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadPass(Pass):
    """The tier's transfers: `layers[s]`, stage s's layers whose activations go to the tier
    (empty: none yet, or the whole stage's choice to come, `lifecycle.recovery`), and `state`,
    the optimizer state that lives there (`offload.optimizer`)."""

    layers: tuple[tuple[str, ...], ...] = ()
    state: str = "off"
    name: ClassVar[str] = NAME
    actions: ClassVar[tuple[type[Action], ...]] = TIER_ACTIONS
    legend: ClassVar[str] = """\
offload mbI L / wait-offload mbI L   write layer L's activations to the tier / wait for it
fetch mbI L / wait-fetch mbI L       read them back before L's backward / wait for it
fetch-state L ... offload-state L    block L's optimizer state from / to the tier around its
fetch-master L ... drop-master L     update; its master read for a view cast, then dropped"""

    def __post_init__(self):
        if self.state not in STATE_MODES:
            raise ValueError(f"offload.optimizer={self.state!r} is not one of "
                             f"{', '.join(STATE_MODES)}")
        object.__setattr__(self, "layers", tuple(tuple(x) for x in self.layers))

    def layers_of(self, stage: int) -> tuple[str, ...]:
        return self.layers[stage] if stage < len(self.layers) else ()

    def check(self, policy, stages, passes) -> None:
        if self.state == "masters" and not stages[0].separate_views:
            raise ValueError("offload.optimizer=masters: in fp32 with whole optimizer state the "
                             "working view is the master itself, which every forward reads; "
                             "use precision fp16, a policy that shards the optimizer state "
                             "(ratrain at dp > 1), or offload.optimizer=moments")
        if self.layers and len(self.layers) != len(stages):
            raise ValueError(f"offloaded layers given for {len(self.layers)} stages, the plan "
                             f"has {len(stages)}")

    def rewrite(self, lists, info, phase, policy):
        own = self.layers_of(info.stage)
        return tuple(place(lst, info.blocks, own, self.state) for lst in lists)

    def validator(self, life):
        return TierCheck(life.fail, self.layers_of(life.stage), self.state)

    def memory(self, walk):
        return MemoryTier(walk, self.state)

    def simulator(self, flat):
        return TierItems(flat, self.state)

    def describe(self) -> str:
        n = sum(len(x) for x in self.layers)
        return f"offload ({n} layers' activations, optimizer state {self.state})"


def of_config(cfg, blocks) -> OffloadPass | None:
    """The pass `offload.*` asks for: every layer under `offload.activations: all`, none yet
    under auto and prefer (the rank chooses at start-up, `runtime.measure`); None when off."""
    off = cfg.offload
    if not off.enabled:
        return None
    layers = tuple(tuple(b for b in names if block_role(b) == "layer") if off.activations == "all"
                   else () for names in blocks)
    return OffloadPass(layers, off.optimizer)


def of_plan(plan) -> OffloadPass | None:
    """The plan's offload pass, or None."""
    return named(plan.passes, NAME)


def state_of(plan) -> str:
    """The optimizer state that lives in the tier under `plan` (`off` without the pass)."""
    p = of_plan(plan)
    return p.state if p is not None else "off"


def layers_of(plan) -> tuple[tuple[str, ...], ...]:
    """Every stage's layers whose activations go to the tier under `plan`."""
    p = of_plan(plan)
    return tuple(p.layers_of(s) if p is not None else () for s in range(plan.pp))


def with_layers(plan, layers, state: str | None = None, validate: bool = True):
    """`plan` with the tier's transfers of `layers[s]` (stage s's offloaded layers: a recovery
    choice) and the optimizer `state` (default the plan's)."""
    p = OffloadPass(tuple(tuple(x) for x in layers), state_of(plan) if state is None else state)
    return plan.with_pass(p, validate=validate)


def lists_with(plan, stage: int, layers, n: int) -> list[tuple[Action, ...]]:
    """Stage `stage`'s lists for `n` steps of `plan` with the activation transfers of its
    `layers` in place, the rest untouched (what a recovery choice would run; the plan must
    offload none of that stage's layers yet)."""
    if layers_of(plan)[stage]:
        raise ValueError(f"stage {stage} offloads {list(layers_of(plan)[stage])} already")
    blocks = plan.stages[stage].blocks
    return [place(lst, blocks, layers) for lst in plan.stage_steps(stage, n)]


# -- placement -----------------------------------------------------------------------------------


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


# -- the interpreters' handlers ------------------------------------------------------------------


class TierCheck(Extension):
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
        return dict.fromkeys(TIER_ACTIONS, self._move)

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

    def before(self, blk, e) -> None:
        """Check a compute event, an update or a view cast against the tier."""
        if isinstance(e, TIER_ACTIONS):
            return
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


class MemoryTier:
    """Bytes the tier's transfers hold, for `lifecycle.memory`'s walk `w` (its `cur`, `bump`,
    `sizes`, `blocks`): a write's DDR copy until its `WaitOffload`, a read's from its `Fetch`;
    the tier's own bytes (`cur`, `peak`: the resident optimizer state plus what is in flight or
    parked). The optimizer state in the tier (`state`) is not in the DDR: it comes off the
    walk's static bytes unless those were measured (`StageSizes.static`)."""

    def __init__(self, walk, state: str = "off"):
        self.w = walk
        held = held_params(walk.sizes, walk.blocks)
        per = STATE_TIER_BYTES[state]
        self.state_bytes = {b: per * n for b, n in held.items()}
        self.master_bytes = {b: 4 * n for b, n in held.items()}
        self.cur = self.peak = sum(self.state_bytes.values())
        if walk.sizes.static is None:
            walk.cur -= self.cur

    def handlers(self) -> dict:
        return {Offload: self._offload, WaitOffload: self._wait_offload, Fetch: self._fetch,
                WaitFetch: self._wait_fetch}

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


def held_params(sizes, blocks) -> dict[str, int]:
    """Parameters of each block's held segment (the whole block unless sharded)."""
    return {b: shard_size(sizes.params[b], sizes.shards) for b in blocks}


class TierItems:
    """The tier's actions of one rank's step as the simulator's items (`plan.events`, its
    `flat.add`): a transfer (`tier`: bytes out or in) for `Offload` / `Fetch`, a wait
    (`tierwait`) for `WaitOffload` / `WaitFetch`; a read-only master dropped moves nothing.
    Bytes: a layer's saved activations as the memory model counts them
    (`CostModel.offload_bytes`), a block's optimizer state in the tier (`STATE_TIER_BYTES`
    per parameter of its segment), a master 4 per parameter."""

    def __init__(self, flat, state: str = "off"):
        self.flat, self.mode = flat, state

    def handlers(self) -> dict:
        return {Offload: self._move, Fetch: self._move, WaitOffload: self._wait,
                WaitFetch: self._wait}

    def _key(self, a):
        return (self.flat.step, a.what, a.block, a.mb)

    def _bytes(self, a) -> float:
        fig, role = self.flat.figure, block_role(a.block)
        if a.what == "act":
            return fig("offload_bytes", role)
        n = shard_size(fig("block_params", role), self.flat.shards)
        return (STATE_TIER_BYTES[self.mode] if a.what == "state" else 4) * n

    def _move(self, a):
        if isinstance(a, Offload) and a.what == "master":
            return  # a read-only copy, dropped: nothing moves
        self.flat.add("tier", a, key=self._key(a), nbytes=self._bytes(a))

    def _wait(self, a):
        self.flat.add("tierwait", a, key=self._key(a))


__all__ = ["Fetch", "MemoryTier", "NAME", "Offload", "OffloadPass", "STATE_MODES",
           "STATE_TIER_BYTES", "TIER_ACTIONS", "TIER_WHAT", "TierCheck", "TierItems", "WaitFetch",
           "WaitOffload", "held_params", "layers_of", "lists_with", "of_config", "of_plan",
           "place", "state_of", "with_layers"]
