"""The trainer's view of a heterogeneous layout: a model's modules on disjoint rank sets joined
by a :class:`~hybridtrain.distributed.bridge.BridgeLayout` (senders: e.g. an encoder's ranks
``0..E-1``; receivers: the first pipeline stage of each data lane of the model that reads the
data and computes the loss, laid out on the other ranks by its own :class:`ParallelDims`).

* :func:`receiver_dims`: that model's degrees over ranks ``E..world-1`` (its meshes span only
  them; every rank builds them, a collective) and its receivers (first stage, one per lane).
* :class:`LaneDims` stands in for ``ParallelDims`` in the trainer: the data streams are the
  receivers' lanes (``dp``, ``dp_rank``; a sender's loop runs on lane 0's sampler, which the
  plan's ``data_view`` turns into what the sender reads, and its counts add nothing), ``all_reduce_dp`` sums one contribution per lane (a lane's
  first pipeline stage) over the world and leaves the result on every rank, so the global
  label-token count, loss and validation sums reach the senders too.
* :class:`HeteroPlan` is the plan the recipe trains: ``pipeline`` is the model's hetero step
  (the trainer's step interface), ``clip_grad_norm`` the norm over every module (each side's
  norm over its own meshes: the senders' FSDP2 shards, the receivers' meshes and stages), so a
  non-finite norm skips the step on every rank.

The senders are data-parallel among themselves (:func:`sender_degrees`: FSDP2 over their ranks
when there are several); the receivers take the recipe's ``dp_shard`` / ``dp_replicate`` /
``tp`` / ``pp`` / ``ep`` over theirs (:func:`receiver_degrees`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .bridge import BridgeLayout
from .parallel_dims import ParallelDims
from .utils import clip_grads_with_norm_, grad_norm

__all__ = ["LaneDims", "HeteroPlan", "receiver_degrees", "receiver_dims", "sender_degrees"]


def receiver_degrees(distributed, encoder_ranks: int, world_size: int) -> ParallelDims:
    """The degrees of the ``distributed`` section over ranks ``encoder_ranks..world_size-1``
    (no mesh built: the recipe's validation reads them); ValueError naming the key."""
    E = encoder_ranks
    if not 0 < E < world_size:
        raise ValueError(f"distributed.encoder_ranks={E} must leave ranks for the language "
                         f"model: between 1 and {world_size - 1} with {world_size} ranks")
    if distributed.cp != 1:
        raise ValueError(
            f"distributed.encoder_ranks={E} with distributed.cp={distributed.cp}: the model on "
            "the other ranks takes dp_shard / dp_replicate / tp / pp / ep only; set cp: 1")
    try:
        dims = ParallelDims(dp_replicate=distributed.dp_replicate, dp_shard=distributed.dp_shard,
                            tp=distributed.tp, pp=distributed.pp, ep=distributed.ep,
                            world_size=world_size - E)
    except ValueError as e:
        raise ValueError(f"distributed.encoder_ranks={E} leaves {world_size - E} ranks for the "
                         f"language model's own layout: {e}") from None
    return dims


def sender_degrees(encoder_ranks: int) -> ParallelDims:
    """The degrees of the sending side: data-parallel over its ``encoder_ranks`` ranks, its
    parameters FSDP2-sharded over them when there are several."""
    return ParallelDims(dp_shard=encoder_ranks, world_size=encoder_ranks)


def receiver_dims(distributed, encoder_ranks: int, world_size: int, device_type: str = "cpu"
                  ) -> tuple[ParallelDims, ParallelDims, BridgeLayout]:
    """(the sending side's :func:`sender_degrees` and the receiving side's
    :func:`receiver_degrees`, each with its meshes over its own ranks; the bridge from ranks
    ``0..encoder_ranks-1`` to the first pipeline stage's first tensor-parallel rank of each of
    the receiving side's data lanes, in lane order). Collective when more than one rank."""
    E = encoder_ranks
    dims = receiver_degrees(distributed, E, world_size)
    senders = sender_degrees(E)
    if E > 1:
        senders.build_mesh(device_type, first_rank=0)
    if world_size - E > 1:
        dims.build_mesh(device_type, first_rank=E)
    # ranks are laid out pp × dp × tp, slowest first (cp = 1): lane i's first stage starts at
    # rank E + i·tp
    return senders, dims, BridgeLayout(range(E), range(E, E + dims.dp * dims.tp, dims.tp))


class LaneDims:
    """The trainer's coordinates on one rank of the heterogeneous layout; ``inner``: the
    receiving side's :class:`ParallelDims` (on every rank)."""

    def __init__(self, layout: BridgeLayout, inner: ParallelDims, rank: int, world_size: int):
        self.layout = layout
        self.inner = inner
        self.rank = rank
        self.world_size = world_size
        self.is_sender = rank in layout.senders
        first_stage = not self.is_sender and (inner.pp == 1 or inner.local_rank("pp") == 0)
        # one contribution per lane to the global sums: its first stage's first tp rank
        self.counts = first_stage and (inner.tp == 1 or inner.local_rank("tp") == 0)
        self.is_leader = rank in (layout.senders[0], layout.receivers[0])  # counts its side's norm
        self.dp = inner.dp
        self.dp_rank = 0 if self.is_sender else inner.dp_rank
        self.cp = 1

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data lanes (other ranks add zeros), in place, on every rank."""
        if not self.counts:
            t.zero_()
        dist.all_reduce(t)
        return t

    # no context parallelism here (cp = 1): the tokens' ranks are the lanes
    all_reduce_dp_cp = all_reduce_dp
    sums_over_ranks = True  # every rank joins the sums, the sending side included


@dataclass
class HeteroPlan:
    """``model``: this rank's modules (the others set to None; on the receiving side as its
    own plan lays them out); ``pipeline``: the step; ``inner``: the receiving side's
    ``ParallelPlan`` (None on sender ranks); ``data_view(dataset, batch_sampler, collate) ->
    (dataset, batch_sampler, collate)``: what this rank reads of each batch (None: the batches
    of its lane); ``device`` / ``autocast_dtype``: as
    :class:`~hybridtrain.distributed.parallel_plan.ParallelPlan`'s."""

    model: nn.Module
    dims: LaneDims
    pipeline: Any
    stages: list = field(default_factory=list)
    inner: Any = None
    data_view: Any = None
    device: torch.device = torch.device("cpu")
    autocast_dtype: torch.dtype | None = None

    @property
    def sharded(self) -> bool:
        """False: the step is always a pipeline, which syncs the gradients itself
        (:class:`~hybridtrain.distributed.parallel_plan.Plan`)."""
        return False

    def clip_grad_norm(self, parameters, max_norm: float | None, norm_type: float = 2.0):
        """Global L2 norm over all modules; clips this rank's gradients by it."""
        assert norm_type == 2.0, "the heterogeneous layout clips by the L2 norm"
        params = [p for p in parameters if p.grad is not None]
        inner = self.dims.inner
        # each side's norm over its own meshes (and, receiving, its pipeline stages)
        pp_group = inner.group("pp") if not self.dims.is_sender and inner.pp > 1 else None
        sq = grad_norm(params, 2.0, pp_group).double() ** 2
        sq = sq if self.dims.is_leader else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if torch.isfinite(norm):
            clip_grads_with_norm_(params, max_norm, norm)
        return norm
