"""The configuration error and the one string-to-enum parser, shared by :mod:`lightning_v17.config` and
:mod:`lightning_v17.config.fp8` (both re-export them; torch-free)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

__all__ = ["V17ConfigError", "parse_enum", "spell"]


class V17ConfigError(ValueError):
    """A user-facing configuration error. The message names the option and the fix."""


def spell(option: str, value: Any) -> str:
    """``option`` set to ``value`` as the user writes it: an option spelled as its call, with ``...`` for the value,
    gets the value there (``"PipelinePolicy(schedule=...)"`` -> ``PipelinePolicy(schedule='zbv')``); a bare name gets
    ``=value`` (``"precision"`` -> ``precision='fp4'``)."""
    return option.replace("...", repr(value)) if "..." in option else f"{option}={value!r}"


def parse_enum(enum_cls: type[StrEnum], value: Any, *, option: str) -> StrEnum:
    """Parse ``value`` into ``enum_cls`` or raise an error that names ``option`` (see :func:`spell`) and lists the
    valid values."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_")
        for member in enum_cls:
            if key in (member.value.replace("-", "_"), member.name.lower()):
                return member
    valid = ", ".join(repr(m.value) for m in enum_cls)
    raise V17ConfigError(f"{spell(option, value)} is not supported; choose one of {valid}")
