"""AdamW with fp32 masters, global-norm clipping, the LR schedule and dynamic loss scaling.

Numerics follow PyTorch exactly where it is defined and closely where it is an implementation
detail:

- `AdamW.update_block` is `torch.optim.AdamW` (its single-tensor path, the default on CPU):
  `p *= 1 - lr*wd` (decoupled decay, before the Adam step), `m = lerp(m, g, 1 - b1)`,
  `v = v*b2 + (1 - b2)*g*g`, `denom = sqrt(v) / sqrt(1 - b2**t) + eps`,
  `p += (-lr / (1 - b1**t)) * m / denom`, every op in fp32 in torch's order, Python-float
  scalars rounded to fp32 as torch's kernels do. Bitwise identity with torch on the CPU is not
  attainable: its AVX2 `sqrt` is not correctly rounded (about 1 element in 5 differs by 1 ulp
  from IEEE sqrt, measured with torch 2.13) and its `lerp` / `addcmul` kernels use fused
  multiply-adds. The deviation is round-off (about 1e-7 relative per step); the tests bound it.
- Clipping is `torch.nn.utils.clip_grad_norm_`: total_norm = sqrt(sum of squares over every
  gradient), clip_coef = max_norm / (total_norm + 1e-6) in fp32, clamped to 1. Here the sum of
  squares is accumulated in float64 per (block, dp segment) (the table's `grad_norm`,
  `kernels.block_sq_norm` or its fused form, over the ring's
  segment q of the block, computed by replica q) and the runtime adds the partials segment by
  segment, then block by block in global block order (`global_grad_norm`), so the norm is the
  same under every policy (sharded or not) and independent of the pipeline split; it changes
  with dp only by reassociation. A non-finite norm is also the fp16 overflow signal.
- The clip coefficient and 1/loss_scale are folded into one fp32 `grad_scale` that multiplies
  the gradient before the update (exact: the loss scale is a power of two).
- `lr_at` is a LambdaLR-style schedule of the 0-based training step (see its docstring).
- `LossScaler` is `torch.amp.GradScaler`'s dynamic scale: x0.5 and skip on inf/nan, x2 after
  `loss_scale_window` consecutive clean steps.

Every stateful object has `state_dict()` / `load_state_dict()` (plain Python values) for
checkpoints; the moments themselves live in `StageState`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable

import numpy as np

from ratrain.config import OptimConfig
from ratrain.exec.backends import Kernels, default_kernels
from ratrain.exec.profile import timed

# Memory bytes one AdamW update moves per parameter: reads master, grad, m, v (4 x 4 B), writes
# master, m, v (3 x 4 B). The shim paces an update to these; the planner prices them.
ADAMW_BYTES_PER_PARAM = 28
_FP32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------
# Weight decay, clipping
# --------------------------------------------------------------------------------------------


def decays(name: str, cfg: OptimConfig, spec=None) -> bool:
    """Whether parameter `name` (global) gets weight decay: yes unless a glob in
    `cfg.no_decay` matches it (fnmatch, case-sensitive) or its ParamSpec says `decay=False`."""
    if spec is not None and not spec.decay:
        return False
    return not any(fnmatch.fnmatchcase(name, pat) for pat in cfg.no_decay)


def global_grad_norm(partials: Iterable[float], loss_scale: float = 1.0,
                     segments: int = 1) -> float:
    """The global gradient norm from sums of squares (the table's `grad_norm`). `partials` are per
    (block, dp segment) in global block order, each block's `segments` entries consecutive:
    each block's segments are added in order, then the block sums in order (with
    `segments=1`, per-block partials added in order). Gradients that still carry the loss
    scale are unscaled here: norm = sqrt(sum) / loss_scale."""
    parts = list(partials)
    if len(parts) % segments:
        raise ValueError(f"{len(parts)} partials are not whole blocks of {segments} segments")
    total = 0.0
    for i in range(0, len(parts), segments):
        block = 0.0
        for s in parts[i : i + segments]:
            block += s
        total += block
    return math.sqrt(total) / loss_scale


def clip_coef(total_norm: float, max_norm: float) -> float:
    """`clip_grad_norm_`'s factor: fp32 max_norm / (total_norm + 1e-6), clamped to 1.0.
    `max_norm <= 0` disables clipping (1.0)."""
    if max_norm <= 0:
        return 1.0
    coef = np.float32(max_norm) / (np.float32(total_norm) + np.float32(1e-6))
    return float(min(coef, np.float32(1.0)))


def grad_scale_for(total_norm: float, max_norm: float, loss_scale: float = 1.0) -> float:
    """The factor `update_block` folds into the gradient: clip_coef / loss_scale."""
    return float(np.float32(clip_coef(total_norm, max_norm)) / np.float32(loss_scale))


# --------------------------------------------------------------------------------------------
# Learning rate
# --------------------------------------------------------------------------------------------


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The multiplier of `cfg.lr` at 0-based training step `step` (a torch LambdaLR lambda).

    - warm-up, step < W = warmup_steps: (step + 1) / W (the first update already moves;
      step W - 1 reaches the full rate);
    - then `constant`: 1; `cosine`: with D = decay_steps (0 = total_steps - W) and
      progress = min(1, (step - W) / D), factor = r + (1 - r) * 0.5 * (1 + cos(pi * progress))
      where r = min_lr / lr; so step W has lr, step W + D and after have min_lr. D <= 0 means
      no decay.
    """
    w = cfg.warmup_steps
    if step < w:
        return (step + 1) / w
    if cfg.lr_schedule == "constant":
        return 1.0
    d = cfg.decay_steps or (total_steps - w)
    if d <= 0:
        return 1.0
    progress = min(1.0, (step - w) / d)
    r = cfg.min_lr / cfg.lr
    return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of 0-based training step `step` (skipped steps count: the schedule
    follows the iteration, as torch's scheduler.step() does every iteration)."""
    return cfg.lr * lr_factor(step, cfg, total_steps)


# --------------------------------------------------------------------------------------------
# AdamW
# --------------------------------------------------------------------------------------------


class AdamW:
    """torch.optim.AdamW over a StageState, one block at a time.

    `step` is Adam's update count t (torch's `state["step"]`): the first applied update is 1,
    and skipped (overflowed) steps do not count. Each block must be updated with consecutive
    t; the runtime takes `t = opt.step + 1` once at the start of a training step and passes it
    to every block's update.

    `kernels`: the rank's kernel table, whose `adamw` entry (fused on the host, numba-cuda on
    a GPU; None: the numpy reference here) updates each range; without one, the `auto` table of
    the state's array module.
    """

    def __init__(self, cfg: OptimConfig, kernels: Kernels | None = None):
        self.cfg = cfg
        self.kernels = kernels
        self.beta1, self.beta2 = cfg.betas
        self._base = 0  # t of every block not updated since construction / load
        self._block_step: dict[str, int] = {}
        self._decay_cache: dict[tuple[str, int], list[tuple[int, int]]] = {}

    @property
    def step(self) -> int:
        """The largest t applied to any block (all blocks agree between training steps)."""
        return max([self._base, *self._block_step.values()])

    def block_step(self, block: str) -> int:
        """The last update number `block` took (every block's t agrees between steps)."""
        return self._block_step.get(block, self._base)

    def decay_ranges(self, state, block: str) -> list[tuple[int, int]]:
        """Merged (start, stop) ranges within the block's held slice (`state.flat`: the whole
        block, or this replica's segment of it when sharded) that get weight decay."""
        lo, hi = state.segment(block)
        key = (block, id(state), lo, hi)
        if key not in self._decay_cache:
            base, _ = state.block_range(block)
            ranges: list[tuple[int, int]] = []
            for p in state.block(block).params:
                if not decays(p.name, self.cfg, p):
                    continue
                a, b = state.param_range(p.name)
                a, b = max(a - base, lo) - lo, min(b - base, hi) - lo  # within the segment
                if a >= b:
                    continue
                if ranges and ranges[-1][1] == a:
                    ranges[-1] = (ranges[-1][0], b)
                else:
                    ranges.append((a, b))
            self._decay_cache[key] = ranges
        return self._decay_cache[key]

    @timed("adamw")
    def update_block(self, state, block: str, step: int, lr: float, grad_scale: float = 1.0):
        """Apply AdamW update number `step` (t, 1-based) to `block`'s masters and moments.

        The part updated is what the state holds of the block (`state.flat`): the whole block,
        or, sharded over dp, this replica's segment with the matching gradient segment
        (`state.grad_segment`); the math is elementwise, so the union of the replicas' segment
        updates is bitwise the whole-block update. The gradient is first multiplied by
        `grad_scale` (clip coefficient / loss scale) in place, as torch's `unscale_` and
        `clip_grad_norm_` do, and is used as scratch afterwards: it holds garbage on return
        (free or re-zero it). One scratch the size of the updated part is held from the ledger
        (`scratch.optim`) during the call.
        """
        last = self._block_step.get(block, self._base)
        if step != last + 1:
            raise RuntimeError(
                f"AdamW update {step} of block {block!r} whose last update was {last}: "
                "updates of a block must be consecutive (t = opt.step + 1 for every block)"
            )
        xp = state.xp
        cfg = self.cfg
        b1, b2 = self.beta1, self.beta2
        p = state.flat("master", block)  # (n,) fp32 (sharded: n = the own segment)
        m = state.flat("m", block)  # (n,)
        v = state.flat("v", block)  # (n,)
        g = state.grad_segment(block)  # (n,)
        table = self.kernels or default_kernels(xp)
        if table.adamw is not None:
            self._update_fused(table, state, block, p, m, v, g, step, lr, grad_scale)
            self._block_step[block] = step
            return
        if grad_scale != 1.0:
            g *= np.float32(grad_scale)

        # Decoupled weight decay, before the Adam step: p *= 1 - lr * wd.
        if cfg.weight_decay != 0:
            keep = np.float32(1 - lr * cfg.weight_decay)
            for a, b in self.decay_ranges(state, block):
                p[a:b] *= keep

        t = state.ledger.alloc("scratch.optim", p.shape, np.float32, xp, zero=False)
        try:
            bias_correction1 = 1 - b1**step
            bias_correction2 = 1 - b2**step
            consts = (b1, b2, lr / bias_correction1, bias_correction2**0.5, cfg.eps)
            n = p.shape[0]
            if table.host and n >= _PARALLEL_MIN:
                # elementwise: two halves on two threads (numpy releases the GIL) give bitwise
                # the same result as one pass
                h = n // 2
                parts = [slice(0, h), slice(h, n)]
                list(_pool().map(lambda s: _adam_core(xp, p[s], m[s], v[s], g[s], t[s], *consts),
                                 parts))
            else:
                _adam_core(xp, p, m, v, g, t, *consts)
        finally:
            state.ledger.free(t)
        self._block_step[block] = step

    def _update_fused(self, table, state, block, p, m, v, g, step, lr, grad_scale) -> None:
        """`update_block` in one pass per range (the table's `adamw`: `fused.adamw` on the
        host, `devkernels.adamw` on a device, the same arithmetic), the ranges that decay and
        those that do not each with their factor, on the host in two halves on two threads for
        large blocks (elementwise: bitwise the same as one pass)."""
        b1, b2 = self.beta1, self.beta2
        keep = np.float32(1 - lr * self.cfg.weight_decay) if self.cfg.weight_decay else 1.0
        n = p.shape[0]
        cuts = [0, n // 2, n] if n >= _PARALLEL_MIN and table.host else [0, n]
        consts = (b1, b2, lr / (1 - b1**step), (1 - b2**step) ** 0.5, self.cfg.eps)

        decays = self.decay_ranges(state, block)

        def run(part):
            lo, hi = part
            edges = sorted({lo, hi, *(x for r in decays for x in r if lo < x < hi)})
            for a, b in zip(edges[:-1], edges[1:]):
                k = keep if any(s <= a and b <= e for s, e in decays) else 1.0
                table.adamw(p[a:b], m[a:b], v[a:b], g[a:b], grad_scale, k, *consts, state.xp)

        parts = list(zip(cuts[:-1], cuts[1:]))
        if len(parts) == 1:
            run(parts[0])
        else:
            list(_pool().map(run, parts))

    def state_dict(self) -> dict:
        """{"step": t}; raises if blocks disagree (a checkpoint in the middle of a step)."""
        steps = set(self._block_step.values()) or {self._base}
        if len(steps) != 1:
            raise RuntimeError(
                f"AdamW blocks are at different steps {sorted(steps)}: checkpoint between "
                "training steps, after every block's update"
            )
        return {"step": steps.pop()}

    def load_state_dict(self, state: dict) -> None:
        self._base = int(state["step"])
        self._block_step.clear()


# --------------------------------------------------------------------------------------------
# Dynamic loss scaling
# --------------------------------------------------------------------------------------------


_PARALLEL_MIN = 1 << 18  # elements below which one thread updates the whole range
_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(2, thread_name_prefix="ratrain-adamw")
    return _POOL


def _adam_core(xp, p, m, v, g, t, b1, b2, step_size, bias_correction2_sqrt, eps):
    """The Adam step on flat fp32 ranges, in torch's op order (`t` is scratch; `g` is used as
    scratch once m and v are updated)."""
    # m = lerp(m, g, 1 - b1), torch's two formulas on either side of weight 0.5.
    w = np.float32(1 - b1)
    xp.subtract(g, m, out=t)  # g - m
    if w < 0.5:
        t *= w
        m += t
    else:
        t *= np.float32(1) - w
        xp.subtract(g, t, out=m)
    # v = v * b2 + ((1 - b2) * g) * g
    v *= np.float32(b2)
    xp.multiply(g, np.float32(1 - b2), out=t)
    t *= g
    v += t
    # denom = sqrt(v) / sqrt(bc2) + eps
    xp.sqrt(v, out=t)
    t /= np.float32(bias_correction2_sqrt)
    t += np.float32(eps)
    # p += (-step_size * m) / denom
    xp.multiply(m, np.float32(-step_size), out=g)
    g /= t
    p += g


class LossScaler:
    """torch.amp.GradScaler's dynamic loss scale.

    The loss is multiplied by `scale` before backward (head_backward's dscale carries it);
    after backward the runtime calls `update(found_inf)` once per step with the global
    overflow flag (a non-finite global gradient norm): on overflow the scale is multiplied by
    `backoff` (0.5) and the step must be skipped; after `window` consecutive clean steps it is
    multiplied by `growth` (2.0) unless that overflows fp32. Disabled (fp32 training), the scale
    stays 1.0; `update` still returns True on a non-finite gradient so the masters are never
    poisoned.
    """

    def __init__(
        self,
        init_scale: float = 65536.0,
        window: int = 2000,
        enabled: bool = True,
        growth: float = 2.0,
        backoff: float = 0.5,
    ):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.window = int(window)
        self.growth = float(growth)
        self.backoff = float(backoff)
        self.growth_tracker = 0  # consecutive clean steps since the last change
        self.skipped = 0  # steps skipped so far

    @classmethod
    def from_config(cls, cfg: OptimConfig, precision: str) -> LossScaler:
        """Enabled for fp16, disabled (scale 1.0) for fp32."""
        return cls(cfg.loss_scale_init, cfg.loss_scale_window, enabled=precision == "fp16")

    @property
    def inv_scale(self) -> float:
        """1 / scale in fp32, as GradScaler.unscale_ computes it."""
        return float(np.float32(1.0 / self.scale))

    def update(self, found_inf: bool) -> bool:
        """Record this step's overflow flag; return True when the step must be skipped."""
        if found_inf:
            self.skipped += 1
        if not self.enabled:
            return bool(found_inf)
        if found_inf:
            self.scale = float(np.float32(self.scale * self.backoff))
            self.growth_tracker = 0
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            grown = self.scale * self.growth
            if grown <= _FP32_MAX:
                self.scale = float(np.float32(grown))
            self.growth_tracker = 0
        return False

    def state_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "window": self.window,
            "growth": self.growth,
            "backoff": self.backoff,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.enabled = bool(state["enabled"])
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.window = int(state.get("window", self.window))
        self.growth = float(state.get("growth", self.growth))
        self.backoff = float(state.get("backoff", self.backoff))
        self.skipped = int(state.get("skipped", 0))


__all__ = [
    "ADAMW_BYTES_PER_PARAM",
    "AdamW",
    "LossScaler",
    "clip_coef",
    "decays",
    "global_grad_norm",
    "grad_scale_for",
    "lr_at",
    "lr_factor",
]
