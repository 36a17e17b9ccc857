"""The ``_target_`` allow-list: which dotted names a recipe may call.

YAML must not become arbitrary code execution: a ``_target_`` must lie under one of
``DEFAULT_ALLOWED_PREFIXES`` or a prefix the user added explicitly (a top-level
``allowed_target_prefixes: [mypkg.]`` in the recipe, ``--allowed_target_prefixes=[mypkg.]``, or
``load_config(..., allowed_target_prefixes=[...])``). The check imports nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

from hybridtrain.config.errors import ConfigError

__all__ = ["DEFAULT_ALLOWED_PREFIXES", "normalize_prefixes", "is_target_allowed", "check_target"]

DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("hybridtrain.", "torch.", "transformers.",
                                             "datasets.")


def normalize_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """``["mypkg", "torch."]`` -> ``("mypkg.", "torch.")`` (deduplicated, order kept)."""
    out: list[str] = []
    for p in prefixes:
        p = str(p).strip()
        p = p if p.endswith(".") else p + "."
        if p not in out:
            out.append(p)
    return tuple(out)


def is_target_allowed(target: str, prefixes: Iterable[str]) -> bool:
    return any(target.startswith(p) or target == p[:-1] for p in normalize_prefixes(prefixes))


def check_target(target: Any, prefixes: Iterable[str], key_path: str, where: str) -> None:
    """Raise ``ConfigError`` unless ``target`` is a dotted name under an allowed prefix."""
    if not isinstance(target, str) or not target.strip() or " " in target.strip():
        raise ConfigError(f"'{key_path}' must be a dotted name like 'torch.optim.AdamW', "
                          f"got {target!r} ({where})")
    prefixes = normalize_prefixes(prefixes)
    if is_target_allowed(target, prefixes):
        return
    top = target.split(".")[0]
    raise ConfigError(
        f"_target_ '{target}' at '{key_path}' ({where}) is not allowed: a recipe may only "
        f"name callables under {', '.join(prefixes)}. If you trust '{top}', allow it "
        f"explicitly with a top-level recipe key `allowed_target_prefixes: [{top}.]`, the "
        f"override --allowed_target_prefixes=[{top}.], or "
        f"load_config(..., allowed_target_prefixes=['{top}.'])")
