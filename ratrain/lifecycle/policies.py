"""Policies: where the lifecycle actions go in a rank's step, never what is computed.

Every policy runs the same compute (the pipeline order of `schedule.py`), syncs every block's
gradient with its own collective (a Megatron bucket is several blocks submitted together), adds
the per-block norm partials in global block order and updates each block with the same AdamW
call, so losses are bitwise identical across policies. What differs is *when*:

- `baseline-1f1b` (DeepSpeed-style): at step start every view is materialised and every gradient
  allocated; after the stage's last backward all gradients are synchronised, the global norm is
  taken and every block updated; gradients and (fp16) views are released at the end of the step.
- `megatron-1f1b`: as the baseline, but during the last micro-batch's backward each bucket of
  consecutive blocks (about `bucket_bytes` of fp32 gradients) starts its sync as soon as its
  last block's backward is done.
- `gpipe`: the baseline's lifecycle on the GPipe order (a reference).
- `ratrain`: per block and per stage. A gradient is allocated at the block's first backward and its
  sync starts right after the block's last backward, overlapping the rest of the backward; in fp16
  the view is dropped there too. An update needs the step's global facts (clip coefficient, and the
  overflow / non-finite flag that makes every rank skip the same steps, in fp32 too), and these
  need every stage's gradients: they are known only after stage 0's last backward and its syncs,
  when every later stage has long been idle. So each block's update, gradient release and
  next-step view are deferred to the start of the next step, ahead of the wait for the first
  activations (the executor posts that receive first): the warm-up bubble of every later stage,
  exactly where its cool-down idleness could not be used. On stage 0 there is no bubble either
  way; the update lands just ahead of its first forward, where the baseline's end-of-step update
  would have been.
  Deferred work carries from step to step: `build_step(..., carry=True)` starts with it and
  `build_flush` finishes it (before a checkpoint, an evaluation or the end of training).
  With dp > 1 (`StageInfo.shards = dp`, `schedule.shard_optimizer`) ratrain also shards each
  block's fp32 master and AdamW moments over the replicas (ZeRO-1, per block): the sync is a
  ring reduce-scatter (replica q keeps the reduced segment q, summed in the all-reduce's exact
  order), the update runs on the own segment, and the next step's view is cast from the own
  master segment and ring all-gathered (fp16: a quarter of the all-reduce's bytes): issued at
  step start with the updates, waited for just before the block's first forward, so the gather
  of block l+1 runs under the forward of block l. Views are then separate buffers in fp32 too
  (the master is only a segment), made every step and dropped after the block's last backward.
  The baseline and Megatron keep whole masters and moments on every replica (GPU-style
  DeepSpeed / Megatron without ZeRO).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ratrain.config import ScheduleConfig, is_half
from ratrain.lifecycle.schedule import (
    Action,
    AllocGrad,
    DropView,
    FreeGrad,
    GradNorm,
    MaterializeView,
    SyncGrad,
    Update,
    WaitGrad,
    WaitView,
    add_hooks,
    gpipe,
    one_f_one_b,
)

POLICIES = ScheduleConfig.POLICIES  # baseline-1f1b, megatron-1f1b, ratrain, gpipe
MEGATRON_BUCKET_BYTES = 40_000_000 * 4  # Megatron-LM's default bucket: 40M fp32 gradient elements


@dataclass(frozen=True)
class StageInfo:
    """What a policy needs to know about one rank's stage."""

    pp: int
    stage: int
    num_micro_batches: int
    blocks: tuple[str, ...]  # this stage's blocks in model order
    block_bytes: tuple[int, ...]  # fp32 gradient bytes of each block
    precision: str = "fp32"
    shards: int = 1  # dp segments of each block's master and moments (1: whole on every replica)

    @property
    def half(self) -> bool:
        """16-bit working views (fp16, bf16): buffers of their own, cast from the masters."""
        return is_half(self.precision)

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @property
    def separate_views(self) -> bool:
        """Views are buffers of their own (16-bit, or a sharded master): made and dropped."""
        return self.half or self.sharded


SYNCS, UPDATES = ScheduleConfig.SYNCS, ScheduleConfig.UPDATES
BUFFER_MODES, RECOVERIES = ScheduleConfig.BUFFER_MODES, ScheduleConfig.RECOVERIES
ORDERS = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Components:
    """The switches a policy is made of: when each lifecycle action happens (never what is
    computed: every combination is bitwise the same training).

    - `sync`: when a block's gradient sync starts: `end` (every block after the stage's last
      backward), `bucket` (Megatron's buckets, as each bucket's last block finishes its last
      backward), `layer` (each block right after its own last backward);
    - `update`: `end` (every block after the step's global facts) or `next-step` (deferred to
      the start of the next step, into the stage's own warm-up bubble: stage-local);
    - `buffers`: `resident` (views made and gradients allocated at step start, held to the end)
      or `per-block` (a gradient allocated at the block's first backward, a separate view
      dropped after its last backward);
    - `shard`: the optimizer state cut over the dp replicas (ZeRO-1 per block): syncs become
      reduce-scatters, views are gathered;
    - `prefetch` (sharded): each view's gather waited for just before the block's first forward
      (so it runs under the previous blocks' forwards) instead of all at step start;
    - `recovery` (`schedule.recompute: auto`): `per-layer` (the fewest layers recomputed that fit
      the cap) or `uniform` (every layer or none, as GPU frameworks' full recomputation);
    - `order`: the pipeline order, `1f1b` or `gpipe` (a reference);
    - `lifecycle`: False for a bare order (`1f1b-bare`, `gpipe-bare`): the pipeline alone, no
      lifecycle action at all (the reference the planner measures the lifecycle against).
    """

    sync: str = "end"
    update: str = "end"
    buffers: str = "resident"
    shard: bool = False
    prefetch: bool = False
    recovery: str = "per-layer"
    order: str = "1f1b"
    lifecycle: bool = True

    def __post_init__(self):
        for key, ok in (("sync", SYNCS), ("update", UPDATES), ("buffers", BUFFER_MODES),
                        ("recovery", RECOVERIES), ("order", ORDERS)):
            if getattr(self, key) not in ok:
                raise ValueError(f"schedule.{key}={getattr(self, key)!r} is not one of: "
                                 f"{', '.join(ok)}")


# The named policies, as presets of the components (`Policy(name)`).
PRESETS = {
    "baseline-1f1b": Components(),  # DeepSpeed-style
    "megatron-1f1b": Components(sync="bucket"),
    "ratrain": Components(sync="layer", update="next-step", buffers="per-block", shard=True,
                          prefetch=True),
    "gpipe": Components(order="gpipe"),
    "1f1b-bare": Components(lifecycle=False),
    "gpipe-bare": Components(order="gpipe", lifecycle=False),
}


@dataclass(frozen=True)
class Policy:
    """A named preset (`name`), or the preset's components with some switched
    (`Policy("baseline-1f1b", components=Components(sync="layer"))`, labelled with the switches:
    `baseline-1f1b(sync=layer)`; `policy_of` makes one from a config's schedule section)."""

    name: str = "ratrain"
    bucket_bytes: int = MEGATRON_BUCKET_BYTES  # sync=bucket only
    components: Components | None = None

    def __post_init__(self):
        if self.name not in PRESETS:
            raise ValueError(f"policy {self.name!r} is not one of: {', '.join(PRESETS)}")
        if self.components is None:
            object.__setattr__(self, "components", PRESETS[self.name])

    @property
    def label(self) -> str:
        """The preset's name, or `name+switches` when components differ from it."""
        preset = PRESETS[self.name]
        diff = [f"{k}={getattr(self.components, k)}" for k in Components.__dataclass_fields__
                if getattr(self.components, k) != getattr(preset, k)]
        return self.name + ("(" + ",".join(diff) + ")" if diff else "")

    def shards(self, dp: int) -> int:
        """Segments each block's optimizer state is cut into: dp when the policy shards, 1
        (whole on every replica) otherwise."""
        return dp if self.components.shard and dp > 1 else 1

    def carries(self, info: StageInfo) -> bool:
        """Whether a step leaves lifecycle work or state for the next (see `build_flush`)."""
        return self.components.update == "next-step"

    def build_step(self, info: StageInfo, carry: bool = False) -> tuple[Action, ...]:
        """This rank's actions for one step. `carry`: the previous step of this policy ran and
        was not flushed (only deferred updates carry)."""
        if carry and not self.carries(info):
            raise ValueError(f"policy {self.label} carries nothing between steps")
        if info.sharded and not self.components.shard:
            raise ValueError(f"policy {self.label} keeps whole optimizer state on every replica "
                             f"(shards={info.shards}); only a sharding policy shards it "
                             "(schedule.shard_optimizer=true)")
        return _build(self.components, info, carry, self.bucket_bytes)

    def build_flush(self, info: StageInfo) -> tuple[Action, ...]:
        """Finish what the last step left (run after a step built with this policy)."""
        if not self.carries(info):
            return ()
        return tuple(a for b in info.blocks for a in (Update(b), FreeGrad(b)))

    def steps(self, info: StageInfo, n: int, flush: bool = True) -> list[tuple[Action, ...]]:
        """This rank's lists for `n` consecutive steps as the executor runs them (the first
        without carried work), then, with `flush`, the flush that ends a run."""
        out, carry = [], False
        for _ in range(n):
            out.append(self.build_step(info, carry))
            carry = self.carries(info)
        if flush:
            out.append(self.build_flush(info))
        return out


# ScheduleConfig's component keys -> Components fields
_KEYS = {"sync": "sync", "update": "update", "buffers": "buffers", "shard_optimizer": "shard",
         "prefetch": "prefetch", "recovery": "recovery"}


def policy_of(schedule: ScheduleConfig, name: str | None = None) -> Policy:
    """The policy a `schedule` section asks for: the preset `name` (default `schedule.policy`)
    with every component key the section sets (`schedule.sync`, ...) switched."""
    name = name or schedule.policy
    preset = Policy(name).components
    switched = {f: getattr(schedule, k) for k, f in _KEYS.items() if getattr(schedule, k) is not None}
    return Policy(name, components=replace(preset, **switched))


def buckets(info: StageInfo, bucket_bytes: int) -> list[tuple[str, ...]]:
    """Consecutive blocks in backward order, each bucket closed once it holds >= bucket_bytes."""
    out, cur, size = [], [], 0
    for b, n in zip(reversed(info.blocks), reversed(info.block_bytes)):
        cur.append(b)
        size += n
        if size >= bucket_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
    if cur:
        out.append(tuple(cur))
    return out


def _build(c: Components, info: StageInfo, carry: bool, bucket_bytes: int):
    """One step of any combination of components (see `Components` and the module)."""
    blocks, m = info.blocks, info.num_micro_batches
    backward_order = tuple(reversed(blocks))
    sharded, separate = info.sharded, info.separate_views
    deferred, per_block = c.update == "next-step", c.buffers == "per-block"
    pipeline = (gpipe if c.order == "gpipe" else one_f_one_b)(info.pp, info.stage, m)
    if not c.lifecycle:  # a bare order
        return tuple(pipeline)

    # step start (the warm-up bubble: the executor has already posted the first receive): the
    # previous step's deferred updates, this step's views (an unsharded fp32 view is the master,
    # made once), their gathers when sharded; resident gradients
    start: list[Action] = []
    for b in blocks:
        if carry:
            start += [Update(b), FreeGrad(b)]
        if separate or not carry:
            start.append(MaterializeView(b, gather=sharded))
    if sharded and not c.prefetch:  # every gather waited for at once
        start += [WaitView(b) for b in blocks]
    if not per_block:
        start += [AllocGrad(b) for b in blocks]

    # pipeline hooks: prefetched views waited for just before the block's first forward;
    # per-block gradients appear at the first backward; syncs (and per-block views' release)
    # right after the last backward of the block (or of its bucket's last block)
    first_fwd = [(b, WaitView(b)) for b in blocks] if sharded and c.prefetch else []
    first_bwd = [(b, AllocGrad(b)) for b in blocks] if per_block else []
    groups = {"end": [], "layer": [(b,) for b in backward_order],
              "bucket": buckets(info, bucket_bytes)}[c.sync]
    last_bwd = []
    for b in backward_order:
        last_bwd += [(g[-1], SyncGrad(g, scatter=sharded)) for g in groups if g[-1] == b]
        if per_block and separate:
            last_bwd.append((b, DropView(b)))
    body = add_hooks(pipeline, fwd_pre={0: first_fwd}, bwd_pre={0: first_bwd},
                     bwd_post={m - 1: last_bwd})

    # cool-down: the syncs' waits in the order they started (`end`: all syncs now), the global
    # facts (they need every stage), then, unless deferred, the updates and releases
    if c.sync == "end":
        end: list[Action] = [SyncGrad(backward_order, scatter=sharded),
                             WaitGrad(backward_order, scatter=sharded)]
    else:
        end = [WaitGrad(g, scatter=sharded) for g in groups]
    end.append(GradNorm())
    if not deferred:
        end += [Update(b) for b in blocks] + [FreeGrad(b) for b in blocks]
    if separate and not per_block:
        end += [DropView(b) for b in blocks]
    return tuple(start + list(body) + end)


__all__ = ["BUFFER_MODES", "MEGATRON_BUCKET_BYTES", "ORDERS", "POLICIES", "PRESETS", "RECOVERIES",
           "SYNCS", "UPDATES", "Components", "Policy", "StageInfo", "buckets", "policy_of"]
