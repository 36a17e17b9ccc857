"""Micro-batches merged into one (a pipeline step's rows, a context-parallel batch): positions
from ``cu_seqlens`` and right-padding to a common length that changes nothing real (labels
``IGNORE_INDEX``, positions continuing the row's last document)."""

from __future__ import annotations

from typing import Sequence

import torch

from hybridtrain.data.batch import IGNORE_INDEX

__all__ = ["position_ids_from_cu_seqlens", "merge_row_inputs", "merge_micro_batches"]


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Positions restarting at every segment start of ``cu_seqlens`` (flattened ``B·L``) and at
    every row start: the same document boundaries, in a form that splits by rows."""
    n = batch * length
    cu = cu_seqlens.to(torch.long).cpu()
    start = torch.zeros(n, dtype=torch.long)
    start[cu[:-1][cu[:-1] < n]] = 1
    start = start.view(batch, length)
    start[:, 0] = 1
    ar = torch.arange(length).expand(batch, length)
    last_start = torch.where(start.bool(), ar, torch.zeros_like(ar)).cummax(dim=1).values
    return (ar - last_start).to(cu_seqlens.device)


def _pad_right(t: torch.Tensor, length: int, value) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    pad = t.new_full((t.shape[0], length - t.shape[1]) + tuple(t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def _pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` zero-padded at the end of every dimension after the first to ``shape[1:]``."""
    pad = []
    for have, want in zip(reversed(t.shape[1:]), reversed(shape[1:])):
        pad += [0, want - have]
    return torch.nn.functional.pad(t, pad) if any(pad) else t


def merge_row_inputs(micro_batches: Sequence[dict], row_inputs) -> dict[str, torch.Tensor]:
    """``row_inputs(micro_batch)`` (tensors with one entry per row) of every micro-batch,
    zero-padded to common sizes and concatenated along the rows."""
    parts = [row_inputs(mb) for mb in micro_batches]
    out = {}
    for k in parts[0]:
        shape = [max(p[k].shape[d] for p in parts) for d in range(parts[0][k].dim())]
        out[k] = torch.cat([_pad_to(p[k], shape) for p in parts])
    return out


def merge_micro_batches(micro_batches: Sequence[dict], length: int | None = None,
                        row_inputs=None) -> dict:
    """One batch ``[sum B_i, L]`` with ``input_ids``, ``position_ids``, ``labels`` (and the
    first stage's extra inputs of ``row_inputs``, see :func:`merge_row_inputs`)."""
    rows = []
    for mb in micro_batches:
        ids = mb["input_ids"]
        B, L = ids.shape
        if mb.get("position_ids") is not None:
            pos = mb["position_ids"].expand(B, L)
        elif mb.get("cu_seqlens") is not None:
            pos = position_ids_from_cu_seqlens(mb["cu_seqlens"], B, L)
        else:
            pos = torch.arange(L, device=ids.device).expand(B, L)
        rows.append((ids, pos, mb["labels"]))
    L = max(r[0].shape[1] for r in rows) if length is None else length
    ids = torch.cat([_pad_right(r[0], L, 0) for r in rows])
    labels = torch.cat([_pad_right(r[2], L, IGNORE_INDEX) for r in rows])
    pos = []
    for _, p, _ in rows:
        if p.shape[1] < L:  # padding continues the row's last document
            extra = p[:, -1:] + torch.arange(1, L - p.shape[1] + 1, device=p.device)
            p = torch.cat([p, extra], dim=1)
        pos.append(p)
    extra = merge_row_inputs(micro_batches, row_inputs) if row_inputs is not None else {}
    return {"input_ids": ids, "position_ids": torch.cat(pos), "labels": labels, **extra}
