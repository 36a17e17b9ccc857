"""A model's weights as ``(Hub name, full tensor)`` pairs on every rank, for an inference engine
that takes weights without a file: sharded tensors (FSDP, EP) gathered, LoRA merged, pipeline
stages' parts exchanged, Hub names and layout from the model's spec."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from hybridtrain.distributed.utils import get_rank, get_world_size
from hybridtrain.peft.lora import has_lora, merged_state_dict

__all__ = ["hf_tensors", "full_state_dict"]


def _local_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of the model as full tensors (collective over each tensor's mesh), LoRA
    adapters folded into their base weights."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()
    return merged_state_dict(model, out) if has_lora(model) else out


def _exchange(local: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's tensors on every rank, each sent by the lowest rank that holds it (pipeline
    stages hold different names)."""
    world = get_world_size()
    metas: list = [None] * world
    dist.all_gather_object(metas, [(k, tuple(v.shape), str(v.dtype)) for k, v in local.items()])
    owner: dict[str, tuple[int, tuple, str]] = {}
    for r, items in enumerate(metas):
        for k, shape, dtype in items:
            owner.setdefault(k, (r, shape, dtype))
    me, out = get_rank(), {}
    for k, (r, shape, dtype) in owner.items():
        if r == me:
            t = local[k].contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=device)
        dist.broadcast(t, src=r)
        out[k] = t
    return out


def full_state_dict(model: nn.Module, spec) -> dict[str, torch.Tensor]:
    """The whole model's state dict in its own names, full tensors, LoRA merged (the state dict
    of the plain model), on every rank. Collective."""
    sd = _local_full(model)
    if get_world_size() > 1 and not spec.pipeline.is_complete(model):
        device = next(iter(sd.values())).device if sd else torch.device("cpu")
        sd = _exchange(sd, device)
    return sd


def hf_tensors(model: nn.Module, spec, dtype: torch.dtype | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hub name, tensor)`` of the whole model, floating-point tensors in ``dtype`` (None: as
    held). Collective: every rank calls it and consumes the whole iterator."""
    sd = full_state_dict(model, spec)
    items = spec.hf.hub_tensors(sd, model.config) if spec.hf.hub_tensors is not None else sd.items()
    for name, t in items:
        yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t
