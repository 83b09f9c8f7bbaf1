"""The Hugging Face LLaMA format, once for both directions: file names, the config.json key map,
LlamaConfig's defaults and the dtype table.

    KEYS["hidden_size"] == "hidden"          # config.json key -> ModelConfig field
    DTYPES["bf16"] == ("BF16", "<u2", "bfloat16")  # ratrain dtype -> safetensors code, stored
                                               # numpy dtype, torch dtype name
    READABLE["BF16"]                           # safetensors code -> stored numpy dtype (read)
"""

from __future__ import annotations

import numpy as np

from ratrain.config import ConfigError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"

# config.json key -> ModelConfig field, read and written alike (rope_theta, head_dim and
# max_position_embeddings are handled on their own: each has more than one spelling or source)
KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "intermediate_size": "ffn_hidden",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
# LlamaConfig's defaults, for keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
            "max_position_embeddings": 2048}
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some 4.x checkpoints carry

# ratrain dtype (`export --dtype`) -> (safetensors code, stored numpy dtype, torch dtype name);
# bf16 is stored as its 16 bits (uint16: numpy has no bfloat16)
DTYPES = {"fp32": ("F32", "<f4", "float32"), "fp16": ("F16", "<f2", "float16"),
          "bf16": ("BF16", "<u2", "bfloat16")}
# safetensors code -> stored numpy dtype, for reading: every written code, and F64 (rounded)
READABLE = {**{code: np.dtype(st) for code, st, _ in DTYPES.values()}, "F64": np.dtype("<f8")}


class HFError(ConfigError):
    """A Hugging Face directory that cannot be imported: names the file, tensor and problem."""


__all__ = ["CONFIG", "DEFAULTS", "DTYPES", "GENERATION", "IGNORED_TENSOR_SUFFIXES", "INDEX",
           "KEYS", "READABLE", "SINGLE", "HFError"]
