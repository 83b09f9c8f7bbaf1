"""Typed values from YAML, strictly: the loading half of `ratrain.config`.

`StrictLoader` is YAML's safe loader that refuses a key given twice in one mapping (YAML keeps
the last silently: a duplicated section would replace the first one whole). `build(cls, data)`
turns a plain mapping into the frozen dataclass `cls`, field by field, coercing each value to
the field's type (int, finite float, bool, str, tuples, optionals, nested dataclasses) and
refusing unknown keys; every problem is a `ConfigError` naming the key, the value and the fix.
`to_plain` is the inverse (dataclasses and tuples to dicts and lists).

Imports nothing of ratrain: the package (`ratrain.config`) holds the sections and their checks.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import fields
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration: the message names the key, the value and the fix."""


class StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping (a duplicated section or key,
    which YAML silently resolves to the last one) is a ConfigError naming both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{line}: {key!r} appears twice in one mapping (first at line {seen[key]}); "
                    "YAML would keep only the last: merge them into one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'the top level'} must be a mapping, got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the top level"
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]!s} in {where}; valid keys are: {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        kwargs[name] = _coerce(hints[name], data[name], f"{prefix}{name}", source)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - guarded above
        raise ConfigError(str(e)) from None


def _coerce(tp, value, key: str, source: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for tp_ in inner[:-1]:  # the first type that takes the value (`[3, 5]` or `auto`)
            try:
                return _coerce(tp_, value, key, source)
            except ConfigError:
                continue
        return _coerce(inner[-1], value, key, source)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, key, source) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key}={list(value)!r} must have {len(args)} entries")
        return tuple(_coerce(a, v, key, source) for a, v in zip(args, value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}={value!r} must be an integer")
        try:
            f = float(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be an integer") from None
        if not f.is_integer():
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a number")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be a number") from None
        if not math.isfinite(f):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return f
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a string")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover


def to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    return obj


def deepcopy(d):
    if isinstance(d, dict):
        return {k: deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [deepcopy(v) for v in d]
    return d


__all__ = ["ConfigError", "StrictLoader", "build", "deepcopy", "to_plain"]
