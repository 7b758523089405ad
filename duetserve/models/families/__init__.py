"""The model families duetserve runs, each declared in one module of this package
(`base.Family`); every module's Family instances are collected here, so adding a family
is adding a file.

    by_name("gemma3"), by_hf_model_type("qwen3_moe"), by_gguf_arch("qwen3moe"),
    names() -> the supported architectures, for error messages
"""
from __future__ import annotations

import importlib
import pkgutil

from duetserve.models.families.base import Family

_FAMILIES: dict[str, Family] = {}
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name == "base":
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _value in vars(_module).values():
        if isinstance(_value, Family):
            if _value.name in _FAMILIES and _FAMILIES[_value.name] is not _value:
                raise RuntimeError(f"model family {_value.name!r} declared twice")
            _FAMILIES[_value.name] = _value


def names() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def by_name(name: str) -> Family | None:
    return _FAMILIES.get(name)


def by_hf_model_type(model_type: str) -> Family | None:
    return next((f for f in _FAMILIES.values() if model_type in f.hf_model_types), None)


def by_gguf_arch(arch: str) -> Family | None:
    return next((f for f in _FAMILIES.values() if arch in f.gguf_archs), None)


def gguf_arch_names() -> tuple[str, ...]:
    return tuple(sorted(a for f in _FAMILIES.values() for a in f.gguf_archs))


def hf_model_type_names() -> tuple[str, ...]:
    return tuple(sorted(t for f in _FAMILIES.values() for t in f.hf_model_types))
