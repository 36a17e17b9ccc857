"""Expert parallelism: routed experts sharded over the ``ep`` mesh dim, tokens moved by all-to-all.

Each of the ``ep`` ranks holds ``n_routed_experts / ep`` consecutive experts (rank ``r`` holds
experts ``[r·E_local, (r+1)·E_local)``). The MoE layer routes its tokens as usual and sorts the
token copies by expert id; the experts module is then called as
``experts(x_sorted, num_tokens_per_expert)``. Under EP that call is wrapped:

1. *dispatch*: the per-expert counts are exchanged first (``all_to_all_single`` of ``E``
   integers), then the token rows travel with ``all_to_all_single`` using variable split sizes
   (no capacity factor, nothing dropped); the received rows, grouped by (source rank, local
   expert), are reordered to be grouped by local expert;
2. the local experts run on their rows;
3. *combine*: the inverse reordering and the reverse all-to-all bring each output row back to
   the rank and position it came from; the MoE layer then weights and sums them as without EP.

The token all-to-all is differentiable (``_functional_collectives.all_to_all_single_autograd``,
whose backward is the reverse all-to-all), so gradients of the inputs, of the expert weights and,
through the MoE layer's combine, of the router are exact. Expert weights become DTensors
``Shard(0)`` on the ``ep`` mesh, so checkpoints hold the full expert tensors and load under any
layout.

An optional DeepEP path (``ep_backend: deepep``) fails fast when requested and not usable.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "EPDispatchState",
    "ep_dispatch",
    "ep_combine",
    "apply_expert_parallel",
    "check_ep_backend",
]


def _a2a_autograd():
    try:
        from torch.distributed._functional_collectives import all_to_all_single_autograd
    except ImportError as e:  # pragma: no cover - depends on torch version
        raise RuntimeError(
            "expert parallelism needs torch.distributed._functional_collectives."
            f"all_to_all_single_autograd, which torch {torch.__version__} does not provide "
            "(torch >= 2.4 does)"
        ) from e
    return all_to_all_single_autograd


def check_ep_backend(ep_backend: str, device_type: str) -> str:
    """Validate ``distributed.ep_backend`` (``alltoall`` or ``deepep``); fail fast if unusable."""
    name = (ep_backend or "alltoall").lower()
    if name in ("alltoall", "all_to_all", "torch"):
        return "alltoall"
    if name == "deepep":
        if device_type != "cuda":
            raise ValueError(
                "distributed.ep_backend: deepep needs CUDA GPUs; on CPU use ep_backend: alltoall"
            )
        if importlib.util.find_spec("deep_ep") is None:
            raise ValueError(
                "distributed.ep_backend: deepep was requested but the deep_ep package is not "
                "installed (https://github.com/deepseek-ai/DeepEP); install it or use "
                "ep_backend: alltoall"
            )
        raise ValueError(
            "distributed.ep_backend: deepep is installed, but hybridtrain's DeepEP dispatcher is "
            "not implemented yet; use ep_backend: alltoall"
        )
    raise ValueError(
        f"distributed.ep_backend: unknown value {ep_backend!r}; valid values are alltoall, deepep"
    )


class EPDispatchState:
    """What combine needs to undo dispatch."""

    __slots__ = ("input_splits", "output_splits", "perm", "inv_perm")

    def __init__(self, input_splits, output_splits, perm, inv_perm):
        self.input_splits = input_splits
        self.output_splits = output_splits
        self.perm = perm
        self.inv_perm = inv_perm


def ep_dispatch(
    x_sorted: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, EPDispatchState]:
    """Send token rows (sorted by global expert id) to the ranks that own their experts.

    Returns ``(x_local, num_tokens_per_local_expert, state)`` where ``x_local`` holds the rows
    for this rank's experts, grouped by local expert.
    """
    ep = dist.get_world_size(group)
    n_experts = num_tokens_per_expert.numel()
    assert n_experts % ep == 0, f"{n_experts} experts do not split over ep={ep}"
    e_local = n_experts // ep
    counts = num_tokens_per_expert.detach().to(torch.int64)
    # 1. counts: recv[s, e] = rows that source rank s sends to my local expert e
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    counts, recv = counts.view(ep, e_local).cpu(), recv.view(ep, e_local).cpu()
    input_splits = counts.sum(1).tolist()
    output_splits = recv.sum(1).tolist()
    # 2. rows: variable split sizes, differentiable
    x_recv = _a2a_autograd()(x_sorted, output_splits, input_splits, group)
    # 3. (source, local expert) order -> (local expert, source) order
    block = torch.repeat_interleave(torch.arange(ep * e_local), recv.flatten())  # (s, e) block id
    key = (block % e_local) * ep + block // e_local  # the block's rank in (e, s) order
    perm = torch.argsort(key, stable=True).to(x_sorted.device)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    x_local = x_recv.index_select(0, perm)
    local_counts = recv.sum(0).to(num_tokens_per_expert.device, num_tokens_per_expert.dtype)
    return x_local, local_counts, EPDispatchState(input_splits, output_splits, perm, inv_perm)


def ep_combine(y_local: torch.Tensor, state: EPDispatchState, group: dist.ProcessGroup):
    """Inverse of :func:`ep_dispatch`: rows back to their source ranks, in sorted order."""
    y_recv = y_local.index_select(0, state.inv_perm)
    return _a2a_autograd()(y_recv, state.input_splits, state.output_splits, group)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def apply_expert_parallel(experts: nn.Module, ep_mesh, n_experts: int) -> nn.Module:
    """Shard ``experts``' stacked parameters (leading dim ``n_experts``) over ``ep_mesh`` as
    ``Shard(0)`` DTensors and wrap its forward with dispatch/combine (in place, names unchanged).

    ``experts.forward(x_sorted, num_tokens_per_expert)`` must accept rows sorted by expert id
    and counts per expert; under EP it runs on its local experts' rows and counts only, with
    its parameters seen as the local (plain tensor) shards.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    if n_experts % ep:
        raise ValueError(
            f"n_routed_experts={n_experts} is not divisible by ep={ep}: each expert-parallel "
            "rank must hold the same number of experts"
        )
    names = [n for n, _ in experts.named_parameters(recurse=False)]
    for name in names:
        p = getattr(experts, name)
        assert p.shape[0] == n_experts, (
            f"expert parameter {name} {tuple(p.shape)} is not stacked over {n_experts} experts"
        )
        d = nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]), p.requires_grad)
        experts.register_parameter(name, d)
    group = ep_mesh.get_group()
    inner: Callable[..., Any] = experts.forward

    def forward(x_sorted: torch.Tensor, num_tokens_per_expert: torch.Tensor, *args, **kwargs):
        x_local, local_counts, state = ep_dispatch(x_sorted, num_tokens_per_expert, group)
        # the experts' code sees its local shards as plain tensors (differentiable views);
        # FSDP's hooks have already run, so the swap is invisible outside this call
        params = experts._parameters
        saved = {n: params[n] for n in names}
        try:
            for n in names:
                params[n] = _local(saved[n])
            y_local = inner(x_local, local_counts, *args, **kwargs)
            if x_local.shape[0] == 0:
                # no token reached this rank's experts: still give every expert weight a (zero)
                # gradient, so that the FSDP reduce-scatter over efsdp ranks stays in step
                y_local = y_local + sum(params[n].reshape(-1)[:1].sum() * 0 for n in names)
        finally:
            params.update(saved)
        return ep_combine(y_local, state, group)

    experts.forward = forward
    experts._hybridtrain_ep = True
    return experts
