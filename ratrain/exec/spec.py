"""What the model is made of: blocks, their parameters, and how blocks are split into stages.

A model is a sequence of blocks: `embed`, `layers.0` ... `layers.{L-1}`, `head` (final RMSNorm,
LM head and the loss). A pipeline stage owns a contiguous run of blocks; stage 0 always holds
`embed`, the last stage always holds `head`. Every per-layer lifecycle action (sync a layer's
gradient, update it, materialise its view, drop or recompute its activations) is about one block.

Parameter names are global and independent of the stage split (`layers.7.attn.wq`), so
initialisation, checkpoints and Hugging Face import/export do not depend on the layout.
Weights use the Hugging Face layout (out_features, in_features): y = x @ W.T.

The flops of a block (`block_flops`) are written here once: the stage split balances them, the
shim's compute pacing pads each block to them, and the planner's cost model prices them.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, replace

import numpy as np

from ratrain.config import ModelConfig

INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range default
ROLES = ("embed", "layer", "head")  # what a block does in the model
PHASES = ("forward", "backward")
RECOMPUTE = ("none", "selective", "full")  # what a layer's backward recomputes (schedule.recompute)
# A layer's recovery is a recompute mode, or `offload`: it keeps everything (as `none`), but in the
# memory tier between its forward and its backward (`lifecycle.passes.offload`).
OFFLOAD = "offload"


def kernel_recompute(choice: str) -> str:
    """What the kernels re-run for a recovery choice (an offloaded layer keeps everything)."""
    return "none" if choice == OFFLOAD else choice



@dataclass(frozen=True)
class ParamSpec:
    name: str  # global name, e.g. "layers.3.attn.wq"
    local: str  # name inside its block, e.g. "attn.wq"
    shape: tuple[int, ...]
    init: str  # "normal" | "ones"
    hf_name: str  # the Hugging Face LlamaForCausalLM state-dict name
    decay: bool = True  # subject to weight decay unless optim.no_decay exempts it

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class BlockSpec:
    name: str  # "embed" | "layers.{i}" | "head"
    role: str  # "embed" | "layer" | "head"
    index: int  # layer index for role == "layer", else -1
    params: tuple[ParamSpec, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.params)


def model_blocks(m: ModelConfig) -> list[BlockSpec]:
    """Every block of the model, in order."""
    h, f, v = m.hidden, m.ffn_hidden, m.vocab_size
    kv = m.kv_heads * m.head_dim

    def block(name, role, index, entries):
        return BlockSpec(
            name,
            role,
            index,
            tuple(
                ParamSpec(f"{name}.{local}", local, shape, init, hf)
                for local, shape, init, hf in entries
            ),
        )

    blocks = [block("embed", "embed", -1, [("weight", (v, h), "normal", "model.embed_tokens.weight")])]
    for i in range(m.layers):
        hf = f"model.layers.{i}"
        blocks.append(
            block(
                f"layers.{i}",
                "layer",
                i,
                [
                    ("attn_norm", (h,), "ones", f"{hf}.input_layernorm.weight"),
                    ("attn.wq", (h, h), "normal", f"{hf}.self_attn.q_proj.weight"),
                    ("attn.wk", (kv, h), "normal", f"{hf}.self_attn.k_proj.weight"),
                    ("attn.wv", (kv, h), "normal", f"{hf}.self_attn.v_proj.weight"),
                    ("attn.wo", (h, h), "normal", f"{hf}.self_attn.o_proj.weight"),
                    ("mlp_norm", (h,), "ones", f"{hf}.post_attention_layernorm.weight"),
                    ("mlp.w_gate", (f, h), "normal", f"{hf}.mlp.gate_proj.weight"),
                    ("mlp.w_up", (f, h), "normal", f"{hf}.mlp.up_proj.weight"),
                    ("mlp.w_down", (h, f), "normal", f"{hf}.mlp.down_proj.weight"),
                ],
            )
        )
    head = [("norm", (h,), "ones", "model.norm.weight")]
    if not m.tie_embeddings:
        head.append(("weight", (v, h), "normal", "lm_head.weight"))
    blocks.append(block("head", "head", -1, head))
    return blocks


def init_param(p: ParamSpec, seed: int) -> np.ndarray:
    """Deterministic fp32 initial value of one parameter, from (seed, name) alone."""
    if p.init == "ones":
        return np.ones(p.shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(p.name.encode())])
    return (rng.standard_normal(p.shape, dtype=np.float32) * np.float32(INIT_STD)).astype(np.float32)


def block_role(name: str) -> str:
    """`embed` / `layers.7` / `head` -> "embed" / "layer" / "head"."""
    return "layer" if name.startswith("layers.") else name


@functools.lru_cache(maxsize=256)
def block_params(m: ModelConfig, role: str) -> int:
    """Parameters of one block of `role` ("embed" | "layer" | "head") of model `m`."""
    for b in model_blocks(replace(m, layers=1)):
        if b.role == role:
            return b.size
    raise ValueError(f"unknown block role {role!r}; roles are {', '.join(ROLES)}")


def block_flops_per_token(m: ModelConfig, role: str) -> float:
    """Training flops (forward + backward) per token of one block: 6 per matmul parameter, plus
    causal attention's QK^T and PV (the layers' share of `ModelConfig.flops_per_token`)."""
    h, f, v = m.hidden, m.ffn_hidden, m.vocab_size
    kv = m.kv_heads * m.head_dim
    if role == "layer":
        return 6.0 * (2 * h * h + 2 * h * kv + 3 * h * f) + 6.0 * m.seq_len * h
    if role == "head":
        return 6.0 * v * h
    return 2.0 * h  # the embedding is a gather


def recompute_flops(m: ModelConfig, role: str, tokens: int, recompute: str = "none") -> float:
    """Extra flops a layer's backward spends re-running what its forward did not keep: the whole
    forward (`full`), or the attention core's (`selective`: QK^T and PV, causal half)."""
    if role != "layer" or recompute == "none":
        return 0.0
    if recompute == "full":
        return block_flops_per_token(m, role) * tokens / 3.0
    if recompute == "selective":
        return 2.0 * m.seq_len * m.hidden * tokens
    raise ValueError(f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE)}")


def block_flops(m: ModelConfig, role: str, tokens: int, phase: str,
                recompute: str = "none") -> float:
    """Flops of one block's `phase` over `tokens` tokens: the forward is a third of the training
    flops, the backward two thirds plus the recomputation `recompute` implies."""
    train = block_flops_per_token(m, role) * tokens
    if phase == "forward":
        return train / 3.0
    if phase == "backward":
        return 2.0 * train / 3.0 + recompute_flops(m, role, tokens, recompute)
    raise ValueError(f"phase={phase!r} is not one of {', '.join(PHASES)}")


def stage_layers(m: ModelConfig, pp: int, layers_per_stage=None) -> list[range]:
    """Contiguous layer ranges per stage, minimising the costliest stage (embed on the first
    stage, head on the last); `layers_per_stage` overrides."""
    if layers_per_stage is not None:
        bounds = np.cumsum([0, *layers_per_stage])
        return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    return list(_balanced_layers(m, pp))


@functools.lru_cache(maxsize=256)
def _balanced_layers(m: ModelConfig, pp: int) -> tuple[range, ...]:
    """`stage_layers` without an override (O(pp x layers^2): the planner asks for every stage
    of hundreds of layouts, so it is kept)."""
    L = m.layers
    layer = block_flops_per_token(m, "layer")
    extra = [0.0] * pp
    extra[0] += block_flops_per_token(m, "embed")
    extra[-1] += block_flops_per_token(m, "head")
    # best[s][i]: minimal max-cost splitting layers[:i] into stages[:s+1], each non-empty
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(pp)]
    cut = [[0] * (L + 1) for _ in range(pp)]
    for i in range(1, L + 1):
        best[0][i] = extra[0] + i * layer
    for s in range(1, pp):
        for i in range(s + 1, L + 1):
            for j in range(s, i):  # stage s takes layers j..i-1
                c = max(best[s - 1][j], extra[s] + (i - j) * layer)
                if c < best[s][i] - 1e-9:
                    best[s][i], cut[s][i] = c, j
    ranges, i = [], L
    for s in range(pp - 1, 0, -1):
        j = cut[s][i]
        ranges.append(range(j, i))
        i = j
    ranges.append(range(0, i))
    return tuple(ranges[::-1])


def stage_blocks(m: ModelConfig, pp: int, stage: int, layers_per_stage=None) -> list[BlockSpec]:
    """The blocks stage `stage` of `pp` owns, in order."""
    blocks = model_blocks(m)
    layers = stage_layers(m, pp, layers_per_stage)[stage]
    out = []
    if stage == 0:
        out.append(blocks[0])
    out.extend(blocks[1 + i] for i in layers)
    if stage == pp - 1:
        out.append(blocks[-1])
    return out


__all__ = [
    "BlockSpec",
    "INIT_STD",
    "PHASES",
    "OFFLOAD",
    "RECOMPUTE",
    "ROLES",
    "ParamSpec",
    "block_flops",
    "block_flops_per_token",
    "block_params",
    "block_role",
    "init_param",
    "model_blocks",
    "recompute_flops",
    "stage_blocks",
    "stage_layers",
    "kernel_recompute",
]
