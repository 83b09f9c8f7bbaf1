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

from dataclasses import dataclass

from ratrain.config import ScheduleConfig
from ratrain.exec.params import GRAD_BYTES_PER_PARAM
from ratrain.exec.spec import stage_blocks
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

    @classmethod
    def from_config(cls, cfg, stage: int, blocks, policy=None) -> StageInfo:
        """From a `Config` and the stage's `BlockSpec`s (`policy`: default cfg.schedule.policy)."""
        pol = as_policy(policy if policy is not None else cfg.schedule.policy)
        return cls(
            pp=cfg.parallel.pp,
            stage=stage,
            num_micro_batches=cfg.parallel.num_micro_batches,
            blocks=tuple(b.name for b in blocks),
            block_bytes=tuple(GRAD_BYTES_PER_PARAM * b.size for b in blocks),
            precision=cfg.precision,
            shards=pol.shards(cfg.parallel.dp, cfg.schedule.shard_optimizer),
        )

    @property
    def fp16(self) -> bool:
        return self.precision == "fp16"

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @property
    def separate_views(self) -> bool:
        """Views are buffers of their own (fp16, or a sharded master): made and dropped."""
        return self.fp16 or self.sharded


@dataclass(frozen=True)
class Policy:
    name: str = "ratrain"
    bucket_bytes: int = MEGATRON_BUCKET_BYTES  # megatron-1f1b only

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"policy {self.name!r} is not one of: {', '.join(POLICIES)}")

    def shards(self, dp: int, enabled: bool = True) -> int:
        """Segments each block's optimizer state is cut into: dp under `ratrain` (when
        `enabled`, i.e. `schedule.shard_optimizer`), 1 (whole on every replica) otherwise."""
        return dp if self.name == "ratrain" and enabled and dp > 1 else 1

    def carries(self, info: StageInfo) -> bool:
        """Whether a step leaves lifecycle work or state for the next (see `build_flush`)."""
        return self.name == "ratrain"

    def build_step(self, info: StageInfo, carry: bool = False) -> tuple[Action, ...]:
        """This rank's actions for one step. `carry`: the previous step of this policy ran and
        was not flushed (only `ratrain` carries)."""
        if carry and not self.carries(info):
            raise ValueError(f"policy {self.name} carries nothing between steps")
        if info.sharded and self.name != "ratrain":
            raise ValueError(f"policy {self.name} keeps whole optimizer state on every replica "
                             f"(shards={info.shards}); only ratrain shards it")
        if self.name == "ratrain":
            return _ratrain_step(info, carry)
        order = gpipe if self.name == "gpipe" else one_f_one_b
        pipeline = order(info.pp, info.stage, info.num_micro_batches)
        if self.name == "megatron-1f1b":
            return _resident_step(info, pipeline, buckets(info, self.bucket_bytes))
        return _resident_step(info, pipeline, None)

    def build_flush(self, info: StageInfo) -> tuple[Action, ...]:
        """Finish what the last step left (run after a step built with this policy)."""
        if self.name != "ratrain":
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


def as_policy(policy) -> Policy:
    return policy if isinstance(policy, Policy) else Policy(str(policy))


def stage_infos(model, pp: int, m: int, precision: str = "fp32", shards: int = 1,
                layers_per_stage=None) -> list[StageInfo]:
    """Every stage's `StageInfo` of a model split into `pp` stages (one replica)."""
    out = []
    for s in range(pp):
        blocks = stage_blocks(model, pp, s, layers_per_stage)
        out.append(StageInfo(pp, s, m, tuple(b.name for b in blocks),
                             tuple(GRAD_BYTES_PER_PARAM * b.size for b in blocks), precision,
                             shards))
    return out


def pipeline_steps(policy, infos, n: int) -> list[list[tuple[Action, ...]]]:
    """`n` consecutive steps of every stage: `out[k][stage]` (no flush), as the executors of
    one replica run them."""
    pol = as_policy(policy)
    per_stage = [pol.steps(info, n, flush=False) for info in infos]
    return [[lists[k] for lists in per_stage] for k in range(n)]


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


def _resident_step(info: StageInfo, pipeline, bucket_list) -> tuple[Action, ...]:
    """baseline / megatron / gpipe: views and gradients resident for the whole step."""
    blocks, last = info.blocks, info.num_micro_batches - 1
    start = [MaterializeView(b) for b in blocks] + [AllocGrad(b) for b in blocks]
    if bucket_list is None:  # baseline: everything after the last backward
        body = list(pipeline)
        sync = [SyncGrad(tuple(reversed(blocks))), WaitGrad(tuple(reversed(blocks)))]
    else:  # megatron: each bucket starts when its last block's last backward is done
        hooks = [(bk[-1], SyncGrad(bk)) for bk in bucket_list]
        body = list(add_hooks(pipeline, bwd_post={last: hooks}))
        sync = [WaitGrad(bk) for bk in bucket_list]
    end = [GradNorm()] + [Update(b) for b in blocks] + [FreeGrad(b) for b in blocks]
    if info.fp16:
        end += [DropView(b) for b in blocks]
    return tuple(start + body + sync + end)


def _ratrain_step(info: StageInfo, carry: bool) -> tuple[Action, ...]:
    """ratrain: per-block lifecycle in this stage's own idle time."""
    blocks, m = info.blocks, info.num_micro_batches
    backward_order = tuple(reversed(blocks))
    pipeline = one_f_one_b(info.pp, info.stage, m)
    sharded, separate = info.sharded, info.separate_views

    # step start (the warm-up bubble: the executor has already posted the first receive):
    # finish the previous step's deferred updates and make this step's views (sharded: start
    # their all-gathers, which then run under the updates of the next blocks and the forwards)
    start: list[Action] = []
    for b in blocks:
        if carry:
            start += [Update(b), FreeGrad(b)]
        if separate or not carry:  # an unsharded fp32 view is the master: made once
            start.append(MaterializeView(b, gather=sharded))

    # pipeline: a sharded view is waited for just before the block's first forward; gradients
    # appear at the first backward; each block's sync starts (and its separate view goes)
    # right after its last backward
    first_fwd = [(b, WaitView(b)) for b in blocks] if sharded else []
    first_bwd = [(b, AllocGrad(b)) for b in blocks]
    last_bwd = []
    for b in backward_order:
        last_bwd.append((b, SyncGrad((b,), scatter=sharded)))
        if separate:
            last_bwd.append((b, DropView(b)))
    body = add_hooks(pipeline, fwd_pre={0: first_fwd}, bwd_pre={0: first_bwd},
                     bwd_post={m - 1: last_bwd})

    # cool-down: wait for the syncs in the order they started; the global facts need every stage
    end = [WaitGrad((b,), scatter=sharded) for b in backward_order] + [GradNorm()]
    return tuple(start + list(body) + end)


__all__ = ["MEGATRON_BUCKET_BYTES", "POLICIES", "Policy", "StageInfo", "as_policy", "buckets",
           "pipeline_steps", "stage_infos"]
