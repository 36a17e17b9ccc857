"""Nemotron-H layers on a context-parallel slice of the sequence
(:mod:`hybridtrain.distributed.context_parallel`: contiguous slices, one per cp rank).

* Mamba2: the conv1d reads a halo of ``conv_kernel - 1`` tokens of the previous rank's conv
  input; the SSD scan runs on the slice from a zero state, then the ranks pass the state along
  (each sends its slice's final state plus its total decay times the state it received, one
  ``[b, h, p, n]`` tensor per layer) and each rank adds the entering state's contribution
  ``exp(sum_{s<=t} dt_s A) · C_t · E`` to the tokens of its slice's first document when that
  document began on an earlier rank. Document starts cut the chain as in one process.
* Attention: K and V of the whole sequence are all-gathered (grouped-query: ``kv_heads`` only)
  and each rank's queries attend them at their global positions with the same document rule.

:class:`CPSlice` is what a forward knows about its slice: the group, the slice's global offset
and the document ids of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridtrain.distributed.context_parallel import (ContextParallel, gather_sequence,
                                                      halo_from_previous, pass_states)

from . import kernels
from .numerics import fp32_region


@dataclass
class CPSlice:
    """This rank's slice of a context-parallel forward."""

    cp: ContextParallel
    offset: int  # global position of the slice's first token
    seq_idx: torch.Tensor | None  # [B, L] document ids of the whole rows (None: one per row)

    def local_seq_idx(self, n: int) -> torch.Tensor | None:
        return None if self.seq_idx is None else self.seq_idx[:, self.offset:self.offset + n]

    def first_document(self, b: int, n: int, device) -> torch.Tensor:
        """[b, n] bool: the token belongs to a document that began on an earlier rank."""
        if self.offset == 0:
            return torch.zeros(b, n, dtype=torch.bool, device=device)
        if self.seq_idx is None:
            return torch.ones(b, n, dtype=torch.bool, device=device)
        return self.seq_idx[:, self.offset:self.offset + n] == self.seq_idx[:, self.offset - 1:self.offset]


def conv_with_halo(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                   part: CPSlice) -> torch.Tensor:
    """SiLU(causal depthwise conv) of this slice, xBC [b, n, d] (channels last) -> [b, n, d],
    reading the previous rank's last ``k - 1`` conv inputs."""
    w = k - 1
    n = xBC.shape[1]
    halo = halo_from_previous(xBC, w, 1, part.cp)
    x = torch.cat([halo, xBC], dim=1)
    sidx = None
    if part.seq_idx is not None:
        lo = part.offset - w
        sidx = part.seq_idx[:, max(lo, 0):part.offset + n]
        if lo < 0:  # the first rank's halo is zeros: give it a document of its own
            sidx = torch.cat([(sidx[:, :1] - 1).expand(-1, -lo), sidx], dim=1)
    return kernels.causal_conv1d(x.transpose(1, 2), weight, bias, sidx).transpose(1, 2)[:, w:]


def scan_with_state_passing(x, dt, A, B, C, *, chunk_size, D, dt_bias, dt_limit, seq_idx,
                            part: CPSlice) -> torch.Tensor:
    """``kernels.ssd_scan`` of this slice, exact for the whole sequence: x [b, n, h, p], dt
    [b, n, h] raw, B/C [b, n, g, s], ``seq_idx`` the slice's document ids (or None). Returns y
    [b, n, h, p]."""
    y, final = kernels.ssd_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                                dt_limit=dt_limit, seq_idx=seq_idx, return_final_state=True)
    with fp32_region(x):
        return y + _entering_state_output(dt, A, C, final, part, dt_bias, dt_limit)


def _entering_state_output(dt, A, C, final, part: CPSlice, dt_bias, dt_limit) -> torch.Tensor:
    """Pass the final states along the ranks; the entering state's share of each output."""
    b, n, h = dt.shape
    g, p = C.shape[2], final.shape[2]
    first = part.first_document(b, n, dt.device)  # [b, n]
    dt = kernels.discretize_dt(dt, dt_bias, dt_limit)
    dA = torch.cumsum(dt * A.to(dt.dtype), dim=1)  # [b, n, h]
    # the whole slice continues an earlier document: the entering state decays through it
    through = first[:, -1].to(dA.dtype)[:, None]
    enter = pass_states(final.to(dA.dtype), (torch.exp(dA[:, -1]) * through)[:, :, None, None], part.cp)
    # y_t += exp(dA_t) C_t . E for the tokens of the continued document
    Eg = enter.view(b, g, h // g, p, -1)
    contrib = torch.einsum("bngs,bgjps->bngjp", C.to(dA.dtype), Eg).reshape(b, n, h, p)
    w = torch.exp(dA) * first.to(dA.dtype)[..., None]
    return contrib * w[..., None]


def gather_keys_values(k: torch.Tensor, v: torch.Tensor, part: CPSlice):
    """K, V [b, kv_heads, n, d] of the slice -> of the whole sequence."""
    return gather_sequence(k, 2, part.cp), gather_sequence(v, 2, part.cp)
