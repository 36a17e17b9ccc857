"""Per-block activation checkpointing: all blocks, every k-th block, or blocks of given types.

A checkpointed block keeps only its inputs in forward and recomputes its activations in
backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved, so results are
bit-identical to the plain run). Parameter names do not change: the block's own ``forward`` is
wrapped in place, so state dicts and checkpoints are the same with and without it.

Accepted settings (``training.activation_checkpointing``):

* ``false`` / ``"none"`` -- off;  ``true`` / ``"all"`` -- every block;
* an int ``k`` or ``{"every": k}`` -- blocks 0, k, 2k, ...;
* a layer-type name or list, e.g. ``"moe"``, ``["mamba", "attention"]`` or
  ``{"layer_types": [...]}`` -- the blocks of those types: ``linear_attention`` (alias
  ``mamba``, ``M``), ``full_attention`` (``attention``, ``*``), ``mlp`` (``-``), ``moe`` (``E``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ACPolicy", "parse_ac_policy", "apply_activation_checkpointing"]

LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe")
_ALIASES = {"M": "linear_attention", "mamba": "linear_attention", "*": "full_attention",
            "attention": "full_attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class ACPolicy:
    mode: str = "none"  # none | all | every | types
    every: int = 1
    layer_types: tuple[str, ...] = ()

    def selects(self, index: int, layer_type: str | None) -> bool:
        if self.mode == "all":
            return True
        if self.mode == "every":
            return index % self.every == 0
        if self.mode == "types":
            return layer_type in self.layer_types
        return False


def _types(value: Iterable[Any], where: str) -> tuple[str, ...]:
    out = []
    for t in value:
        t = str(t) if str(t) in _ALIASES else str(t).lower()
        t = _ALIASES.get(t, t)
        if t not in LAYER_TYPES:
            raise ValueError(
                f"{where}: unknown layer type {t!r}; valid types are {', '.join(LAYER_TYPES)} "
                "(or mamba, attention, or the pattern characters M, *, -, E)"
            )
        out.append(t)
    return tuple(out)


def parse_ac_policy(value: Any, where: str = "training.activation_checkpointing") -> ACPolicy:
    """Turn the recipe value into an :class:`ACPolicy` (``ValueError`` naming ``where``)."""
    if isinstance(value, ACPolicy):
        return value
    if value is None or value is False:
        return ACPolicy("none")
    if value is True:
        return ACPolicy("all")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{where}: every-k-th checkpointing needs k >= 1 (got {value})")
        return ACPolicy("every", every=value) if value > 1 else ACPolicy("all")
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("none", "off", "false", ""):
            return ACPolicy("none")
        if v in ("all", "full", "true"):
            return ACPolicy("all")
        return ACPolicy("types", layer_types=_types(value.replace(",", " ").split(), where))
    if isinstance(value, (list, tuple)):
        return ACPolicy("types", layer_types=_types(value, where))
    if isinstance(value, dict):
        keys = set(value)
        if keys == {"every"}:
            return parse_ac_policy(int(value["every"]), where)
        if keys == {"layer_types"}:
            return ACPolicy("types", layer_types=_types(value["layer_types"], where))
        if keys == {"mode"}:
            return parse_ac_policy(value["mode"], where)
    raise ValueError(
        f"{where}: cannot read {value!r}; use true/false, 'all', an integer k (every k-th "
        "block), {every: k}, or layer types such as ['mamba', 'moe'] / {layer_types: [...]}"
    )


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s forward in backward (in place; parameter names unchanged)."""
    if getattr(module, "_hybridtrain_ac", False):
        return module
    inner: Callable = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward
    module._hybridtrain_ac = True
    return module


def apply_activation_checkpointing(
    blocks: Iterable[tuple[int, nn.Module]],
    policy: Any,
    layer_type: Callable[[nn.Module], str | None] = lambda b: getattr(b, "block_type", None),
) -> list[int]:
    """Checkpoint the selected ``(layer_index, block)`` pairs; returns the selected indices.

    ``layer_index`` is the block's index in the whole model (so every-k-th is the same under
    pipeline parallelism, where a stage holds a slice of the blocks).
    """
    policy = parse_ac_policy(policy)
    chosen = []
    for i, block in blocks:
        i = int(i)  # ModuleDict keys are strings
        if policy.selects(i, layer_type(block)):
            checkpoint_module(block)
            chosen.append(i)
    return chosen
