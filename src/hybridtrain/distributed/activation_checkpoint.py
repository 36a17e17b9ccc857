"""Per-block activation checkpointing: all blocks, every k-th block, or blocks of given types.

A checkpointed block keeps only its inputs in forward and recomputes its activations in
backward: the block is replaced in its ``nn.ModuleDict`` by torch's checkpoint wrapper
(``checkpoint_wrapper``, non-reentrant, RNG state preserved, so results are bit-identical to the
plain run), as torchtitan does. A block that will be compiled (``compiled``) keeps the
outputs of its random operators (``torch.Tag.nondeterministic_seeded``: dropout, the fused
attention kernels, which carry that tag even without dropout) instead of running them again in
backward (a selective policy): AOT autograd then saves no RNG state for the compiled block
(torch 2.13 misplaces such a state beside a saved ``DeviceMesh`` under tensor parallelism). Eager
blocks keep plain checkpointing (the policy's dispatch mode would double an eager CPU step).

The wrapper holds the block as ``_checkpoint_wrapped_module``: ``named_parameters()`` /
``named_modules()`` of the model show that extra level, while ``state_dict()`` (and
``torch.distributed.checkpoint.state_dict``) strip it, so checkpoints are the same with and
without checkpointing; code that turns module or parameter names into keys goes through
:func:`state_dict_name`.

Accepted settings (``training.activation_checkpointing``):

* ``false`` / ``"none"`` -- off;  ``true`` / ``"all"`` -- every block;
* an int ``k`` or ``{"every": k}`` -- blocks 0, k, 2k, ...;
* a layer-type name or list, e.g. ``"moe"``, ``["mamba", "attention"]`` or
  ``{"layer_types": [...]}`` -- the blocks of those types, in the names or aliases the model
  declares in its spec's :class:`~hybridtrain.models.spec.LayerTypes` part; a model without
  one takes only the other settings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

if TYPE_CHECKING:
    from hybridtrain.models.spec import LayerTypes

__all__ = ["ACPolicy", "parse_ac_policy", "apply_activation_checkpointing", "state_dict_name"]

# torch's checkpoint wrapper lives in a private module (stable since torch 2.0, used by FSDP and
# torchtitan); the prefix below is the attribute name it keeps the wrapped module under
_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_WRAPPED_PREFIX = "_checkpoint_wrapped_module."


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


def _types(value: Iterable[Any], types: LayerTypes | None, where: str) -> tuple[str, ...]:
    """``value``'s layer-type names resolved against the model's ``types`` (an alias or name as
    written, else lower-cased)."""
    value = [str(t) for t in value]
    if types is None:
        raise ValueError(f"{where}: activation checkpointing by layer type ({', '.join(value)}): "
                         "this model does not name its layers' types; use true or {every: k}")
    out = []
    for t in value:
        t = t if t in types.aliases or t in types.names else t.lower()
        t = types.aliases.get(t, t)
        if t not in types.names:
            aliases = f" (or {', '.join(types.aliases)})" if types.aliases else ""
            raise ValueError(f"{where}: unknown layer type {t!r}; this model's types are "
                             f"{', '.join(types.names)}{aliases}")
        out.append(t)
    return tuple(out)


def parse_ac_policy(value: Any, types: LayerTypes | None = None,
                    where: str = "training.activation_checkpointing") -> ACPolicy:
    """Turn the recipe value into an :class:`ACPolicy` (``ValueError`` naming ``where``); layer
    types are matched against ``types``, the model spec's ``LayerTypes`` part (None: the model
    has none, a per-type policy is an error). The run and ``hybridtrain plan`` both read the
    setting here."""
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
        return ACPolicy("types", layer_types=_types(value.replace(",", " ").split(), types, where))
    if isinstance(value, (list, tuple)):
        return ACPolicy("types", layer_types=_types(value, types, where))
    if isinstance(value, dict):
        keys = set(value)
        if keys == {"every"}:
            return parse_ac_policy(int(value["every"]), types, where)
        if keys == {"layer_types"}:
            return ACPolicy("types", layer_types=_types(value["layer_types"], types, where))
        if keys == {"mode"}:
            return parse_ac_policy(value["mode"], types, where)
    raise ValueError(
        f"{where}: cannot read {value!r}; use true/false, 'all', an integer k (every k-th "
        "block), {every: k}, or layer types such as ['mamba', 'moe'] / {layer_types: [...]}"
    )


def _checkpoint_wrapper():
    """torch's ``checkpoint_wrapper`` and ``CheckpointImpl``, or a RuntimeError naming the torch
    version when its (private) module is missing."""
    import importlib

    try:
        mod = importlib.import_module(_WRAPPER_MODULE)
        wrapper, impl = mod.checkpoint_wrapper, mod.CheckpointImpl
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"activation checkpointing needs {_WRAPPER_MODULE}.checkpoint_wrapper, which torch "
            f"{torch.__version__} does not provide (torch 2.6 to 2.13 do); turn off "
            "training.activation_checkpointing or use a torch version that has it"
        ) from e
    assert getattr(mod, "_CHECKPOINT_PREFIX", _WRAPPED_PREFIX) == _WRAPPED_PREFIX
    return wrapper, impl


def _keep_random_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing: save what a random operator returns, recompute everything else."""
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def state_dict_name(name: str) -> str:
    """A module or parameter name as ``state_dict()`` spells it: without the checkpoint
    wrapper's ``_checkpoint_wrapped_module.`` levels."""
    return name.replace(_WRAPPED_PREFIX, "")


def apply_activation_checkpointing(
    layers: nn.ModuleDict,
    policy: Any,
    types: LayerTypes | None = None,
    compiled: bool = False,
) -> list[int]:
    """Replace the blocks of ``layers`` that ``policy`` selects by checkpoint-wrapped blocks
    (same keys); returns the selected indices.

    ``layers``' keys are the blocks' indices in the whole model (so every-k-th is the same under
    pipeline parallelism, where a stage holds a slice of the blocks); ``types``: the model
    spec's ``LayerTypes`` part (the model's parallelize function gives it), which names a
    per-type policy's types and a block's type (None: a per-type policy is an error);
    ``compiled``: whether the blocks will be compiled (see the module docstring). Call it
    before FSDP / compile wrap the blocks.
    """
    policy = parse_ac_policy(policy, types)
    if policy.mode == "none":
        return []
    assert policy.mode != "types" or types is not None, "a per-type ACPolicy needs the types"
    wrapper, impl = _checkpoint_wrapper()
    selective = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_random_outputs)}
                 if compiled else {})
    chosen = []
    for key, block in list(layers.items()):
        assert not hasattr(block, _WRAPPED_PREFIX[:-1]), f"block {key} is checkpointed already"
        i = int(key)
        if policy.selects(i, types.of(block) if policy.mode == "types" else None):
            layers[key] = wrapper(block, checkpoint_impl=impl.NO_REENTRANT, preserve_rng_state=True,
                                  **selective)
            chosen.append(i)
    return chosen
