"""FSDP2 (``fully_shard``) helpers: mixed-precision policy, sum-reduced gradients, unit wrapping.

Gradients are *summed* over data-parallel ranks, never averaged: the trainer scales each
micro-batch's cross-entropy sum by ``1 / (label tokens of the global batch)``, so the sum over
ranks is already the exact global mean. Every FSDP unit therefore gets
``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` (plain SUM
collectives; no ``PREMUL_SUM``/``AVG``, which gloo lacks and NCCL's zero-copy path avoids).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hybridtrain.config.dtypes import to_torch_dtype
from hybridtrain.distributed.utils import local_tensor
from hybridtrain.ops import backend

__all__ = [
    "apply_fsdp",
    "resolve_dtype",
    "mixed_precision_policy",
    "shard_module",
    "sum_gradients",
    "resolve_reshard_after_forward",
    "reshard_in_pipeline_backward",
    "no_backward_prefetch",
    "free_all_gather_after_copy_out",
    "no_prefetch_of_units_without_backward",
    "InPlaceAllGather",
]

def resolve_dtype(value: Any, key: str) -> torch.dtype | None:
    """``None``/``"none"``/``"auto"`` -> None (the parameters' own); a dtype name or
    ``torch.dtype`` -> the dtype."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "auto", "")):
        return None
    return to_torch_dtype(value, key)


def fsdp_param_dtype(distributed, autocast_dtype: torch.dtype | None) -> torch.dtype | None:
    """``distributed.fsdp_param_dtype`` resolved: ``auto`` is the training compute dtype
    (``autocast_dtype``; None = the parameters' own)."""
    value = distributed.fsdp_param_dtype
    return autocast_dtype if value in ("auto", None) else resolve_dtype(value, "distributed.fsdp_param_dtype")


def mixed_precision_policy(
    param_dtype: Any = None, reduce_dtype: Any = torch.float32
) -> MixedPrecisionPolicy:
    """FSDP2 policy: parameters all-gathered (and computed) in ``param_dtype`` (``None``: the
    stored dtype), gradients reduced in ``reduce_dtype``. GPU runs use bf16 / fp32."""
    p = resolve_dtype(param_dtype, "distributed.fsdp_param_dtype")
    r = resolve_dtype(reduce_dtype, "distributed.fsdp_reduce_dtype")
    return MixedPrecisionPolicy(param_dtype=p, reduce_dtype=r, cast_forward_inputs=True)


def resolve_reshard_after_forward(value: Any, pp_enabled: bool) -> bool:
    """``default`` -> reshard, except under pipeline parallelism (where each micro-batch would
    all-gather again); ``always``/``true`` / ``never``/``false``."""
    if value in (None, "default"):
        return not pp_enabled
    if value in (True, "always", "true"):
        return True
    if value in (False, "never", "false"):
        return False
    raise ValueError(
        f"distributed.fsdp_reshard_after_forward: {value!r} is not one of default, always, never"
    )


def sum_gradients(module: nn.Module) -> None:
    """Make every FSDP unit under ``module`` reduce gradients with a plain SUM."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def shard_module(
    module: nn.Module | Sequence[nn.Module],
    mesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    shard_placement_fn=None,
    cpu_offload: bool = False,
):
    """``fully_shard`` one unit (a module or a list of modules sharing one all-gather);
    ``cpu_offload`` keeps the sharded parameters, gradients and optimizer step on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(module, (list, tuple)):
        module = list(module)
    return fully_shard(
        module,
        mesh=mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )


def apply_fsdp(model: nn.Module, units: Sequence[nn.Module], dims, distributed, *,
               autocast_dtype: torch.dtype | None = None,
               expert_units: Sequence[nn.Module] = ()) -> None:
    """FSDP2 / HSDP over ``dims``: each of ``units`` (in forward order) is one unit on the dense
    data-parallel mesh (a unit may be a list of modules: one all-gather, when the first of them
    runs), each of ``expert_units`` (stacked expert weights, sharded over ``ep`` when ``ep > 1``)
    one unit on the expert-FSDP mesh, and ``model`` the root holding the rest. A unit of its own
    is gathered only while it runs (and while FSDP2 prefetches it in backward).

    ``distributed``: the recipe section (``fsdp_param_dtype`` ``auto`` = ``autocast_dtype``,
    i.e. bf16 all-gathers and compute in bf16 runs; ``fsdp_reduce_dtype``,
    ``fsdp_reshard_after_forward``, ``fsdp_backward_prefetch``, ``cpu_offload``). Gradients are summed, never averaged.
    Where the backend settings say so (CPU: ``ops.backend``'s ``fsdp_free_all_gather``), each
    unit's all-gather buffer is freed right after its copy-out (:func:`free_all_gather_after_copy_out`)
    and gathered in place (:class:`InPlaceAllGather`). A unit whose output needs no gradient
    (a frozen embedding) is not prefetched in backward (:func:`no_prefetch_of_units_without_backward`).
    """
    from torch.distributed.tensor import Shard

    mp = mixed_precision_policy(fsdp_param_dtype(distributed, autocast_dtype),
                                distributed.fsdp_reduce_dtype)
    rf = resolve_reshard_after_forward(distributed.fsdp_reshard_after_forward, dims.pp_enabled)
    offload = distributed.cpu_offload
    mesh = dims.dense_fsdp_mesh()
    expert_mesh = dims.expert_fsdp_mesh() if dims.ep > 1 else mesh
    for experts in expert_units:
        local = local_tensor(next(experts.parameters()))
        # too few local experts to shard dim 0 evenly over the expert-FSDP ranks: shard dim 1
        placement = (lambda p: Shard(1)) if local.shape[0] % dims.efsdp else None
        # a mesh of one rank "gathers" by copying: never keep that second copy after forward
        shard_module(experts, expert_mesh, mp, rf or expert_mesh.size() == 1, placement,
                     cpu_offload=offload)
        if rf and dims.pp_enabled:
            reshard_in_pipeline_backward(experts)
    for i, unit in enumerate(units):
        # the last unit's parameters are needed again at once by backward
        shard_module(unit, mesh, mp, rf and i < len(units) - 1, cpu_offload=offload)
        if rf and dims.pp_enabled:
            reshard_in_pipeline_backward(unit)
    shard_module(model, mesh, mp, reshard_after_forward=False, cpu_offload=offload)
    if backend.settings().fsdp_free_all_gather:
        for unit in [*expert_units, *units]:
            free_all_gather_after_copy_out(unit)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(InPlaceAllGather())
    sum_gradients(model)
    if not distributed.fsdp_backward_prefetch:
        no_backward_prefetch(model)
    else:
        no_prefetch_of_units_without_backward([*expert_units, *units])


def reshard_in_pipeline_backward(unit: nn.Module | Sequence[nn.Module]) -> None:
    """Under pipeline parallelism, torch's ``PipelineStage`` sets every FSDP unit of its stage
    to stay gathered after each backward until the stage's last micro-batch (fewer
    all-gathers), so the whole stage is gathered at the end of backward. With
    ``fsdp_reshard_after_forward: always`` this puts each unit back to resharding after its
    backward, as FSDP2 does without a pipeline: a hook on the unit's forward output (run when
    backward reaches the unit, i.e. after the stage's setting) sets the unit's own flag.
    Gradients are unchanged: unsynced gradients accumulate on the unsharded gradient as before."""
    mods = list(unit) if isinstance(unit, (list, tuple)) else [unit]

    def on_grad(grad):
        for m in mods:
            m.set_reshard_after_backward(True, recurse=False)

    def hook(module, args, output):
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_grad)

    mods[-1].register_forward_hook(hook)


def free_all_gather_after_copy_out(unit: nn.Module | Sequence[nn.Module]) -> None:
    """In forward FSDP2 keeps a unit's all-gather output (the whole unit's bytes) until the next
    unit has all-gathered, to overlap its copy-out with that all-gather on GPU streams. With
    synchronous CPU collectives nothing overlaps, and a rank holds the previous unit's buffer
    besides the current one's (at the end of forward: the last experts unit's and the head's).
    This starts the unit's all-gather as an asynchronous op (``FSDPModule.unshard(async_op=True)``)
    from a forward pre-hook that runs before FSDP2's own, which then waits on it and frees the
    output right after the copy-out. The same collective at the same point: results are
    bit-identical."""
    mods = list(unit) if isinstance(unit, (list, tuple)) else [unit]

    def hook(module, args):
        mods[0].unshard(async_op=True)  # a no-op when the unit is gathered already

    for m in mods:
        m.register_forward_pre_hook(hook, prepend=True)


def no_backward_prefetch(module: nn.Module) -> None:
    """Every FSDP unit under ``module`` all-gathers in backward only when its own backward
    starts: its explicit backward prefetch is itself (already gathered then), which replaces
    FSDP2's default of gathering the previous unit meanwhile."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_modules_to_backward_prefetch([m])


class InPlaceAllGather:
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) as one broadcast per rank, each
    into its own slice of the output. Gloo's ``all_gather_into_tensor`` gathers into a temporary
    buffer of the output's size and copies it over: a second copy of every unit while it is
    gathered. A broadcast of a contiguous CPU tensor is done in place. The same bytes land in
    the same places: results are bit-identical."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        n = input_tensor.numel()
        works = [dist.broadcast(output_tensor.narrow(0, r * n, n), group=group, group_src=r,
                                async_op=True) for r in range(group.size())]
        for w in works[:-1]:
            w.wait()
        if async_op:
            return works[-1]
        works[-1].wait()
        return None


def no_prefetch_of_units_without_backward(units: Sequence[nn.Module | Sequence[nn.Module]]) -> None:
    """FSDP2 prefetches in backward the unit that finished its forward before the one starting
    its backward. A unit whose output does not require grad (a frozen embedding under LoRA: no
    trainable parameter, integer inputs) has no backward, so that prefetch all-gathers it for
    nothing and keeps it gathered until the end of backward. A forward hook on every unit notes
    whether the previous unit's output required grad, and when it did not, the unit prefetches
    no other unit in backward (``set_modules_to_backward_prefetch``; else FSDP2's default)."""
    mods = [list(u) if isinstance(u, (list, tuple)) else [u] for u in units]
    last_needs_grad = [True]

    def hook(unit, module, args, output):
        outs = output if isinstance(output, (tuple, list)) else [output]
        needs = any(isinstance(t, torch.Tensor) and t.requires_grad for t in outs)
        if torch.is_grad_enabled():
            unit.set_modules_to_backward_prefetch([] if last_needs_grad[0] else [unit])
        last_needs_grad[0] = needs

    for ms in mods:
        ms[-1].register_forward_hook(lambda module, args, output, unit=ms[0]:
                                     hook(unit, module, args, output))
