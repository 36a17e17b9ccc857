"""Process helpers and gradient norms over a parallel layout.

- ``is_distributed()``, ``get_rank()``, ``get_world_size()``, ``is_main_process()``,
  ``barrier()``: the default process group's, and 0 / 1 / True / a no-op in a single process
  (no process group started).
- ``main_process_first(fn)``: rank 0 runs ``fn`` first (writes files, fills caches), then the
  other ranks; every rank returns its own result.
- ``local_tensor(t)``: a DTensor's local shard (differentiable), any other tensor itself.
- ``grad_norm``, ``clip_grad_norm_``: gradient norm/clipping over meshes and pipeline stages.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = ["barrier", "clip_grad_norm_", "clip_grads_with_norm_", "get_rank", "get_world_size",
           "grad_norm", "is_distributed", "is_main_process", "local_tensor", "main_process_first"]

T = TypeVar("T")


# -- ranks ----------------------------------------------------------------------------------------
def is_distributed() -> bool:
    """True once the default process group is started."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Waits for every rank of the default group (nothing to wait for in one process)."""
    if is_distributed():
        dist.barrier()


def main_process_first(fn: Callable[[], T], is_main: bool | None = None) -> T:
    """Rank 0 (or the process ``is_main`` names) calls ``fn`` first, then the others do."""
    is_main = is_main_process() if is_main is None else is_main
    out = fn() if is_main else None
    barrier()
    return out if is_main else fn()


# -- tensors --------------------------------------------------------------------------------------
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a DTensor (differentiable), or ``t`` itself: what a module
    computes with, so that the same code runs with and without a parallel layout."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# -- gradient norms -------------------------------------------------------------------------------


def _mesh_key(t: torch.Tensor):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    return (id(t.device_mesh), tuple(t.placements))


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group=None
) -> torch.Tensor:
    """Total gradient norm over every rank's shard of every parameter.

    Gradients may be DTensors on different meshes (FSDP over ``dp_shard_cp`` for dense weights,
    over ``efsdp × ep`` for experts) or plain tensors; under pipeline parallelism each stage
    holds different parameters, so the per-stage results are combined over ``pp_group``.
    Returns a plain fp32 scalar tensor, equal on every rank.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    groups = defaultdict(list)
    for g in grads:
        groups[_mesh_key(g)].append(g)
    parts = []
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, norm_type=norm_type, foreach=True)
        if hasattr(n, "full_tensor"):
            n = n.full_tensor()
        parts.append(n.float())
    device = grads[0].device if grads else torch.device("cpu")
    if not parts:
        parts = [torch.zeros((), device=device)]
    parts = torch.stack([p.to(device) for p in parts])
    if math.isinf(norm_type):
        total = parts.max()
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
    else:
        total = (parts ** norm_type).sum()
        if pp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total ** (1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float | None,
    norm_type: float = 2.0,
    pp_group=None,
) -> torch.Tensor:
    """Clip in place to ``max_norm`` (when set) by the global norm; returns the norm before."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, norm_type, pp_group)
    clip_grads_with_norm_(params, max_norm, total)
    return total


@torch.no_grad()
def clip_grads_with_norm_(params: Sequence[torch.Tensor], max_norm: float | None,
                          total: torch.Tensor) -> None:
    """Scale the gradients of ``params`` (plain or DTensors on any meshes) by
    ``max_norm / (total + 1e-6)`` when that is below 1 (nothing without ``max_norm``), as
    ``torch.nn.utils.clip_grads_with_norm_`` does. A scale is the same on every shard, so each
    rank scales its local shards: one multiply per device and dtype, with no DTensor dispatch
    (whose first call per mesh and layout costs more than the multiply)."""
    if max_norm is None or max_norm <= 0 or not params:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups = defaultdict(list)
    for p in params:
        g = local_tensor(p.grad)
        groups[(g.device, g.dtype)].append(g)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device))
