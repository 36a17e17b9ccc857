"""Expert parallelism: routed experts sharded over the ``ep`` mesh dim, tokens moved by all-to-all.

Each of the ``ep`` ranks holds ``n_routed_experts / ep`` consecutive experts (rank ``r`` holds
experts ``[r·E_local, (r+1)·E_local)``). The MoE layer routes its tokens as usual, sorts the
token copies by expert id and hands them to its token dispatcher. Without EP that is a
:class:`LocalDispatcher`, which calls ``experts(x_sorted, num_tokens_per_expert)``; under EP
(:func:`apply_expert_parallel`) it is an :class:`AllToAllDispatcher`:

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

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridtrain.distributed.utils import local_tensor

__all__ = [
    "EPDispatchState",
    "ep_dispatch",
    "ep_combine",
    "LocalDispatcher",
    "AllToAllDispatcher",
    "zero_rows_output",
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


def zero_rows_output(experts: nn.Module, sorted_x: torch.Tensor, out_dim: int) -> torch.Tensor:
    """An experts module's output for zero rows, tied with a zero weight to each of its own
    parameters and to ``sorted_x``: every parameter gets a (zero) gradient, so that an FSDP
    reduce-scatter over the ranks sharding these experts (one of which received no token under
    expert parallelism) stays in step, and the (empty) input gets one, so that backward reaches
    what produced it in the same order on every rank: the dispatch all-to-all's backward and the
    experts unit's FSDP post-backward (which runs when its inputs' gradient is computed)."""
    zero = sum(local_tensor(p).reshape(-1)[:1].sum() * 0 for p in experts.parameters(recurse=False))
    return sorted_x.new_zeros(sorted_x.shape[0], out_dim) + (zero + sorted_x.sum() * 0)


class LocalDispatcher:
    """No expert parallelism: every expert is on this rank, the rows go straight to them."""

    def __call__(self, experts: nn.Module, x_sorted: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return experts(x_sorted, num_tokens_per_expert)


class AllToAllDispatcher:
    """Expert parallelism over ``group``: :func:`ep_dispatch` -> this rank's experts ->
    :func:`ep_combine`. The experts module receives its local experts' rows and counts only."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, experts: nn.Module, x_sorted: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        x_local, local_counts, state = ep_dispatch(x_sorted, num_tokens_per_expert, self.group)
        return ep_combine(experts(x_local, local_counts), state, self.group)


def apply_expert_parallel(moe: nn.Module, ep_mesh) -> None:
    """Shard ``moe.experts`` over ``ep_mesh`` and route ``moe``'s tokens through all-to-all.

    The interface ``moe`` must have:

    * ``moe.experts``: a module whose own parameters are stacked over the experts (leading dim
      = number of experts), called as ``experts(x_sorted, num_tokens_per_expert)`` and computing
      with :func:`local_tensor` of its parameters; it must give every parameter a (zero)
      gradient when it receives no rows, so that an FSDP reduce-scatter over the ranks that
      shard the same experts stays in step;
    * ``moe.token_dispatcher``: the callable ``moe`` sends its sorted rows through,
      ``token_dispatcher(experts, x_sorted, num_tokens_per_expert)`` (a :class:`LocalDispatcher`
      by default); set here to an :class:`AllToAllDispatcher` on ``ep_mesh``.

    The experts' parameters become ``Shard(0)`` DTensors (same names, full shapes in
    checkpoints). ``ValueError`` when the number of experts does not split evenly over the mesh.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    experts = moe.experts
    params = dict(experts.named_parameters(recurse=False))
    assert params and hasattr(moe, "token_dispatcher"), (
        f"{type(moe).__name__} does not offer the expert-parallel interface "
        "(stacked experts.* parameters and a token_dispatcher attribute)")
    n_experts = next(iter(params.values())).shape[0]
    ep = ep_mesh.size()
    if n_experts % ep:
        raise ValueError(
            f"{type(moe).__name__}: {n_experts} routed experts are not divisible by ep={ep}: each "
            "expert-parallel rank must hold the same number of experts; choose an ep that "
            f"divides {n_experts}"
        )
    for name, p in params.items():
        assert p.shape[0] == n_experts, (
            f"expert parameter {name} {tuple(p.shape)} is not stacked over {n_experts} experts"
        )
        d = nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]), p.requires_grad)
        experts.register_parameter(name, d)
    moe.token_dispatcher = AllToAllDispatcher(ep_mesh.get_group())
