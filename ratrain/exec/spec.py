"""What the model is made of: blocks, their parameters, and how blocks are split into stages.

A model is a sequence of blocks: `embed`, `layers.0` ... `layers.{L-1}`, `head` (final RMSNorm,
LM head and the loss). A pipeline stage owns a contiguous run of blocks; stage 0 always holds
`embed`, the last stage always holds `head`. Every per-layer lifecycle action (sync a layer's
gradient, update it, materialise its view, drop or recompute its activations) is about one block.

Parameter names are global and independent of the stage split (`layers.7.attn.wq`), so
initialisation, checkpoints and Hugging Face import/export do not depend on the layout.
Weights use the Hugging Face layout (out_features, in_features): y = x @ W.T.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ratrain.config import ModelConfig

INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range default


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
    kind: str  # "embed" | "layer" | "head"
    index: int  # layer index for kind == "layer", else -1
    params: tuple[ParamSpec, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.params)


def model_blocks(m: ModelConfig) -> list[BlockSpec]:
    """Every block of the model, in order."""
    h, f, v = m.hidden, m.ffn_hidden, m.vocab_size
    kv = m.kv_heads * m.head_dim

    def block(name, kind, index, entries):
        return BlockSpec(
            name,
            kind,
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


def block_cost(m: ModelConfig, kind: str) -> float:
    """Relative training cost of a block (flops per token), for balancing stages."""
    h, f, v = m.hidden, m.ffn_hidden, m.vocab_size
    kv = m.kv_heads * m.head_dim
    if kind == "layer":
        return 6.0 * (2 * h * h + 2 * h * kv + 3 * h * f) + 6.0 * m.seq_len * h
    if kind == "head":
        return 6.0 * v * h
    return 2.0 * h  # the embedding is a gather


def stage_layers(m: ModelConfig, pp: int, layers_per_stage=None) -> list[range]:
    """Contiguous layer ranges per stage, minimising the costliest stage (embed on the first
    stage, head on the last); `layers_per_stage` overrides."""
    if layers_per_stage is not None:
        bounds = np.cumsum([0, *layers_per_stage])
        return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    L = m.layers
    layer = block_cost(m, "layer")
    extra = [0.0] * pp
    extra[0] += block_cost(m, "embed")
    extra[-1] += block_cost(m, "head")
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
    return ranges[::-1]


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
    "ParamSpec",
    "block_cost",
    "init_param",
    "model_blocks",
    "stage_blocks",
    "stage_layers",
]
