"""``training.float8``: the model's Linear layers trained in float8 through torchao
(``convert_to_float8_training``; the extra ``hybridtrain[quant]``), and its routed experts through
torchao's float8 grouped GEMM (``torchao.prototype.moe_training``'s ``Float8TrainingOpConfig``).

A converted layer is torchao's ``Float8Linear``: its weight stays a high-precision parameter
(the optimizer, checkpoints and Hugging Face exports see the same tensors and names as in a
bf16 run; no float8 tensor is saved), and each forward / backward casts its GEMM operands to
float8 with scales per tensor (``tensorwise``) or per row (``rowwise``).

Which layers: the ``nn.Linear`` layers inside the model's blocks (the spec's pipeline layers)
whose in and out features are multiples of 16 (the float8 GEMM's alignment). Kept in high
precision: everything outside the blocks (embeddings, the LM head), other weights (a router's,
norms, the conv), and by default the first and last block. ``training.float8_filter`` (a list
of regular expressions) replaces that default: layers whose names match one stay high-precision.

Routed experts (the spec's stacked-expert modules, ``PeftSupport.expert_modules``) follow the
same rules; their stacked weights become torchao's ``Float8TrainingWeightWrapperTensor``, whose
``torch._grouped_mm`` runs torchao's rowwise float8 grouped GEMM (its only float8 grouped
recipe, also under ``tensorwise``) over token groups aligned to 16 rows
(:mod:`hybridtrain.ops.grouped_rows`). That GEMM needs CUDA (Triton casts and
``torch._scaled_grouped_mm``), so the builder converts them on CUDA with the grouped expert path
only; elsewhere the plan names why they stay high-precision.

Under FSDP2 with ``tensorwise`` the converted weights are all-gathered in float8 (torchao's
``enable_fsdp_float8_all_gather``): each shard is cast with the scale of the whole weight's amax,
so the gathered bytes equal the cast of the gathered weight. The scales are precomputed after
each optimizer step (:func:`precompute_scales`, one all-reduce for all weights).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
ALIGN = 16
EXPERTS_RECIPE = "rowwise"  # torchao 0.18's float8 grouped GEMM: Float8TrainingRecipe.FP8_ROWWISE


@dataclass
class Float8Plan:
    """Which Linear layers a conversion takes (``converted``) and why each other one stays
    high-precision (``kept``: {name: reason}); the same for the routed-expert modules
    (``experts`` / ``experts_kept``); ``other_weights``: >=2-D parameters outside both
    (high precision); ``float8_all_gather``: FSDP2 all-gathers the converted weights in float8."""

    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)
    experts_kept: dict[str, str] = field(default_factory=dict)
    other_weights: list[str] = field(default_factory=list)
    float8_all_gather: bool = False

    def summary(self, recipe: str) -> str:
        others = self.other_weights
        return (f"float8 ({recipe}): {_count(self.converted, self.kept)} Linear layers; "
                f"{_count(self.experts, self.experts_kept)} routed-expert modules "
                f"({EXPERTS_RECIPE} grouped GEMM); FSDP float8 all-gather: "
                f"{'on' if self.float8_all_gather else 'off'}; {len(others)} weights outside "
                f"them stay high-precision ({', '.join(others[:8])}{'...' if len(others) > 8 else ''})")


def _count(converted: list[str], kept: dict[str, str]) -> str:
    """``"N of M converted (names); kept high-precision: n why, ..."``."""
    reasons: dict[str, int] = {}
    for why in kept.values():
        reasons[why] = reasons.get(why, 0) + 1
    why = ", ".join(f"{n} {w}" for w, n in reasons.items()) or "none"
    return (f"{len(converted)} of {len(converted) + len(kept)} converted "
            f"({', '.join(converted)}); kept high-precision: {why}")


def block_names(model: nn.Module, layers: Sequence[str]) -> list[str]:
    """The full names of the blocks the spec's pipeline split names ``layers`` (names within
    the module that holds them all as its children)."""
    want = list(layers)
    for name, mod in model.named_modules():
        children = [n for n, _ in mod.named_children()]
        if want and set(want) <= set(children):
            return [f"{name}.{n}" if name else n for n in want]
    raise AssertionError(f"no module of {type(model).__name__} holds the layers {want[:4]}...")


def plan_float8(model: nn.Module, blocks: Sequence[str], keep: Sequence[str] | None = None,
                expert_modules: tuple[type[nn.Module], ...] = (),
                experts_off: str | None = None) -> Float8Plan:
    """The :class:`Float8Plan` of ``model`` whose blocks are the modules named ``blocks`` (in
    order); ``keep``: the ``training.float8_filter`` patterns (None: the first and last block);
    ``expert_modules``: the classes holding stacked expert weights [E, out, in];
    ``experts_off``: why no expert module converts here (None: they follow the rules)."""
    if keep is not None and (isinstance(keep, str) or not all(isinstance(k, str) for k in keep)):
        raise ValueError(f"training.float8_filter: {keep!r} is not a list of regular expressions "
                         "(names of layers kept high-precision)")
    patterns = [re.compile(k) for k in keep] if keep is not None else []
    ends = {blocks[0], blocks[-1]} if keep is None and blocks else set()

    def why_kept(name: str, shapes: list[tuple[int, int]]) -> str | None:
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is None:
            return "outside the blocks"
        if block in ends:
            return "in the first or last block"
        if any(p.search(name) for p in patterns):
            return "by training.float8_filter"
        if any(n % ALIGN for shape in shapes for n in shape):
            return f"with features not a multiple of {ALIGN}"
        return None

    plan = Float8Plan()
    taken = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            why = why_kept(name, [(mod.in_features, mod.out_features)])
            chosen, kept = plan.converted, plan.kept
        elif expert_modules and isinstance(mod, expert_modules):
            why = why_kept(name, [tuple(p.shape[1:]) for p in mod.parameters(recurse=False)])
            why = why or experts_off
            chosen, kept = plan.experts, plan.experts_kept
        else:
            continue
        taken.update(f"{name}.{p}" for p, _ in mod.named_parameters(recurse=False))
        if why is None:
            chosen.append(name)
        else:
            kept[name] = why
    plan.other_weights = [n for n, p in model.named_parameters() if p.dim() >= 2 and n not in taken]
    return plan


def convert_to_float8(model: nn.Module, recipe: str, blocks: Sequence[str],
                      keep: Sequence[str] | None = None, *, emulate: bool = False,
                      expert_modules: tuple[type[nn.Module], ...] = (),
                      experts_off: str | None = None, float8_all_gather: bool = False
                      ) -> Float8Plan:
    """Swaps the Linear layers of :func:`plan_float8` for torchao's ``Float8Linear`` of
    ``recipe``, and the planned expert modules' stacked weights for torchao's float8 grouped
    GEMM weights, in place (before the model is laid out); logs and returns the plan.
    ``emulate``: torchao's emulation (operands rounded to float8 as on the GPU, the GEMMs in
    high precision): for CPUs, whose float8 ``_scaled_mm`` is a reference loop (a 1024 x 96 x
    192 layer took 16 s forward and backward against 0.05 s emulated, 2026-12-06).
    ``float8_all_gather``: FSDP2 all-gathers the converted weights in float8 (``tensorwise``
    only; pair it with :func:`precompute_scales` after each optimizer step)."""
    if recipe not in RECIPES:
        raise ValueError(f"training.float8: {recipe!r} is not one of null, {', '.join(RECIPES)}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ValueError(f"training.float8: {recipe} needs torchao>=0.18 ({e}); "
                         "pip install 'hybridtrain[quant]' or set training.float8: null") from e
    assert not (float8_all_gather and recipe != "tensorwise"), "float8 all-gather: tensorwise only"
    plan = plan_float8(model, blocks, keep, expert_modules, experts_off)
    plan.float8_all_gather = float8_all_gather
    chosen = set(plan.converted)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=float8_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in chosen)
    if plan.experts:
        _convert_experts(model, set(plan.experts))
    # the weights that became torchao tensor subclasses: a bf16 run's tensors in state dicts
    # (also what a meta-device build's materialisation fills: their high-precision storage)
    for name in plan.experts + (plan.converted if float8_all_gather else []):
        model.get_submodule(name).register_state_dict_post_hook(_high_precision_state)
    logger.info(plan.summary(recipe + (", emulated" if emulate else "")))
    return plan


def _convert_experts(model: nn.Module, names: set[str]) -> None:
    """torchao's float8 grouped-GEMM weights for the stacked weights of the modules ``names``."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: fqn in names)


def _high_precision_state(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: torchao's weight subclasses as their high-precision tensors."""
    for name, _ in module.named_parameters(recurse=False):
        state[prefix + name] = _unwrapped(state[prefix + name])


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t`` (or a DTensor's local part) without torchao's weight subclass: the high-precision
    tensor it wraps, sharing its storage (loading into it loads the weight)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor.from_local(_unwrapped(t.to_local()), t.device_mesh, t.placements,
                                  shape=t.shape, stride=t.stride())
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t
    (inner, *_), _ = t.__tensor_flatten__()  # torchao's wrapper: its one high-precision tensor
    return getattr(t, inner)


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of the weights FSDP2 all-gathers in float8,
    from the new weights (torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one
    all-reduce of their amaxes instead of one per weight in the next forward)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
