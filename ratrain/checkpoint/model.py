"""What a checkpoint of a model must hold: every parameter once, with the model's shape.

The model's parameters (global names, shapes) and its stage split are described once, in
`ratrain.exec.spec`; this is the one module of the package that reads it (a pure description
built from the config with numpy: no kernels, no MPI), so that the checkpoint never writes its
own copy of that fact.
"""

from __future__ import annotations

from ratrain.config import Config, ModelConfig, config_from_dict
from ratrain.exec.spec import model_blocks, stage_layers


def expected_params(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{global name: shape} of every parameter of `model`."""
    return {p.name: tuple(p.shape) for b in model_blocks(model) for p in b.params}


def stage_bounds(cfg: Config) -> list[list[int]]:
    """[start, stop) of the decoder layers of each pipeline stage of `cfg`."""
    ranges = stage_layers(cfg.model, cfg.parallel.pp, cfg.parallel.stage_layers())
    return [[r.start, r.stop] for r in ranges]


def coverage_problems(manifest: dict, where: str) -> list[str]:
    """Every parameter of the saved model in exactly one file, with its shape."""
    model = config_from_dict(manifest["config"]).model
    want = expected_params(model)
    seen: dict[str, str] = {}
    problems = []
    for e in manifest["files"]:
        for name, shape in e["params"].items():
            if name in seen:
                problems.append(f"{where}: parameter {name!r} is in both {seen[name]} and {e['file']}")
            elif name not in want:
                problems.append(f"{where}: {e['file']} holds {name!r}, which the model does not have")
            elif tuple(shape) != want[name]:
                problems.append(
                    f"{where}: {e['file']} holds {name!r} with shape {tuple(shape)}, the model's "
                    f"is {want[name]}"
                )
            seen[name] = e["file"]
    missing = [n for n in want if n not in seen]
    if missing:
        problems.append(
            f"{where}: {len(missing)} parameter(s) of the model are in no shard, first {missing[0]!r}"
        )
    return problems
