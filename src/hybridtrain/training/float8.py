"""``training.float8``: the model's Linear layers trained in float8 through torchao
(``convert_to_float8_training``; the extra ``hybridtrain[quant]``).

A converted layer is torchao's ``Float8Linear``: its weight stays a high-precision parameter
(the optimizer, checkpoints and Hugging Face exports see the same tensors and names as in a
bf16 run; no float8 tensor is saved), and each forward / backward casts its GEMM operands to
float8 with scales per tensor (``tensorwise``) or per row (``rowwise``).

Which layers: the ``nn.Linear`` layers inside the model's blocks (the spec's pipeline layers)
whose in and out features are multiples of 16 (the float8 GEMM's alignment). Kept in high
precision: everything outside the blocks (embeddings, the LM head), weights that are not
``nn.Linear`` (a router's, stacked experts': torchao's float8 MoE path is not wired here), and
by default the first and last block. ``training.float8_filter`` (a list of regular
expressions) replaces that default: Linear layers whose names match one stay high-precision.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
ALIGN = 16


@dataclass
class Float8Plan:
    """Which Linear layers a conversion takes (``converted``) and why each other one stays
    high-precision (``kept``: {name: reason}); ``other_weights``: >=2-D parameters outside any
    Linear layer (high precision)."""

    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    other_weights: list[str] = field(default_factory=list)

    def summary(self, recipe: str) -> str:
        total = len(self.converted) + len(self.kept)
        reasons: dict[str, int] = {}
        for why in self.kept.values():
            reasons[why] = reasons.get(why, 0) + 1
        kept = ", ".join(f"{n} {why}" for why, n in reasons.items()) or "none"
        return (f"float8 ({recipe}): {len(self.converted)} of {total} Linear layers converted "
                f"({', '.join(self.converted)}); kept high-precision: {kept}; "
                f"{len(self.other_weights)} weights outside Linear layers stay high-precision "
                f"({', '.join(self.other_weights[:8])}{'...' if len(self.other_weights) > 8 else ''})")


def block_names(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """The full names of the blocks the spec's pipeline split names ``layers`` (names within
    the module that holds them all as its children)."""
    want = list(layers)
    for name, mod in model.named_modules():
        children = [n for n, _ in mod.named_children()]
        if want and set(want) <= set(children):
            return [f"{name}.{n}" if name else n for n in want]
    raise AssertionError(f"no module of {type(model).__name__} holds the layers {want[:4]}...")


def plan_float8(model: nn.Module, blocks: Sequence[str], keep: Sequence[str] | None = None
                ) -> Float8Plan:
    """The :class:`Float8Plan` of ``model`` whose blocks are the modules named ``blocks`` (in
    order); ``keep``: the ``training.float8_filter`` patterns (None: the first and last block)."""
    if keep is not None and (isinstance(keep, str) or not all(isinstance(k, str) for k in keep)):
        raise ValueError(f"training.float8_filter: {keep!r} is not a list of regular expressions "
                         "(names of Linear layers kept high-precision)")
    patterns = [re.compile(k) for k in keep] if keep is not None else []
    ends = {blocks[0], blocks[-1]} if keep is None and blocks else set()
    plan = Float8Plan()
    linear_params = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        linear_params.update(f"{name}.{p}" for p, _ in mod.named_parameters(recurse=False))
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is None:
            plan.kept[name] = "outside the blocks"
        elif block in ends:
            plan.kept[name] = "in the first or last block"
        elif any(p.search(name) for p in patterns):
            plan.kept[name] = "by training.float8_filter"
        elif mod.in_features % ALIGN or mod.out_features % ALIGN:
            plan.kept[name] = f"with features not a multiple of {ALIGN}"
        else:
            plan.converted.append(name)
    plan.other_weights = [n for n, p in model.named_parameters()
                          if p.dim() >= 2 and n not in linear_params]
    return plan


def convert_to_float8(model: nn.Module, recipe: str, blocks: Sequence[str],
                      keep: Sequence[str] | None = None, *, emulate: bool = False) -> Float8Plan:
    """Swaps the Linear layers of :func:`plan_float8` for torchao's ``Float8Linear`` of
    ``recipe`` in place (before the model is laid out); logs and returns the plan.
    ``emulate``: torchao's emulation (operands rounded to float8 as on the GPU, the GEMMs in
    high precision): for CPUs, whose float8 ``_scaled_mm`` is a reference loop (a 1024 x 96 x
    192 layer took 16 s forward and backward against 0.05 s emulated, 2026-12-06)."""
    if recipe not in RECIPES:
        raise ValueError(f"training.float8: {recipe!r} is not one of null, {', '.join(RECIPES)}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ValueError(f"training.float8: {recipe} needs torchao>=0.18 ({e}); "
                         "pip install 'hybridtrain[quant]' or set training.float8: null") from e
    plan = plan_float8(model, blocks, keep)
    chosen = set(plan.converted)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in chosen)
    logger.info(plan.summary(recipe + (", emulated" if emulate else "")))
    return plan
