"""Full tensors of a laid-out model, one at a time on rank 0, for writing exports without
gathering the model anywhere:

    layout = global_layout(model)                      # {name: meta tensor}, every rank's
    for name, full in stream_full_tensors(model, layout):   # collective; full on rank 0 only
        ...

Each tensor is gathered by the ranks that hold it (``DTensor.full_tensor`` over its mesh) and,
when rank 0 is not one of them (another pipeline stage), sent to it by its lowest holder. A
rank's extra memory is one full tensor at a time.

The order is the model's own (one process: ``state_dict()`` order): the names before the
first numbered block, then the blocks by number, then the names after them, each rank's
names keeping their relative order (pipeline stages hold disjoint blocks).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridtrain.distributed.utils import get_rank, get_world_size, is_distributed

__all__ = ["global_layout", "stream_full_tensors"]

_NUMBER = re.compile(r"\.(\d+)(?:\.|$)")


def _order_key(names: Sequence[str]) -> list[tuple[int, int]]:
    """(part, block number) of each name of one rank's ordered list: part 0 before its first
    numbered name, 1 the numbered blocks (a name between them goes with the block before it),
    2 after its last."""
    numbered = [i for i, n in enumerate(names) if _NUMBER.search(n)]
    first, last = (numbered[0], numbered[-1]) if numbered else (len(names), len(names))
    keys, block = [], 0
    for i, n in enumerate(names):
        m = _NUMBER.search(n)
        if m:
            block = int(m.group(1))
        keys.append((0 if i < first else 2 if i > last else 1, block if first <= i <= last else 0))
    return keys


def global_layout(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: meta tensor of the full shape and dtype}`` of every tensor of ``model``'s state
    dict on any rank, in the model's order. Collective under torch.distributed."""
    local = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
    parts = [local]
    if is_distributed() and get_world_size() > 1:
        parts = [None] * get_world_size()
        dist.all_gather_object(parts, local)
    entries: dict[str, tuple] = {}
    for rank, part in enumerate(parts):
        keys = _order_key([n for n, _, _ in part])
        for i, ((n, shape, dtype), key) in enumerate(zip(part, keys)):
            if n not in entries:
                entries[n] = (key, rank, i, shape, dtype)
    order = sorted(entries, key=lambda n: entries[n][:3])
    return {n: torch.empty(entries[n][3], dtype=entries[n][4], device="meta") for n in order}


def _holders(model: nn.Module) -> dict[str, list[int]]:
    names = list(model.state_dict().keys())
    parts = [names]
    if is_distributed() and get_world_size() > 1:
        parts = [None] * get_world_size()
        dist.all_gather_object(parts, names)
    out: dict[str, list[int]] = {}
    for rank, part in enumerate(parts):
        for n in part:
            out.setdefault(n, []).append(rank)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def stream_full_tensors(
    model: nn.Module, layout: Mapping[str, torch.Tensor],
    items: Sequence[tuple[str, Sequence[str], Callable[..., torch.Tensor]]] | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``(name, full tensor on rank 0 / None elsewhere)`` for each name of ``layout`` (from
    :func:`global_layout`), or for each ``(out name, input names, combine)`` of ``items``:
    ``combine(*full inputs)`` computed on rank 0. Collective: every rank consumes the whole
    iterator (in the same order)."""
    if items is None:
        items = [(n, (n,), lambda t: t) for n in layout]
    state = model.state_dict()
    holders = _holders(model)
    rank = get_rank()
    for out_name, inputs, combine in items:
        fulls = []
        for n in inputs:
            owners = holders[n]
            full = _full(state[n]) if rank in owners else None
            src = owners[0]
            if src != 0:
                if rank == src:
                    dist.send(full.contiguous().reshape(-1).view(torch.uint8), dst=0)
                elif rank == 0:
                    meta = layout[n]
                    buf = torch.empty(meta.numel() * meta.element_size(), dtype=torch.uint8)
                    dist.recv(buf, src=src)
                    full = buf.view(meta.dtype).view(meta.shape)
            fulls.append(full if rank == 0 else None)
            del full
        yield out_name, combine(*fulls) if rank == 0 else None
        del fulls
