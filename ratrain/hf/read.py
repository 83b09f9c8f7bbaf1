"""Reading a Hugging Face LLaMA directory (`init.from_hf`); writing one is `hf.write`.

A Hugging Face directory holds `config.json` and either `model.safetensors` or sharded
`model-0000x-of-0000y.safetensors` files with `model.safetensors.index.json` (as
`save_pretrained` writes them; a single file is preferred when both are present, as
transformers does). Tensors are mapped by name through `ParamSpec.hf_name`; both sides use the
(out_features, in_features) layout, so no transposes or permutations are involved.

Import:

    values = hf_model_config(dir)              # {"vocab_size": ..., "hidden": ..., ...}
    model = resolve_model_config(cfg.model, dir)  # cfg.model with config.json's architecture
    params = load_hf_params(dir, model, names=state.names)   # only this stage's tensors

Safetensors files are parsed here (an 8-byte header length, a JSON header, raw little-endian
data), so each rank reads only the byte ranges of the tensors it needs, and every dtype works:
F32 as is, F16 and BF16 widened exactly to fp32 (BF16 by shifting its 16 bits into the high
half of a float32), F64 rounded to fp32. Any mismatch (a missing or unexpected tensor, a wrong
shape, an unsupported dtype, an architecture other than LlamaForCausalLM) is an `HFError`
naming the tensor and the file.

`load_hf_params` of a directory `ratrain.export` wrote returns the exported arrays bitwise
(fp32 exports; fp16 and bf16 ones give their rounded values exactly).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from ratrain.config import ConfigError, ModelConfig
from ratrain.exec.spec import model_blocks
from ratrain.hf.format import (
    CONFIG,
    DEFAULTS,
    IGNORED_TENSOR_SUFFIXES,
    INDEX,
    KEYS,
    READABLE,
    SINGLE,
    HFError,
)

# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict:
    """The parsed config.json of a Hugging Face directory (HFError if absent or invalid)."""
    path = os.path.join(hf_dir, CONFIG)
    if not os.path.isdir(hf_dir):
        raise HFError(f"init.from_hf={hf_dir!r}: not a directory")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise HFError(f"{path}: missing: a Hugging Face model directory needs config.json") from None
    except json.JSONDecodeError as e:
        raise HFError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path}: the top level must be a JSON object")
    return cfg


def _rope_theta(cfg: dict, path: str) -> float:
    """rope_theta from transformers 5.x `rope_parameters` or 4.x top level; rejects scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and "rope_type" not in params:
        params = params["full_attention"]  # per-layer-type form
    theta = None
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise HFError(
                f"{path}: rope_parameters.rope_type={rope_type!r} is not supported: ratrain "
                "implements plain RoPE (rope_type default) only"
            )
        theta = params.get("rope_theta")
    elif params is not None:
        raise HFError(f"{path}: rope_parameters={params!r} must be an object")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        scaling_type = (scaling.get("rope_type", scaling.get("type"))
                        if isinstance(scaling, dict) else scaling)
        if scaling_type not in (None, "default"):
            raise HFError(
                f"{path}: rope_scaling={scaling!r} is not supported: ratrain implements plain "
                "RoPE only (rope_scaling null or default)"
            )
    if theta is None:
        theta = cfg.get("rope_theta", DEFAULTS["rope_theta"])
    return float(theta)


def hf_model_config(hf_dir: str) -> dict:
    """The `model` section values config.json determines (every ModelConfig field but
    seq_len), after checking the architecture is one ratrain implements."""
    cfg = read_hf_config(hf_dir)
    path = os.path.join(hf_dir, CONFIG)
    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise HFError(
            f"{path}: model_type={model_type!r} is not supported: ratrain imports LLaMA "
            "checkpoints (model_type llama, LlamaForCausalLM)"
        )
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise HFError(
            f"{path}: architectures={archs} is not supported: ratrain imports "
            "LlamaForCausalLM checkpoints"
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise HFError(f"{path}: {key}=true is not supported: ratrain's LLaMA has no biases")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"{path}: hidden_act={act!r} is not supported: ratrain's MLP is SwiGLU (silu)")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
            raise HFError(f"{path}: {key}={cfg.get(key)!r} must be an integer")
    values = {}
    for key, field in KEYS.items():
        if key == "num_key_value_heads":
            v = cfg.get(key) or cfg["num_attention_heads"]
        elif key in DEFAULTS:
            v = cfg.get(key, DEFAULTS[key])
        else:
            v = cfg[key]
        values[field] = v
    values["norm_eps"] = float(values["norm_eps"])
    values["tie_embeddings"] = bool(values["tie_embeddings"])
    values["rope_theta"] = _rope_theta(cfg, path)
    values["max_positions"] = int(cfg.get("max_position_embeddings",
                                          DEFAULTS["max_position_embeddings"]))
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * values["heads"] != values["hidden"]:
        raise HFError(
            f"{path}: head_dim={head_dim} with num_attention_heads={values['heads']} and "
            f"hidden_size={values['hidden']}: ratrain needs head_dim = hidden_size / heads"
        )
    return values


def import_model_section(cfg, hf_dir: str, overrides=()):
    """`cfg` (a Config) with its model section from `hf_dir`'s config.json (seq_len kept).

    A `--set model.KEY=...` among `overrides` that contradicts config.json is an HFError naming
    both values (the imported architecture is fixed); the job file's model section is replaced
    (it usually describes another model)."""
    values = hf_model_config(hf_dir)
    path = os.path.join(hf_dir, CONFIG)
    for ov in overrides:
        key = ov.split("=", 1)[0].strip()
        name = key[len("model."):]
        if key.startswith("model.") and name in values and getattr(cfg.model, name) != values[name]:
            raise HFError(
                f"--set {key}={getattr(cfg.model, name)!r} contradicts init.from_hf={hf_dir!r}, "
                f"whose {path} gives {name}={values[name]!r}: drop the --set (the imported "
                "model's architecture comes from its config.json; only model.seq_len is yours)"
            )
    model = resolve_model_config(cfg.model, hf_dir)
    return replace(cfg, model=model)


def hf_max_positions(hf_dir: str) -> int:
    """config.json's max_position_embeddings (the longest seq_len the model supports)."""
    cfg = read_hf_config(hf_dir)
    return int(cfg.get("max_position_embeddings", DEFAULTS["max_position_embeddings"]))


def resolve_model_config(model: ModelConfig, hf_dir: str) -> ModelConfig:
    """`model` with every field config.json determines replaced (seq_len is kept from our
    config and must not exceed max_position_embeddings, which becomes max_positions);
    validated."""
    values = hf_model_config(hf_dir)
    _check_seq_len(model.seq_len, hf_dir)
    resolved = replace(model, **values)
    try:
        resolved.check()
    except ConfigError as e:
        raise HFError(f"{os.path.join(hf_dir, CONFIG)}: {e}") from None
    return resolved


def _check_seq_len(seq_len: int, hf_dir: str) -> None:
    max_pos = hf_max_positions(hf_dir)
    if seq_len > max_pos:
        raise HFError(
            f"model.seq_len={seq_len} exceeds max_position_embeddings={max_pos} of "
            f"{os.path.join(hf_dir, CONFIG)}: lower model.seq_len to at most {max_pos}"
        )


def check_model_matches(model: ModelConfig, hf_dir: str) -> None:
    """Raise HFError unless `model` agrees with config.json on every field it determines."""
    values = hf_model_config(hf_dir)
    values.pop("max_positions")  # not the architecture: seq_len is checked against it below
    bad = [f"model.{k}={getattr(model, k)!r} but config.json says {v!r}"
           for k, v in values.items() if getattr(model, k) != v]
    if bad:
        raise HFError(
            f"{os.path.join(hf_dir, CONFIG)}: the model config does not match the checkpoint: "
            + "; ".join(bad) + " (take the model section from config.json: resolve_model_config)"
        )
    _check_seq_len(model.seq_len, hf_dir)


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """({tensor name: {dtype, shape, data_offsets}}, byte offset of the data) of one file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise HFError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise HFError(f"{path}: corrupt safetensors header length {n} (file {size} B)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise HFError(f"{path}: missing safetensors file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    for name, meta in header.items():
        try:
            end = int(meta["data_offsets"][1])
        except (KeyError, TypeError, IndexError, ValueError):
            raise HFError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if 8 + n + end > size:
            raise HFError(
                f"{path}: truncated: tensor {name!r} runs past the end of the file "
                f"({size} B; needs {8 + n + end} B)"
            )
    return header, 8 + n


def _read_tensor(f, path: str, name: str, meta: dict, data_start: int) -> np.ndarray:
    """One tensor of an open safetensors file as a new fp32 array."""
    dtype = READABLE.get(meta["dtype"])
    if dtype is None:
        raise HFError(
            f"{path}: tensor {name!r} has dtype {meta['dtype']}; supported: {', '.join(READABLE)}"
        )
    a, b = meta["data_offsets"]
    shape = tuple(meta["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if b - a != count * dtype.itemsize:
        raise HFError(f"{path}: tensor {name!r} has {b - a} bytes for shape {shape}")
    f.seek(data_start + a)
    raw = f.read(b - a)
    if len(raw) != b - a:
        raise HFError(f"{path}: truncated: tensor {name!r} runs past the end of the file")
    arr = np.frombuffer(raw, dtype).reshape(shape)
    if meta["dtype"] == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)  # exact widening
    return arr.astype(np.float32)  # F32: a copy (owned, writable); F16 exact; F64 rounded


def _weight_files(hf_dir: str) -> dict[str, str]:
    """{tensor name: file path} of a directory's weights (single file or sharded index)."""
    single = os.path.join(hf_dir, SINGLE)
    if os.path.exists(single):
        header, _ = read_safetensors_header(single)
        return dict.fromkeys(header, single)
    index = os.path.join(hf_dir, INDEX)
    if not os.path.exists(index):
        others = [f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth", ".h5"))]
        hint = f" (found {', '.join(sorted(others))}: convert them to safetensors)" if others else ""
        raise HFError(f"{hf_dir}: no {SINGLE} and no {INDEX}{hint}")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFError(f"{index}: not a safetensors index (needs weight_map): {e}") from None
    return {name: os.path.join(hf_dir, fname) for name, fname in weight_map.items()}


def expected_tensors(model: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{hf name: (global name, shape)} of every parameter of the model."""
    return {p.hf_name: (p.name, p.shape) for b in model_blocks(model) for p in b.params}


def _inventory(hf_dir: str, model: ModelConfig):
    """Check a directory against `model` from config.json and the safetensors headers only;
    return ({hf name: (global name, shape)}, {hf name: file}, {file: (header, data start)})."""
    check_model_matches(model, hf_dir)
    expected = expected_tensors(model)
    location = _weight_files(hf_dir)
    headers: dict[str, tuple[dict, int]] = {}
    for path in sorted(set(location.values())):
        headers[path] = read_safetensors_header(path)
    for hf_name, path in location.items():
        if hf_name not in headers[path][0]:
            raise HFError(f"{path}: the index lists tensor {hf_name!r} but the file lacks it")
    # every tensor actually stored, wherever it is
    stored = {name: path for path, (h, _) in headers.items() for name in h}
    for hf_name, (g, shape) in expected.items():
        if hf_name not in stored:
            where = ", ".join(os.path.basename(p) for p in sorted(headers)) or "no files"
            raise HFError(
                f"{hf_dir}: missing tensor {hf_name!r} (ratrain {g!r}, shape {shape}) "
                f"in {where}"
            )
        path = stored[hf_name]
        meta = headers[path][0][hf_name]
        got = tuple(meta["shape"])
        if got != shape:
            raise HFError(
                f"{path}: tensor {hf_name!r} has shape {got}, expected {shape} for ratrain "
                f"{g!r} (from config.json)"
            )
        if meta.get("dtype") not in READABLE:
            raise HFError(
                f"{path}: tensor {hf_name!r} has dtype {meta.get('dtype')}; supported: "
                f"{', '.join(READABLE)}"
            )
    for hf_name, path in stored.items():
        if hf_name in expected or hf_name.endswith(IGNORED_TENSOR_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and model.tie_embeddings:
            continue
        raise HFError(
            f"{path}: unexpected tensor {hf_name!r}: not part of a LlamaForCausalLM with this "
            "config.json"
        )
    return expected, stored, headers


def check_hf(hf_dir: str, model: ModelConfig) -> None:
    """Every check `load_hf_params` makes, reading only config.json and the safetensors
    headers (cheap; for start-up, before any work): HFError naming the tensor and file."""
    _inventory(hf_dir, model)


def load_hf_params(
    hf_dir: str, model: ModelConfig, names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """{global name: fp32 array} for `names` (None: every parameter) from a Hugging Face dir.

    Checks first, for the whole checkpoint (`check_hf`: headers only, no tensor data): `model`
    matches config.json, seq_len fits, every tensor the model needs is present with its shape,
    and nothing else is (a tied checkpoint may carry `lm_head.weight`: it is ignored; so are
    rotary inv_freq buffers). Then reads only the requested tensors, file by file.
    """
    expected, stored, headers = _inventory(hf_dir, model)
    by_global = {g: hf for hf, (g, _) in expected.items()}
    wanted = list(by_global) if names is None else list(names)
    unknown = [n for n in wanted if n not in by_global]
    if unknown:
        raise KeyError(f"{unknown[0]!r} is not a parameter of this model")

    by_file: dict[str, list[str]] = {}
    for g in wanted:
        by_file.setdefault(stored[by_global[g]], []).append(g)
    out: dict[str, np.ndarray] = {}
    for path, gnames in by_file.items():
        header, start = headers[path]
        with open(path, "rb") as f:
            for g in sorted(gnames, key=lambda n: header[by_global[n]]["data_offsets"][0]):
                hf_name = by_global[g]
                out[g] = _read_tensor(f, path, hf_name, header[hf_name], start)
    return {g: out[g] for g in wanted}


__all__ = [
    "check_hf",
    "check_model_matches",
    "expected_tensors",
    "hf_max_positions",
    "hf_model_config",
    "import_model_section",
    "load_hf_params",
    "read_hf_config",
    "read_safetensors_header",
    "resolve_model_config",
]
