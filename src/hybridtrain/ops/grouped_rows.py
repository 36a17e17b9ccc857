"""Expert row groups aligned for a grouped GEMM whose weights need it: torchao's float8 grouped
GEMM (``training.float8``'s routed experts) contracts over the token rows in its weight
gradient, so each expert's rows start at a multiple of 16 (16-byte alignment of float8 rows;
torchao and torchtitan pad token groups to 16 for it). Device-side: no host read of the counts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

FLOAT8_GROUP_ROWS = 16


def group_row_multiple(weight: torch.Tensor) -> int:
    """Rows per expert group the grouped GEMM over the stacked ``weight`` needs: 16 for
    torchao's float8 training weight (``Float8TrainingWeightWrapperTensor``), else 1."""
    mod = sys.modules.get("torchao.prototype.moe_training.tensor")  # never imported: not float8
    if mod is not None and isinstance(weight, mod.Float8TrainingWeightWrapperTensor):
        return FLOAT8_GROUP_ROWS
    return 1


def aligned_groups(x: torch.Tensor, counts: torch.Tensor, multiple: int,
                   fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn(rows, offsets)`` over ``x`` [N, H] (rows grouped by expert, ``counts`` [E] per
    expert) with each group zero-padded to a multiple of ``multiple`` rows; returns the N rows
    of its output. ``rows`` has a fixed size (N + E (multiple - 1), rounded up), so no count is
    read on the host; rows past the last offset are zeros in, ignored out."""
    n, e = x.shape[0], counts.shape[0]
    padded = (counts + multiple - 1) // multiple * multiple
    ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=n)
    where = torch.arange(n, device=x.device) - starts[group] + (ends - padded)[group]
    size = -(-(n + e * (multiple - 1)) // multiple) * multiple
    rows = x.new_zeros(size, x.shape[1]).index_copy(0, where, x)
    return fn(rows, ends.to(torch.int32))[where]
