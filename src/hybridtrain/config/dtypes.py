"""Floating-point dtype names: the one table of names and aliases a recipe, a CLI flag or a
checkpoint's ``config.json`` may use.

::

    DTYPE_NAMES                      # ("float32", "bfloat16", "float16"): canonical names
    canonical_dtype_name(value)      # "bf16" / "BFloat16" / "torch.bfloat16" / torch.bfloat16
                                     #   -> "bfloat16"; None when not a known name
    short_dtype_name(value)          # -> "bf16" / "fp16" / "fp32" (None when unknown)
    to_torch_dtype(value, key)       # -> torch.bfloat16 ...; ValueError naming ``key``
    dtype_name(dtype)                # torch.bfloat16 -> "bfloat16" (any torch dtype)

Names are case-insensitive and may carry a ``torch.`` prefix. torch is imported only by
:func:`to_torch_dtype` (the config package does not import torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_NAMES", "DTYPE_ALIASES", "canonical_dtype_name", "short_dtype_name",
           "to_torch_dtype", "dtype_name"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# every accepted spelling -> its canonical name (= the torch attribute)
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the torch attribute name of any dtype)."""
    return str(dtype).removeprefix("torch.")


def canonical_dtype_name(value: Any) -> str | None:
    """The canonical name (:data:`DTYPE_NAMES`) of a dtype or a dtype name; None if unknown."""
    return DTYPE_ALIASES.get(dtype_name(value).lower())


def short_dtype_name(value: Any) -> str | None:
    """``"fp32"``, ``"bf16"`` or ``"fp16"`` for a dtype or a dtype name; None if unknown."""
    name = canonical_dtype_name(value)
    return _SHORT[name] if name else None


def to_torch_dtype(value: Any, key: str = "dtype"):
    """The ``torch.dtype`` of ``value`` (a dtype is returned as it is); an unknown name is a
    ``ValueError`` naming ``key``."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    name = canonical_dtype_name(value)
    if name is None:
        raise ValueError(f"{key}: unknown dtype {value!r}; use one of {', '.join(DTYPE_NAMES)} "
                         f"(or {', '.join(a for a in DTYPE_ALIASES if a not in DTYPE_NAMES)})")
    return getattr(torch, name)
