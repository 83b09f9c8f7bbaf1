"""The Hugging Face LLaMA format, both ways: importing a directory (`init.from_hf`) and writing
one (`python -m ratrain.export`, a thin command over `hf.write`).

Owns: the file names, the one config.json key map, LlamaConfig's defaults and the one dtype
table (`format`); reading config.json and safetensors files, checked tensor by tensor, each
rank reading only its own tensors (`read`); writing safetensors, config.json, the generation
config and the tokenizer files, every file through the atomic-write protocol (`write`).

May import: `ratrain.config`, `ratrain.exec.spec` (the model's parameter names and shapes, a
pure description), `ratrain.fileio`, `ratrain.device` (device arrays to the host) and numpy.
Never comm, lifecycle or the commands: it reads
and writes files and knows no rank.
"""

from ratrain.hf.format import CONFIG, DTYPES, GENERATION, INDEX, KEYS, SINGLE, HFError
from ratrain.hf.read import (
    check_hf,
    check_model_matches,
    expected_tensors,
    hf_max_positions,
    hf_model_config,
    import_model_section,
    load_hf_params,
    read_hf_config,
    read_safetensors_header,
    resolve_model_config,
)
from ratrain.hf.write import export_hf, hf_config_dict, to_dtype, write_safetensors

__all__ = ["CONFIG", "DTYPES", "GENERATION", "INDEX", "KEYS", "SINGLE", "HFError", "check_hf",
           "check_model_matches", "expected_tensors", "export_hf", "hf_config_dict",
           "hf_max_positions", "hf_model_config", "import_model_section", "load_hf_params",
           "read_hf_config", "read_safetensors_header", "resolve_model_config", "to_dtype",
           "write_safetensors"]
