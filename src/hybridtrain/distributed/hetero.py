"""The trainer's view of a heterogeneous layout: a model's modules on disjoint rank sets joined
by a :class:`~hybridtrain.distributed.bridge.BridgeLayout` (senders: e.g. an encoder's ranks;
receivers: the ranks that read the data and compute the loss, one data lane each).

* :class:`LaneDims` stands in for ``ParallelDims`` in the trainer: the data streams are the
  receiving lanes (``dp``, ``dp_rank``; a sender reads lane 0's batches only to keep its loop in
  step and contributes nothing), ``all_reduce_dp`` sums over the lanes and leaves the result on
  every rank, so the global label-token count, loss and validation sums reach the senders too.
* :class:`HeteroPlan` is the plan the recipe trains: ``pipeline`` is the model's hetero step
  (the trainer's step interface), ``clip_grad_norm`` the norm over every module (each rank set
  counts its replicated gradients once), so a non-finite norm skips the step on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .bridge import BridgeLayout

__all__ = ["LaneDims", "HeteroPlan"]


class LaneDims:
    def __init__(self, layout: BridgeLayout, rank: int, world_size: int):
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.is_sender = rank in layout.senders
        own = layout.senders if self.is_sender else layout.receivers
        self.is_leader = rank == own[0]  # counts its rank set's (replicated) gradients
        self.dp = len(layout.receivers)
        self.dp_rank = 0 if self.is_sender else layout.receivers.index(rank)
        self.pp = self.ep = self.tp = self.cp = self.dp_replicate = 1
        self.dp_shard = self.dp

    built = True
    fsdp_enabled = pp_enabled = ep_enabled = False

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the receiving lanes (senders add zeros), in place, on every rank."""
        if self.is_sender:
            t.zero_()
        dist.all_reduce(t)
        return t

    # no context parallelism here (cp = 1): the tokens' ranks are the lanes
    all_reduce_dp_cp = all_reduce_dp


@dataclass
class HeteroPlan:
    """``model``: this rank's modules (the others set to None); ``pipeline``: the step."""

    model: nn.Module
    dims: LaneDims
    pipeline: Any
    stages: list = field(default_factory=list)

    def clip_grad_norm(self, parameters, max_norm: float | None, norm_type: float = 2.0):
        """Global L2 norm over all modules; clips this rank's gradients by it."""
        assert norm_type == 2.0, "the heterogeneous layout clips by the L2 norm"
        params = [p for p in parameters if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64)
        if self.dims.is_leader and params:
            sq += sum(p.grad.detach().double().pow(2).sum() for p in params)
        dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if max_norm and params and math.isfinite(float(norm)):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm
