"""The documents of packed rows on the host, read once per micro-batch.

::

    document_starts(seq_idx) -> per row [0, start, ...]     # host ints
    per_documents(seq_idx, key, build) -> build(seq_idx)    # once per seq_idx tensor

Every eager layer that needs the documents' boundaries (the per-document attention, the conv's
restarts) reads the same ``seq_idx`` tensor, in the forward and again in the backward. The first
reader reads it back to the host; the others get that answer (and what was derived from it) from
a memo of one entry: the last ``seq_idx`` tensor (held weakly, with its version counter, so an
in-place change or a new tensor is read anew; inference tensors are not held).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["document_starts", "per_documents"]

_MEMO: dict[str, Any] = {}


def per_documents(seq_idx: torch.Tensor, key: Any, build: Callable[[torch.Tensor], Any]) -> Any:
    """``build(seq_idx)``, computed once per ``seq_idx`` tensor and ``key``: the value derived
    from the documents of the last ``seq_idx`` seen (held until another tensor comes). An
    inference tensor (no version counter: decoding's prefill) is built anew each time."""
    if seq_idx.is_inference():
        return build(seq_idx)
    ref = _MEMO.get("tensor")
    if ref is None or ref() is not seq_idx or _MEMO.get("version") != seq_idx._version:
        _MEMO.clear()
        _MEMO.update(tensor=weakref.ref(seq_idx), version=seq_idx._version, values={})
    values = _MEMO["values"]
    if key not in values:
        values[key] = build(seq_idx)
    return values[key]


def read_starts(seq_idx: torch.Tensor) -> list[list[int]]:
    """:func:`document_starts` read back from the device (a sync on CUDA), without the memo."""
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    rows = []
    for row in starts.cpu():
        rows.append(row.nonzero().flatten().tolist())
    return rows


def document_starts(seq_idx: torch.Tensor) -> list[list[int]]:
    """For every row of ``seq_idx`` [b, L] (non-decreasing document ids), the positions where a
    document starts (0 first), as host ints; read once per ``seq_idx`` tensor (do not modify)."""
    return per_documents(seq_idx, "starts", read_starts)
