"""Pure-PyTorch Mamba2 pieces: the chunked SSD scan and the causal depthwise conv, both with
document restarts for packed sequences (``seq_idx``).

Shapes: b batch, l/s positions inside a chunk, c chunk, z source chunk, g B/C group,
j head inside a group (h = g * j), p head dim, n state size.

The scan is the standard "state space duality" chunked form (Dao & Gu, 2024): exact attention-like
products inside each chunk, one state per chunk, and a segment-sum over chunk decays to pass the
states along. Memory is O(L * chunk_size) per head; there is no Python loop over time or chunks.

With ``seq_idx`` (document id per token, non-decreasing along a row) the decay between two
positions is cut to zero whenever they belong to different documents, in all three places:
intra-chunk products, the state each chunk hands on, and the inter-chunk state passing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .numerics import fp32_region


def segsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum_{k=j+1..i} x[..., k] for j <= i, -inf above the diagonal.

    Computed with a masked cumsum (not a difference of cumsums) for accuracy.
    """
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)  # [..., i(k), j]
    strict = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~strict, 0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~lower, -torch.inf)


def segsum_in_chunk(x_cumsum: torch.Tensor) -> torch.Tensor:
    """``segsum`` of x from its cumsum along the last dim: ``cs[i] - cs[j]`` for j <= i, -inf
    above the diagonal. One pass instead of a masked cumsum over [..., T, T]; used inside a
    chunk, where the cumsum stays small (|cs| <= chunk_size * |dt * A|) and the difference loses
    ~|cs| * 2^-24 absolutely (as mamba_ssm's kernels, which take the same difference in fp32)."""
    T = x_cumsum.size(-1)
    out = x_cumsum[..., :, None] - x_cumsum[..., None, :]
    lower = torch.tril(torch.ones(T, T, device=x_cumsum.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~lower, -torch.inf)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
):
    """Selective state-space scan, chunked.

    x [b, L, h, p]; dt [b, L, h] (already softplus'ed and clamped); A [h] (negative);
    B, C [b, L, g, n]; D [h]; seq_idx [b, L] int or None; initial_state [b, h, p, n] or None
    (it belongs to the document of the first token). Returns y [b, L, h, p] in fp32
    (and the final state [b, h, p, n] of the last token's document if asked).

    Everything is computed in fp32, also under autocast: dt * A, its cumsum and exp (decays
    span many orders of magnitude), the chunk states and their accumulation across chunks.
    """
    with fp32_region(x):
        return _ssd_chunked(x, dt, A, B, C, chunk_size, D, seq_idx, initial_state, return_final_state)


def _ssd_chunked(x, dt, A, B, C, chunk_size, D, seq_idx, initial_state, return_final_state):
    b, L, h, p = x.shape
    g, n = B.shape[-2], B.shape[-1]
    assert h % g == 0, (h, g)
    j = h // g
    cs = chunk_size
    pad = (cs - L % cs) % cs
    c = (L + pad) // cs

    x = x.float()
    dt = dt.float()
    B = B.float()
    C = C.float()
    xdt = x * dt[..., None]
    dA = dt * A.float()[None, None, :]  # [b, L, h]
    if pad:
        xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad))
        dA = F.pad(dA, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    xdt = xdt.view(b, c, cs, g, j, p)
    B = B.view(b, c, cs, g, n)
    C = C.view(b, c, cs, g, n)
    dA = dA.view(b, c, cs, g, j).permute(0, 3, 4, 1, 2)  # [b, g, j, c, l]
    A_cs = torch.cumsum(dA, dim=-1)

    if seq_idx is not None:
        sidx = seq_idx
        if pad:
            # padded tail positions join the last document; their outputs are discarded and
            # they add nothing to any state (x * dt = 0 there, and their decay is exp(0) = 1)
            sidx = torch.cat([sidx, sidx[:, -1:].expand(b, pad)], dim=1)
        sidx = sidx.view(b, c, cs)

    # 1. intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(A_cs_l - A_cs_s) xdt_s
    seg = segsum_in_chunk(A_cs)  # [b, g, j, c, l, s]
    if seq_idx is not None:
        same = sidx[:, :, :, None] == sidx[:, :, None, :]  # [b, c, l, s]
        seg = seg.masked_fill(~same[:, None, None], -torch.inf)
    Lmat = torch.exp(seg)
    CB = torch.einsum("bclgn,bcsgn->bgcls", C, B)  # [b, g, c, l, s]
    M = CB[:, :, None] * Lmat  # [b, g, j, c, l, s]
    y = torch.einsum("bgjcls,bcsgjp->bclgjp", M, xdt)

    # 2. state at the end of each chunk, from that chunk's tokens of the chunk's last document
    decay_states = torch.exp(A_cs[..., -1:] - A_cs)  # [b, g, j, c, l]
    if seq_idx is not None:
        in_last_doc = sidx == sidx[:, :, -1:]  # [b, c, l]
        decay_states = decay_states * in_last_doc[:, None, None].to(decay_states.dtype)
    states = torch.einsum("bclgn,bgjcl,bclgjp->bcgjpn", B, decay_states, xdt)  # [b, c, g, j, p, n]

    # 3. pass states between chunks: start state of chunk i = sum_z decay(z -> i) * state_z
    if initial_state is None:
        init = states.new_zeros(b, 1, g, j, p, n)
    else:
        init = initial_state.float().view(b, 1, g, j, p, n)
    states = torch.cat([init, states], dim=1)  # [b, c+1, g, j, p, n]; index 0 = initial
    chunk_seg = segsum(F.pad(A_cs[..., -1], (1, 0)))  # [b, g, j, c+1 (to), c+1 (from)]
    if seq_idx is not None:
        # document owning each state: the first token's for the initial state, else the
        # chunk's last token's; a state only flows to a chunk boundary of the same document
        doc = torch.cat([sidx[:, :1, 0], sidx[:, :, -1]], dim=1)  # [b, c+1]
        same_doc = doc[:, :, None] == doc[:, None, :]
        chunk_seg = chunk_seg.masked_fill(~same_doc[:, None, None], -torch.inf)
    decay_chunk = torch.exp(chunk_seg)
    new_states = torch.einsum("bgjiz,bzgjpn->bigjpn", decay_chunk, states)
    start_states, final_state = new_states[:, :-1], new_states[:, -1]

    # 4. contribution of each chunk's start state: y_l += C_l . S_start exp(A_cs_l)
    state_decay_out = torch.exp(A_cs)  # [b, g, j, c, l]
    if seq_idx is not None:
        start_doc = doc[:, :-1]  # [b, c] document of each chunk's start state
        state_decay_out = state_decay_out * (sidx == start_doc[:, :, None])[:, None, None].to(A_cs.dtype)
    y = y + torch.einsum("bclgn,bcgjpn,bgjcl->bclgjp", C, start_states, state_decay_out)

    y = y.reshape(b, c * cs, h, p)[:, :L]
    if D is not None:
        y = y + x * D.float()[None, None, :, None]
    if return_final_state:
        return y, final_state.reshape(b, h, p, n)
    return y


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv. x [b, d, L], weight [d, k], bias [d]; taps that would reach into an
    earlier document (per ``seq_idx`` [b, L]) are dropped, so the conv restarts at each document."""
    d, k = weight.shape
    L = x.shape[-1]
    if seq_idx is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=k - 1, groups=d)[..., :L]
    else:
        out = x * weight[:, k - 1, None]
        for shift in range(1, k):
            xs = F.pad(x, (shift, 0))[..., :L]
            prev = F.pad(seq_idx, (shift, 0), value=-1)[:, :L]
            same = (prev == seq_idx).to(x.dtype)[:, None, :]
            out = out + xs * same * weight[:, k - 1 - shift, None]
        if bias is not None:
            out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    else:
        assert activation is None, activation
    return out
