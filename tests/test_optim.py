"""AdamW, clipping, LR schedule and loss scaling: against torch where torch defines them."""

import copy
import math

import numpy as np
import pytest

from ratrain.config import ModelConfig, OptimConfig
from ratrain.exec import fused
from ratrain.exec.backends import kernel_table
from ratrain.exec.kernels import block_sq_norm
from ratrain.exec.optim import (
    AdamW,
    LossScaler,
    clip_coef,
    decays,
    global_grad_norm,
    grad_scale_for,
    lr_at,
    lr_factor,
)
from ratrain.exec.params import StageState
from ratrain.exec.spec import model_blocks
from ratrain.shim.ledger import Ledger
from tests._prereq import need

M = ModelConfig(vocab_size=40, hidden=16, layers=2, heads=4, kv_heads=2, ffn_hidden=24, seq_len=8)


def make_state(seed=3, precision="fp32"):
    return StageState(model_blocks(M), precision, Ledger(), seed=seed)


def random_grads(state, rng, scale=1.0):
    """{global name: fp32 gradient} with a spread of magnitudes."""
    out = {}
    for name in state.names:
        shape = state.spec(name).shape
        out[name] = (rng.standard_normal(shape) * scale * rng.uniform(0.1, 3)).astype(np.float32)
    return out


def ours_step(state, opt, grads, t, lr, max_norm, loss_scale=1.0):
    """One training step of the runtime's protocol; returns the global norm."""
    partials = []
    for b in state.block_names:
        g = state.alloc_grad(b)
        for local, arr in state.grad(b).items():
            arr[...] = grads[f"{b}.{local}"] * np.float32(loss_scale)
        partials.append(block_sq_norm(g))
    norm = global_grad_norm(partials, loss_scale)
    gs = grad_scale_for(norm, max_norm, loss_scale)
    for b in state.block_names:
        opt.update_block(state, b, t, lr, gs)
        state.free_grad(b)
    return norm


# --------------------------------------------------------------------------------------------
# without torch
# --------------------------------------------------------------------------------------------


def test_lr_schedule_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, lr_schedule="cosine", min_lr=0.1, decay_steps=10)
    assert [lr_at(s, cfg, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 100) == 1.0
    assert lr_at(9, cfg, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg, 100) == pytest.approx(0.1)
    assert lr_at(50, cfg, 100) == pytest.approx(0.1)
    # decay_steps = 0: decay over the rest of the run
    cfg0 = OptimConfig(lr=2.0, warmup_steps=0, lr_schedule="cosine", min_lr=0.0)
    assert lr_at(0, cfg0, 10) == 2.0
    assert lr_at(5, cfg0, 10) == pytest.approx(1.0)
    assert lr_at(10, cfg0, 10) == pytest.approx(0.0, abs=1e-15)
    const = OptimConfig(lr=0.5, warmup_steps=2, lr_schedule="constant")
    assert [lr_at(s, const, 10) for s in range(4)] == [0.25, 0.5, 0.5, 0.5]
    # no room to decay: constant after warm-up
    assert lr_factor(7, OptimConfig(warmup_steps=8), 8) == 1.0
    assert lr_factor(8, OptimConfig(warmup_steps=8), 8) == 1.0


def test_clip_coef_and_norm():
    g = np.random.default_rng(0).standard_normal(200_003).astype(np.float32)
    s = block_sq_norm(g)
    assert s == pytest.approx(float(np.sum(g.astype(np.float64) ** 2)), rel=1e-14)
    assert block_sq_norm(g) == s  # deterministic
    assert global_grad_norm([s], 1.0) == pytest.approx(math.sqrt(s))
    assert global_grad_norm([s * 1024.0**2], 1024.0) == pytest.approx(math.sqrt(s), rel=1e-15)
    assert clip_coef(10.0, 1.0) == float(np.float32(1.0) / (np.float32(10.0) + np.float32(1e-6)))
    assert clip_coef(0.5, 1.0) == 1.0
    assert clip_coef(10.0, 0.0) == 1.0  # disabled
    assert grad_scale_for(10.0, 1.0, 8.0) == pytest.approx(clip_coef(10.0, 1.0) / 8)
    bad = g.copy()
    bad[7] = np.inf
    assert not math.isfinite(block_sq_norm(bad))
    bad[7] = np.nan
    assert math.isnan(block_sq_norm(bad))


def test_weight_decay_exemptions():
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, no_decay=("*norm*", "embed.*"))
    assert not decays("layers.0.attn_norm", cfg) and not decays("head.norm", cfg)
    assert not decays("embed.weight", cfg) and decays("layers.1.mlp.w_up", cfg)
    st = make_state()
    before = {n: a.copy() for n, a in st.named_master()}
    opt = AdamW(cfg)
    for b in st.block_names:  # zero gradient: the Adam step is 0, only decay acts
        st.alloc_grad(b)
        opt.update_block(st, b, 1, cfg.lr)
        st.free_grad(b)
    keep = np.float32(1 - 0.1 * 0.5)
    for name, arr in st.named_master():
        expect = before[name] * keep if decays(name, cfg) else before[name]
        np.testing.assert_array_equal(arr, expect, err_msg=name)


def test_update_needs_consecutive_steps_and_state_dict_resumes_bitwise():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0)
    rng = np.random.default_rng(1)
    grads = [random_grads(make_state(), rng) for _ in range(6)]
    a, opt_a = make_state(), AdamW(cfg)
    for t in range(1, 4):
        ours_step(a, opt_a, grads[t - 1], t, cfg.lr, cfg.grad_clip)
    assert opt_a.step == 3
    with pytest.raises(RuntimeError, match="consecutive"):
        a.alloc_grad("embed")
        opt_a.update_block(a, "embed", 5, cfg.lr)
    a.free_grad("embed")
    saved = copy.deepcopy({k: {n: np.array(v) for n, v in d.items()} for k, d in a.state_dict().items()})
    saved_opt = opt_a.state_dict()
    for t in range(4, 7):
        ours_step(a, opt_a, grads[t - 1], t, cfg.lr, cfg.grad_clip)
    b, opt_b = make_state(seed=99), AdamW(cfg)
    b.load_state_dict(saved)
    opt_b.load_state_dict(saved_opt)
    for t in range(opt_b.step + 1, 7):
        ours_step(b, opt_b, grads[t - 1], t, cfg.lr, cfg.grad_clip)
    for kind in ("master", "m", "v"):
        np.testing.assert_array_equal(a.buffer(kind), b.buffer(kind))


def test_update_holds_no_memory_after_the_call():
    st = make_state()
    led = st.ledger
    st.alloc_grad("layers.0")[...] = 1.0
    before = led.current
    # the numpy reference: one fp32 scratch block, released
    AdamW(OptimConfig(), kernel_table(fused_mode="off")).update_block(st, "layers.0", 1, 1e-3)
    assert led.current == before and "scratch.optim" not in led.by_tag()
    assert led.peak_by_tag()["scratch.optim"] == 4 * st.block("layers.0").size
    if fused.available():  # the fused pass needs none
        st2 = make_state()
        st2.alloc_grad("layers.0")[...] = 1.0
        AdamW(OptimConfig()).update_block(st2, "layers.0", 1, 1e-3)
        assert "scratch.optim" not in st2.ledger.peak_by_tag()


def test_loss_scaler_semantics():
    s = LossScaler(init_scale=8.0, window=3)
    skips = [s.update(f) for f in (False, False, True, False, False, False, False)]
    assert skips == [False, False, True, False, False, False, False]
    assert s.scale == 8.0  # 8 -> 4 (inf) -> 8 after 3 clean steps
    assert s.growth_tracker == 1 and s.skipped == 1
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    off = LossScaler.from_config(OptimConfig(), "fp32")
    assert off.scale == 1.0 and off.update(True) and off.scale == 1.0
    on = LossScaler.from_config(OptimConfig(loss_scale_init=1024.0), "fp16")
    assert on.scale == 1024.0 and on.inv_scale == 1 / 1024
    big = LossScaler(init_scale=2.0**127, window=1)
    big.update(False)
    assert big.scale == 2.0**127  # growth would overflow fp32: kept


# --------------------------------------------------------------------------------------------
# against torch
# --------------------------------------------------------------------------------------------


def torch_run(state0, grads_per_step, cfg, total_steps, loss_scale=1.0):
    """torch.optim.AdamW + clip_grad_norm_ + LambdaLR over the same parameters and grads."""
    torch = need("torch")
    params = {n: torch.nn.Parameter(torch.tensor(np.array(a))) for n, a in state0.named_master()}
    decay = [p for n, p in params.items() if decays(n, cfg)]
    nodecay = [p for n, p in params.items() if not decays(n, cfg)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if nodecay:
        groups.append({"params": nodecay, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
    norms = []
    for grads in grads_per_step:
        for n, p in params.items():
            p.grad = torch.tensor(grads[n] * np.float32(loss_scale))
            if loss_scale != 1.0:  # GradScaler.unscale_
                p.grad.mul_(torch.tensor(1.0 / loss_scale, dtype=torch.float64).float())
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.grad_clip)))
        opt.step()
        sched.step()
    return {n: p.detach().numpy() for n, p in params.items()}, norms


@pytest.mark.torch
@pytest.mark.parametrize(
    "betas,loss_scale,no_decay",
    [((0.9, 0.95), 1.0, ("*norm*",)), ((0.3, 0.999), 1024.0, ())],
)
def test_adamw_matches_torch(betas, loss_scale, no_decay):
    need("torch")
    steps = 60
    cfg = OptimConfig(lr=3e-3, betas=betas, eps=1e-8, weight_decay=0.1, grad_clip=1.0,
                      warmup_steps=5, lr_schedule="cosine", min_lr=3e-4, no_decay=no_decay)
    rng = np.random.default_rng(7)
    st = make_state()
    # grad norms well above and below the clip threshold
    grads = [random_grads(st, rng, scale=10.0 ** rng.uniform(-3, -1)) for _ in range(steps)]
    ref, ref_norms = torch_run(st, grads, cfg, steps, loss_scale)
    opt = AdamW(cfg)
    clipped = 0
    for s, g in enumerate(grads):
        norm = ours_step(st, opt, g, s + 1, lr_at(s, cfg, steps), cfg.grad_clip, loss_scale)
        assert norm == pytest.approx(ref_norms[s], rel=2e-6)
        clipped += norm > cfg.grad_clip
    assert 0 < clipped < steps
    for name, arr in st.named_master():
        scale = float(np.abs(ref[name]).max())
        err = float(np.abs(arr - ref[name]).max())
        # round-off only: about 1e-7 relative per step (see optim.py on torch's sqrt and FMA)
        assert err <= 2e-6 * scale, (name, err, scale)


@pytest.mark.torch
def test_one_adamw_step_is_round_off_from_torch():
    torch = need("torch")
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    st = make_state()
    rng = np.random.default_rng(3)
    g = random_grads(st, rng)
    p = {n: torch.nn.Parameter(torch.tensor(np.array(a))) for n, a in st.named_master()}
    opt = torch.optim.AdamW(list(p.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    for n, t in p.items():
        t.grad = torch.tensor(g[n])
    opt.step()
    ours_step(st, AdamW(cfg), g, 1, cfg.lr, 0.0)
    equal = total = 0
    for name, arr in st.named_master():
        ref = p[name].detach().numpy()
        # the step is about lr in size: the result is within an ulp or two of that step
        err = np.abs(arr - ref)
        assert (err <= 2.5e-7 * (np.abs(ref) + cfg.lr)).all(), name
        equal += int((err == 0).sum())
        total += err.size
    assert equal > 0.5 * total  # most elements are bitwise equal


@pytest.mark.torch
def test_loss_scaler_matches_grad_scaler():
    torch = need("torch")
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.0)
    ts = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
    ours = LossScaler(init_scale=16.0, window=2)
    pattern = [False, True, False, False, False, True, True, False, False]
    for bad in pattern:
        ts.scale(torch.ones(()))
        w.grad = torch.full((4,), float("inf") if bad else 1.0)
        before = w.detach().clone()
        opt.param_groups[0]["lr"] = 1.0
        ts.step(opt)
        stepped = not torch.equal(before, w.detach())
        ts.update()
        assert ours.update(bad) == (not stepped)
        assert ours.scale == ts.get_scale()


def test_parallel_adam_halves_equal_one_pass():
    """The two-thread split of a large update is bitwise the single-pass update."""
    from ratrain.exec import optim as O

    n = O._PARALLEL_MIN + 12345
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(4)]
    v0 = np.abs(arrays[2])
    one = [a.copy() for a in (arrays[0], arrays[1], v0, arrays[3])]
    two = [a.copy() for a in one]
    consts = (0.9, 0.95, 1e-3 / 0.1, 0.05**0.5, 1e-8)
    O._adam_core(np, *one, np.empty(n, np.float32), *consts)
    h = n // 2
    t = np.empty(n, np.float32)
    for s in (slice(0, h), slice(h, n)):
        O._pool().submit(O._adam_core, np, *(a[s] for a in two), t[s], *consts).result()
    for a, b in zip(one, two):
        assert np.array_equal(a, b)
