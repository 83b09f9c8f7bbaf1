"""docs/CONFIG.md from the config definitions: `python -m ratrain.configdoc [--check]`.

Every key of `ratrain.config` with its type, default and meaning. The type and default come
from the dataclass fields; the meaning from the section's docstring, one `key: meaning` entry
per field (continuation lines indented). A field without an entry is an error, so the reference
cannot silently miss a key; `tests/test_configdoc.py` fails when docs/CONFIG.md is not what
this module generates (regenerate with `python -m ratrain.configdoc > docs/CONFIG.md`).

    python -m ratrain.configdoc            # the Markdown on stdout
    python -m ratrain.configdoc --check docs/CONFIG.md   # exit 1 when the file is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing

from ratrain.config import Config

HEADER = """# Configuration reference

Generated from `ratrain/config/` by `python -m ratrain.configdoc > docs/CONFIG.md` (a test
fails when this file is stale). A job is a YAML file of these sections; every key is optional
(the default below applies), an unknown key is an error that lists the valid ones.

```bash
ratrain train --config jobs/tiny.yaml --set optim.lr=1e-3 --set 'optim.no_decay=*norm*'
ratrain train --config tiny --print-config     # the resolved config as YAML, nothing else
ratrain train --config tiny --dry-run          # config, data, world size and memory plan
```

`--set section.key=value` (one per key) takes YAML values (`true`, `1e-3`, `[0.9, 0.95]`);
text that is not YAML (a glob such as `*norm*`) is taken as a string. A list may also be given
as comma-separated text (`--set optim.no_decay=embed.*,*norm*`). `--config` takes a path or the
name of a job shipped with ratrain (`tiny`, `correctness`, `bench-lifecycle`, `llama2-7b`, ...).
A run writes its resolved config (with what start-up filled in: the imported model, the
tokenizer) to `<run.dir>/config.yaml`, and every checkpoint carries it.
"""


def meanings(cls) -> dict[str, str]:
    """{key: meaning} from the `key: meaning` entries of a section's docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: dict[str, str] = {}
    key = None
    for line in doc.splitlines():
        m = re.match(r"^(\w+): (.+)$", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2).strip()
        elif key and line.startswith("    "):
            out[key] += " " + line.strip()
        else:
            key = None
    return out


def type_name(tp) -> str:
    """A YAML-side name of a field's type: int, float, string, bool, list of ..., or null."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"list of {len(args)} {type_name(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping (keys below)"
    return {int: "int", float: "float", str: "string", bool: "bool"}.get(tp, str(tp))


def _default(f) -> str:
    v = f.default
    if isinstance(v, tuple):
        v = list(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if v == "":
        return '""'
    return str(v)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _rows(cls, section: str) -> list[str]:
    hints, docs = typing.get_type_hints(cls), meanings(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        if f.name not in docs:
            raise KeyError(f"{cls.__name__}: no meaning for {section}{f.name} in its docstring")
        rows.append(f"| `{section}{f.name}` | {type_name(hints[f.name])} | `{_default(f)}` | "
                    f"{_cell(docs[f.name])} |")
    return rows


def generate() -> str:
    """The whole of docs/CONFIG.md."""
    parts = [HEADER]
    table = "| key | type | default | meaning |\n|---|---|---|---|\n"
    top = _rows(Config, "")
    parts.append("## top level\n\n" + table + "\n".join(top) + "\n")
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        cls = hints[f.name]
        if not dataclasses.is_dataclass(cls):
            continue
        intro = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        parts.append(f"## {f.name}\n\n{intro}\n\n" + table + "\n".join(_rows(cls, f.name + "."))
                     + "\n")
        for g in dataclasses.fields(cls):  # a list of mappings: its entries' keys
            inner = typing.get_args(typing.get_type_hints(cls)[g.name])
            if inner and dataclasses.is_dataclass(inner[0]):
                sub = inspect.cleandoc(inner[0].__doc__ or "").split("\n\n")[0].replace("\n", " ")
                key = f"{f.name}.{g.name}[]."
                parts.append(f"### {f.name}.{g.name}[]\n\n{sub}\n\n" + table
                             + "\n".join(_rows(inner[0], key)) + "\n")
    return "\n".join(parts)


def all_keys() -> list[str]:
    """Every key of the config as `section.key` (`precision` for top-level keys)."""
    hints = typing.get_type_hints(Config)
    keys = []
    for f in dataclasses.fields(Config):
        cls = hints[f.name]
        if dataclasses.is_dataclass(cls):
            keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(cls)]
        else:
            keys.append(f.name)
    return keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ratrain.configdoc",
                                 description="Print docs/CONFIG.md, generated from the config "
                                 "definitions (every key, type, default and meaning).")
    ap.add_argument("--check", metavar="FILE",
                    help="compare FILE with what would be generated; exit 1 when it is stale")
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        try:
            with open(args.check) as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
        if current != text:
            print(f"{args.check} is stale: regenerate it with python -m ratrain.configdoc > "
                  f"{args.check}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["all_keys", "generate", "main", "meanings", "type_name"]
