"""Pure-PyTorch Mamba2 pieces: the SSD scan and the causal depthwise conv, both with document
restarts for packed sequences (``seq_idx``).

:func:`ssd_reference` is the scan's definition, a token-by-token recurrence (slow; the tests hold
the fast form to it). :func:`ssd_chunked` computes the same in the standard "state space
duality" chunked form (Dao & Gu, 2024): exact attention-like products inside each chunk, one
state per chunk, and a segment-sum over chunk decays to pass the states along. Memory is
O(L * chunk_size) per head; there is no Python loop over time or chunks.

Shapes: b batch, l/s positions inside a chunk, c chunk, z source chunk, g B/C group,
j head inside a group (h = g * j), p head dim, n state size.

With ``seq_idx`` (document id per token, non-decreasing along a row) the decay between two
positions is cut to zero whenever they belong to different documents, in all three places:
intra-chunk products, the state each chunk hands on, and the inter-chunk state passing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtrain.ops.base2 import LN2, LOG2E
from hybridtrain.ops.documents import document_starts, per_documents

from .numerics import broadcast_shape, fp32_region, mul_to, silu_grad, tril_mask


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
):
    """The selective state-space scan, token by token (the plain definition :func:`ssd_chunked`
    equals). Per head, with ``S`` the ``[p, n]`` state::

        S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T      (S_{-1} = initial_state, else 0)
        y_t = S_t C_t + D * x_t

    and ``S_{t-1} = 0`` where token ``t`` starts a new document (``seq_idx`` changes). x [b, L, h,
    p]; dt [b, L, h] (after softplus); A [h] (negative); B, C [b, L, g, n], head ``i`` reading
    group ``i // (h / g)``; D [h] or None; seq_idx [b, L] or None; initial_state [b, h, p, n] or
    None. Returns y [b, L, h, p] (and the final state [b, h, p, n] if asked), in x's dtype."""
    b, L, h, p = x.shape
    heads_per_group = h // B.shape[2]
    Bh = B.repeat_interleave(heads_per_group, dim=2)  # [b, L, h, n]
    Ch = C.repeat_interleave(heads_per_group, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_state is None else initial_state.to(x.dtype)
    ys = []
    for t in range(L):
        if seq_idx is not None and t > 0:
            same_doc = (seq_idx[:, t] == seq_idx[:, t - 1]).to(x.dtype)
            state = state * same_doc[:, None, None, None]
        decay = torch.exp(dt[:, t] * A)  # [b, h]
        state = state * decay[:, :, None, None] + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        ys.append(y if D is None else y + D[None, :, None] * x[:, t])
    y = torch.stack(ys, dim=1)
    return (y, state) if return_final_state else y


def segsum(x: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = sum_{k=j+1..i} x[..., k] for j <= i, -inf above the diagonal.

    Computed with a masked cumsum (not a difference of cumsums) for accuracy.
    """
    T = x.size(-1)
    x = x[..., None].expand(*x.shape, T)  # [..., i(k), j]
    x = x.masked_fill(tril_mask(T, -1, x.device, inverted=True), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(tril_mask(T, 0, x.device, inverted=True), -torch.inf)


def _mul(a, b, layout):
    """a * b, contiguous in the dimension order ``layout`` (a permutation of the broadcast
    shape): the product and the layout change in one pass."""
    shape = broadcast_shape(a, b)
    out = torch.empty([shape[d] for d in layout], dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    inverse = sorted(range(len(layout)), key=layout.__getitem__)
    _mul_into(a, b, out.permute(inverse))
    return out


def _mul_into(a, b, out):
    """``torch.mul(a, b, out=out)`` where ``out`` may be a permuted view (one pass in eager);
    while compiling as ``out.copy_(a * b)``: dynamo traces no ``out=`` into a non-contiguous
    tensor, and the compiler fuses the two into one pass."""
    if torch.compiler.is_compiling():
        out.copy_(a * b)
    else:
        torch.mul(a, b, out=out)


def _lowp(t, dtype):
    """``t`` as a contiguous ``dtype`` operand, in one copy (none when it already is one).
    (``t.to(dtype, memory_format=...)`` ignores the format when the dtype already matches.)"""
    return t.contiguous() if t.dtype == dtype else t.to(dtype, memory_format=torch.contiguous_format)


class _ChunkScan(torch.autograd.Function):
    """The chunked scan on prepared inputs, with a hand-written backward.

    Autograd would keep several fp32 tensors of b*h*L*chunk_size elements per layer (decays,
    C.B products) plus [b, h, L, p]-sized products until backward; this saves only its inputs
    and recomputes the rest (a few elementwise passes and the small products). The chunk-to-chunk
    state passing, on [b, chunks, g, n, j, p] tensors, is differentiated by autograd.

    Precision: decays (``a``, exp2), the chunk states, their passing and every elementwise step
    are computed in ``a``'s dtype (fp32; fp64 under gradcheck). The products that only feed a
    token's output or a gradient -- C.B, (decay * C.B) @ x, C @ start state, and their
    backwards -- take their operands in ``mdt`` (bf16 for bf16 inputs: fp32 accumulation inside
    the GEMM, like mamba_ssm's kernels), else ``a``'s dtype. The chunk states themselves
    (B^T @ (x dt decay)) are always a full-precision product, so the state is the same as an fp32
    scan's on the same inputs.

    Decays in base 2: ``exp(sum dt A) = 2^(sum dt A log2 e)`` (``ops.base2``: exp2 is ~4x cheaper
    than exp on CPU). Forward forms ``a = cumsum(dt * A * log2 e)`` per chunk, [b, c, g, j, l], so
    that the decay between positions is ``2^(a_l - a_s)``; backward differentiates every ``2^x``
    as ``2^x`` and multiplies the sum by ``ln 2`` once, then takes the gradient of ``a`` back to
    ``dt`` and ``A`` by hand (:meth:`_log2_decays_backward`: autograd's ops on the same values,
    without a nested graph).

    Inputs: xdt [b, c, l, g, j, p] (the padded [b, L, h, p] layout); dt [b, L, h] and A [h] in
    xdt's dtype (``a`` is padded to the chunks with zeros); C, B [b, c, g, l, n]; mask [b or 1,
    c or 1, l, s] (causal, same document); last_doc, start_doc [b, c, 1, 1, l] or None (token
    in its chunk's last document / in the document of the chunk's start state); same_doc
    [b, c+1, c+1] or None; init [b, 1, g, n, j, p] or None; mdt. Returns y [b, c, l, g, j, p]
    and the final state [b, g, n, j, p].
    """

    @staticmethod
    def _pass_states(states, a_last, init, same_doc):
        """Start state of every chunk and the final state: state of chunk i's start = sum over
        earlier chunk ends z (and the initial state) of 2^(sum of a_last over z+1..i) * state_z,
        zero across documents. states [b, c, g, n, j, p]; a_last [b, c, g, j]; init
        [b, 1, g, n, j, p] or None; same_doc [b, c+1, c+1] bool or None. Small tensors: plain
        autograd."""
        if init is None:
            init = states.new_zeros(states[:, :1].shape)
        states = torch.cat([init, states], dim=1)  # [b, c+1, g, n, j, p]; index 0 = initial
        chunk_seg = segsum(F.pad(a_last.permute(0, 2, 3, 1), (1, 0)))  # [b, g, j, c+1 (to), c+1 (from)]
        if same_doc is not None:
            chunk_seg = chunk_seg.masked_fill(~same_doc[:, None, None], -torch.inf)
        new_states = torch.einsum("bgjiz,bzgnjp->bignjp", torch.exp2(chunk_seg), states)
        return new_states[:, :-1], new_states[:, -1]

    @staticmethod
    def _pass_states_backward(states, a_last, init, same_doc, gstart, gfinal):
        """The gradients of :meth:`_pass_states` (states, a_last, init or None) by hand, for a
        compiled backward (eager differentiates it with autograd: the same function)."""
        S = torch.cat([states.new_zeros(states[:, :1].shape) if init is None else init, states], dim=1)
        seg = segsum(F.pad(a_last.permute(0, 2, 3, 1), (1, 0)))  # [b, g, j, i (to), z (from)]
        if same_doc is not None:
            seg = seg.masked_fill(~same_doc[:, None, None], -torch.inf)
        decay = torch.exp2(seg)
        gnew = torch.cat([gstart, gfinal[:, None]], dim=1)  # [b, c+1, g, n, j, p]
        gS = torch.einsum("bgjiz,bignjp->bzgnjp", decay, gnew)
        gseg = torch.einsum("bignjp,bzgnjp->bgjiz", gnew, S) * decay * LN2  # 0 where seg is -inf
        # seg[i, z] = sum of x[z+1..i]: x[k] gets the gseg[i, z] with z < k <= i
        T = seg.shape[-1]
        above = tril_mask(T, -1, seg.device, inverted=True)
        gx = gseg.flip(-2).cumsum(-2).flip(-2).masked_fill(above, 0).sum(-1)  # [b, g, j, c+1]
        return gS[:, 1:], gx[..., 1:].permute(0, 3, 1, 2), (gS[:, :1] if init is not None else None)

    @staticmethod
    def _log2_decays_backward(dt, A, ga):
        """The gradients of :meth:`_log2_decays` (dt, A) for ``ga`` [b, c, g, j, l], by hand: the
        ops autograd runs for it (the same values), without building a graph in backward."""
        b, L, h = dt.shape
        c, l = ga.shape[1], ga.shape[-1]
        gdA = ga.flip(-1).cumsum(-1).flip(-1).permute(0, 1, 4, 2, 3).reshape(b, c * l, h)[:, :L]
        gdt = gdA * (A * LOG2E)[None, None, :]
        gA = (gdA * dt).sum((0, 1)) * LOG2E
        return gdt, gA

    @staticmethod
    def _decay(a):
        """2^min(a_l - a_s, 0): [b, c, g, j, l, s]. a is non-increasing along a chunk (dt >= 0,
        A < 0), so a_l - a_s <= 0 for l >= s; above the diagonal it may be large and is clamped to
        0 rather than masked (a cheaper pass). The (causal, same-document) mask is applied to the
        C.B products instead, which are per group, not per head."""
        seg = a[..., :, None] - a[..., None, :]
        return seg.clamp_max_(0).exp2_()

    @staticmethod
    def _log2_decays(dt, A, chunks):
        """a [b, c, g, j, l] = in-chunk cumsum of dt * A * log2(e), zero-padded to the chunks
        (``chunks`` = (c, l, g, j))."""
        c, l, g, j = chunks
        dA = dt * (A * LOG2E)[None, None, :]  # [b, L, h]
        pad = c * l - dt.shape[1]
        if pad:
            dA = F.pad(dA, (0, 0, 0, pad))
        return torch.cumsum(dA.view(dt.shape[0], c, l, g, j).permute(0, 1, 3, 4, 2), dim=-1)

    @staticmethod
    def _state_weights(a, last_doc):
        w = torch.exp2(a[..., -1:] - a)  # decay from each token to its chunk's end
        return w if last_doc is None else w * last_doc

    @staticmethod
    def _start_weights(a, start_doc):
        u = torch.exp2(a)  # decay from the chunk's start to each token
        return u if start_doc is None else u * start_doc

    @staticmethod
    def _states(xdt, w, B):
        """Chunk-end states [b, c, g, n, j, p] = B^T @ (xdt * w), in full precision; also returns
        xdt * w in the token-major layout [b, c, g, l, j, p]."""
        b, c, l, g, j, p = xdt.shape
        # [b, c, l, g, j, p] * [b, c, g, j, l] -> [b, c, g, l, j, p], contiguous
        xw = _mul(xdt, w.permute(0, 1, 4, 2, 3)[..., None], layout=(0, 1, 3, 2, 4, 5))
        states = B.to(xdt.dtype).transpose(-1, -2) @ xw.view(b, c, g, l, j * p)
        return states.view(b, c, g, -1, j, p), xw

    @staticmethod
    def forward(ctx, xdt, dt, A, C, B, mask, last_doc, start_doc, same_doc, init, mdt):
        ctx.save_for_backward(xdt, dt, A, C, B, mask, last_doc, start_doc, same_doc, init)
        ctx.mdt = mdt
        b, c, l, g, j, p = xdt.shape
        a = _ChunkScan._log2_decays(dt, A, (c, l, g, j))
        Cm, Bm = C.to(mdt), B.to(mdt)
        # 1. diagonal blocks: y_l = sum_{s<=l} (C_l . B_s) 2^(a_l - a_s) xdt_s
        CB = (Cm @ Bm.transpose(-1, -2)).masked_fill_(~mask[:, :, None], 0)  # [b, c, g, l, s], masked
        M = mul_to(_ChunkScan._decay(a), CB[:, :, :, None], mdt, inplace=True)  # [b, c, g, j, l, s]
        xh = _lowp(xdt.permute(0, 1, 3, 4, 2, 5), mdt)
        yd = M @ xh  # [b, c, g, j, l, p]
        del M, xh
        # 2. state at each chunk's end, from its tokens of the chunk's last document
        states, _ = _ChunkScan._states(xdt, _ChunkScan._state_weights(a, last_doc), B)
        # 3. states passed from chunk to chunk; 4. y_l += 2^(a_l) C_l . S_start
        start, final = _ChunkScan._pass_states(states, a[..., -1], init, same_doc)
        yo = Cm @ start.to(mdt).reshape(b, c, g, -1, j * p)  # [b, c, g, l, (j p)]
        u = _ChunkScan._start_weights(a, start_doc)
        y = torch.empty_like(xdt)
        _mul_into(yo.view(b, c, g, l, j, p), u.permute(0, 1, 2, 4, 3)[..., None], y.permute(0, 1, 3, 2, 4, 5))
        y.permute(0, 1, 3, 4, 2, 5).add_(yd)
        return y, final

    @staticmethod
    def backward(ctx, gy, gfinal):
        xdt, dt, A, C, B, mask, last_doc, start_doc, same_doc, init = ctx.saved_tensors
        mdt = ctx.mdt
        b, c, l, g, j, p = xdt.shape
        compiling = torch.compiler.is_compiling()  # (no nested autograd in a traced backward)
        a = _ChunkScan._log2_decays(dt, A, (c, l, g, j))
        cdt = xdt.dtype
        Cm, Bm = C.to(mdt), B.to(mdt)
        gy = gy.contiguous()
        gyh = _lowp(gy.permute(0, 1, 3, 4, 2, 5), mdt)  # [b, c, g, j, l, p]
        # 1. diagonal blocks: M = decay * CB per head, y = M @ xdt
        drop = ~mask[:, :, None]
        CB = (Cm @ Bm.transpose(-1, -2)).masked_fill_(drop, 0)
        Lmat = _ChunkScan._decay(a)  # not masked: every product with it below is masked via CB or gCB
        xh = _lowp(xdt.permute(0, 1, 3, 4, 2, 5), mdt)
        gM = gyh @ xh.transpose(-1, -2)  # [b, c, g, j, l, s]
        del xh
        M = mul_to(Lmat, CB[:, :, :, None], mdt)
        gxh = M.transpose(-1, -2) @ gyh  # [b, c, g, j, s, p]
        del M, gyh
        P = torch.mul(gM, Lmat, out=Lmat)  # dL/dM * decay (= dL/dCB per head), full precision
        del gM
        gCB = P.sum(3).masked_fill_(drop, 0)
        gseg = P.mul_(CB[:, :, :, None])  # dL/d(a_l - a_s)
        ga = gseg.sum(-1) - gseg.sum(-2)
        del gseg, P
        gCBm = gCB.to(mdt)
        gB = (gCBm.transpose(-1, -2) @ Cm).to(cdt)
        gC = (gCBm @ Bm).to(cdt)
        # 2./3. recompute the chunk-end states and redo the (small) state passing with autograd
        w = _ChunkScan._state_weights(a, last_doc)
        states, xw = _ChunkScan._states(xdt, w, B)
        if compiling:
            start, _ = _ChunkScan._pass_states(states, a[..., -1], init, same_doc)
        else:
            with torch.enable_grad():
                leaves = [states.requires_grad_(), a[..., -1].detach().requires_grad_()]
                if init is not None:
                    leaves.append(init.detach().requires_grad_())
                start, final = _ChunkScan._pass_states(leaves[0], leaves[1], leaves[2] if init is not None else None,
                                                       same_doc)
        # 4. y_l += u_l C_l . S_start
        u = _ChunkScan._start_weights(a, start_doc)
        uT = u.permute(0, 1, 2, 4, 3)[..., None]  # [b, c, g, l, j, 1]
        gyT = gy.permute(0, 1, 3, 2, 4, 5)  # [b, c, g, l, j, p] view
        startm = start.detach().to(mdt).reshape(b, c, g, -1, j * p)
        yo = (Cm @ startm).view(b, c, g, l, j, p)
        ga += (gyT * yo).sum(-1).mul_(uT[..., 0]).transpose(-1, -2)
        del yo
        gyu = mul_to(gyT, uT, mdt).view(b, c, g, l, j * p)
        gC += gyu @ startm.transpose(-1, -2)
        gstart = (Cm.transpose(-1, -2) @ gyu).view(b, c, g, -1, j, p).to(cdt)
        del gyu, startm
        if compiling:
            gstates, ga_last, ginit = _ChunkScan._pass_states_backward(states, a[..., -1], init, same_doc,
                                                                       gstart, gfinal)
        else:
            grads = torch.autograd.grad([start, final], leaves, [gstart, gfinal])
            gstates, ga_last = grads[0], grads[1]
            ginit = grads[2] if init is not None else None
        # 2. states = B^T (xdt * w)
        gsm = gstates.to(mdt).reshape(b, c, g, -1, j * p)
        gxw = (Bm @ gsm).view(b, c, g, l, j, p)  # [b, c, g, l, j, p]
        gB += xw.view(b, c, g, l, j * p).to(mdt) @ gsm.transpose(-1, -2)
        gxdt = torch.empty_like(xdt)
        wT = w.permute(0, 1, 2, 4, 3)[..., None]
        _mul_into(gxw, wT, gxdt.permute(0, 1, 3, 2, 4, 5))
        gxdt.permute(0, 1, 3, 4, 2, 5).add_(gxh)
        gw = (gxw * xdt.permute(0, 1, 3, 2, 4, 5)).sum(-1).mul_(wT[..., 0]).transpose(-1, -2)  # [b, c, g, j, l]
        ga -= gw
        ga[..., -1] += gw.sum(-1)
        ga.mul_(LN2)  # every term above differentiated 2^x as 2^x: d/dx 2^x = ln 2 * 2^x
        ga[..., -1] += ga_last
        gdt, gA = _ChunkScan._log2_decays_backward(dt, A, ga)  # (autograd's values, no nested graph)
        return gxdt, gdt, gA, gC, gB, None, None, None, None, ginit, None


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

    fp32 also under autocast: dt * A, its cumsum and the decays (they span many orders of
    magnitude), the chunk states and their accumulation across chunks. For bf16 inputs the
    in-chunk products that only feed outputs take bf16 operands (fp32 accumulation), see
    ``_ChunkScan``; the returned state equals the fp32 scan's on the same inputs.
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

    cdt = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
    # operand dtype of the output products (see _ChunkScan): bf16 inputs keep them in bf16
    mdt = torch.bfloat16 if x.dtype == torch.bfloat16 else cdt
    dt = dt.to(cdt)
    if D is None:
        xdt, xD = (x * dt[..., None]).contiguous(), None  # [b, L, h, p] in cdt (bf16 x promotes exactly)
    else:
        xdt, xD = _ScanInputs.apply(x, dt, D.to(cdt))
    if pad:
        xdt = F.pad(xdt, (0, 0, 0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    xdt = xdt.view(b, c, cs, g, j, p)  # chunks of the natural layout (no copy)
    B = B.reshape(b, c, cs, g, n).transpose(2, 3).contiguous()  # [b, c, g, l, n], own dtype
    C = C.reshape(b, c, cs, g, n).transpose(2, 3).contiguous()

    causal = tril_mask(cs, 0, x.device)
    mask, last_doc, start_doc, same_doc = causal[None, None], None, None, None
    if seq_idx is not None:
        sidx = seq_idx
        if pad:
            # padded tail positions join the last document; their outputs are discarded and
            # they add nothing to any state (x * dt = 0 there, and their decay is exp(0) = 1)
            sidx = torch.cat([sidx, sidx[:, -1:].expand(b, pad)], dim=1)
        sidx = sidx.view(b, c, cs)
        mask = causal & (sidx[:, :, :, None] == sidx[:, :, None, :])  # [b, c, l, s]
        # document owning each state: the first token's for the initial state, else the
        # chunk's last token's; a state only flows to a chunk boundary of the same document
        doc = torch.cat([sidx[:, :1, 0], sidx[:, :, -1]], dim=1)  # [b, c+1]
        same_doc = doc[:, :, None] == doc[:, None, :]
        last_doc = (sidx == sidx[:, :, -1:])[:, :, None, None].to(cdt)  # [b, c, 1, 1, l]
        start_doc = (sidx == doc[:, :-1, None])[:, :, None, None].to(cdt)
    init = None
    if initial_state is not None:
        init = initial_state.to(cdt).view(b, g, j, p, n).permute(0, 1, 4, 2, 3)[:, None]  # [b, 1, g, n, j, p]
    y, final_state = _ChunkScan.apply(xdt, dt, A.to(cdt), C, B, mask, last_doc, start_doc, same_doc, init, mdt)

    y = y.view(b, c * cs, h, p)[:, :L]
    if xD is not None:
        y = y + xD
    if return_final_state:
        return y, final_state.permute(0, 1, 3, 4, 2).reshape(b, h, p, n)
    return y


class _ScanInputs(torch.autograd.Function):
    """(x * dt, x * D) in fp32 (x [b, L, h, p] promotes exactly; dt [b, L, h], D [h] fp32): the
    scan's input and its skip term. x's gradient, the sum of the two products' gradients, is
    formed in fp32 and rounded once to x's dtype as it is written (autograd would round each to
    bf16 and sum them in bf16); the gradients of dt and D are autograd's."""

    @staticmethod
    def forward(ctx, x, dt, D):
        ctx.save_for_backward(x, dt, D)
        return (x * dt[..., None]).contiguous(), x * D[None, None, :, None]

    @staticmethod
    def backward(ctx, gxdt, gxD):
        x, dt, D = ctx.saved_tensors
        gx_D, gx_dt = gxD * D[None, None, :, None], gxdt * dt[..., None]
        if x.dtype == gx_D.dtype or torch.compiler.is_compiling():
            gx = (gx_D + gx_dt).to(x.dtype)
        else:
            gx = torch.add(gx_D, gx_dt, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
        return gx, (gxdt * x).sum(3), (gxD * x).sum((0, 1, 3))


class _Cuts:
    """Where packed documents cut a depthwise conv of ``k`` taps, for the eager path: every tap
    runs over whole rows, and the positions a document start cuts short are put back to what
    they held before their first tap across it. A position keeps the taps 1..o that stay in its
    document, the first o of the loop, so that value is the one the masked taps would give (a
    masked tap adds a zero product; here nothing is added). ``fwd[o]`` / ``bwd[o]``: the (row,
    position) indices whose window back / ahead keeps exactly o taps (None where there are
    none); ``zero[s]``: the positions of tap s's gradient product that cross a document start.
    Built once per ``seq_idx`` tensor (``hybridtrain.ops.documents``)."""

    def __init__(self, starts: list[list[int]], k: int, L: int, device: torch.device):
        fwd = [([], []) for _ in range(k - 1)]
        bwd = [([], []) for _ in range(k - 1)]
        for r, row in enumerate(starts):
            ends = row[1:] + [L]
            for i in range(1, len(row)):  # the documents that start inside the row
                d, prev, nxt = row[i], row[i - 1], ends[i]
                for o in range(k - 1):
                    if d + o < nxt:
                        fwd[o][0].append(r), fwd[o][1].append(d + o)
                    if d - 1 - o >= prev:
                        bwd[o][0].append(r), bwd[o][1].append(d - 1 - o)

        def index(pairs):
            pairs = list(pairs)
            if not pairs:
                return None
            return tuple(torch.tensor(v, device=device) for v in zip(*pairs))

        self.fwd = [index(zip(*rc)) for rc in fwd]
        self.bwd = [index(zip(*rc)) for rc in bwd]
        # tap s's gradient product [b, L - s, d] at t - s, for the positions t >= s whose tap s
        # crosses a document start (they keep fewer than s taps)
        self.zero = [None] + [index((r, c - s) for o in range(s) for r, c in zip(*fwd[o]) if c >= s)
                              for s in range(1, k)]

    @staticmethod
    def of(seq_idx: torch.Tensor, k: int) -> "_Cuts":
        return per_documents(seq_idx, ("conv cuts", k), lambda t: _Cuts(document_starts(t), k, t.shape[1], t.device))


def _accumulate(out: torch.Tensor, src: torch.Tensor, taps: torch.Tensor, ahead: bool, keep, cuts) -> torch.Tensor:
    """``out`` (holding tap k-1's product) += the other taps' products of ``src`` [b, L, d]: tap
    s reads ``src`` s positions back (``ahead``: adds to the position s back, the transposed conv
    of the backward), within documents (``keep``: masks, or ``cuts``: a :class:`_Cuts`)."""
    k, L = taps.shape[0], src.shape[1]
    held = None if cuts is None else cuts.bwd if ahead else cuts.fwd
    saved = []
    for s in range(min(k, L)):
        if s:
            gs = src[:, s:] if ahead else src[:, :-s]
            if keep is not None and keep[s] is not None:
                gs = gs * keep[s]
            (out[:, :-s] if ahead else out[:, s:]).addcmul_(gs, taps[k - 1 - s])
        if held is not None and s < k - 1 and held[s] is not None:
            saved.append((held[s], out[held[s]]))
    for idx, value in saved:
        out.index_put_(idx, value)
    return out


class _CausalConv1d(torch.autograd.Function):
    """act(depthwise causal conv) with document restarts; saves only its inputs (the pre-
    activation is recomputed in backward, k elementwise passes) instead of one [b, d, L] tensor
    per tap. x [b, d, L] (any strides), weight [d, k], bias [d] or None, seq_idx [b, L] or None.

    Computed channels-last ([b, L, d], the in_proj output's own layout) with the taps as [k, d]
    rows, so that every elementwise pass and reduction runs along contiguous channels. Document
    restarts: eager, the few positions a document start cuts are put back (:class:`_Cuts`);
    under ``torch.compile``, each tap's input is masked (no host read)."""

    @staticmethod
    def _restarts(seq_idx, k, L):
        """(keep, cuts): keep[s] [b, L - s, 1] (tap s, reaching s steps back, stays inside the
        document) when compiling, else the :class:`_Cuts` of ``seq_idx``; (None, None) without."""
        if seq_idx is None:
            return None, None
        if torch.compiler.is_compiling():
            return [None] + [(seq_idx[:, s:] == seq_idx[:, :-s])[:, :, None] for s in range(1, min(k, L))], None
        return None, _Cuts.of(seq_idx, k)

    @staticmethod
    def _conv(x, taps, bias, restarts, out_dtype=None):
        """x [b, L, d] (bf16 or fp32: it promotes exactly in the fp32 products, no fp32 copy),
        taps [k, d] (tap k-1 is the current position) -> fp32 (fp64 for fp64 taps), or
        ``out_dtype``: rounded as the bias is added (one pass, the values of a cast after)."""
        out = _accumulate(x * taps[-1], x, taps, False, *restarts)
        if out_dtype in (None, out.dtype):
            return out if bias is None else out.add_(bias)
        if bias is None or torch.compiler.is_compiling():
            return (out if bias is None else out + bias).to(out_dtype)
        return torch.add(out, bias, out=torch.empty(out.shape, dtype=out_dtype, device=out.device))

    @staticmethod
    def _inputs(x, weight, bias):
        """(x as [b, L, d] in its own dtype, fp32 taps [k, d], fp32 bias) (fp64 for fp64 x)."""
        cdt = torch.promote_types(x.dtype, torch.float32)
        bias = None if bias is None else bias.to(cdt)
        return x.transpose(1, 2), weight.t().contiguous().to(cdt), bias

    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, silu):
        ctx.save_for_backward(x, weight, bias, seq_idx)
        ctx.silu = silu
        xc, taps, bc = _CausalConv1d._inputs(x, weight, bias)
        restarts = _CausalConv1d._restarts(seq_idx, weight.shape[1], x.shape[-1])
        out = _CausalConv1d._conv(xc, taps, bc, restarts, x.dtype)  # rounded before the activation,
        out = F.silu(out) if silu else out                          # like the reference's nn.Conv1d
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, gout):
        x, weight, bias, seq_idx = ctx.saved_tensors
        k, L = weight.shape[1], x.shape[-1]
        xc, taps, bc = _CausalConv1d._inputs(x, weight, bias)
        restarts = _CausalConv1d._restarts(seq_idx, k, L)
        keep, cuts = restarts
        g = gout.transpose(1, 2)  # [b, L, d]
        if ctx.silu:  # (a bf16 gout promotes exactly in the fp32 product)
            g = g * silu_grad(_CausalConv1d._conv(xc, taps, bc, restarts))
        else:  # fp32 before the products with the (bf16) input
            g = g.to(taps.dtype)
        gx = _accumulate(g * taps[k - 1], g, taps, True, keep, cuts)
        gw = torch.empty_like(taps)
        gw[k - 1] = (g * xc).sum((0, 1))
        for s in range(1, min(k, L)):
            gs = g[:, s:] if keep is None or keep[s] is None else g[:, s:] * keep[s]
            p = gs * xc[:, :-s]
            if cuts is not None and cuts.zero[s] is not None:  # what a masked product holds
                p.index_put_(cuts.zero[s], p[cuts.zero[s]].mul_(0))
            gw[k - 1 - s] = p.sum((0, 1))
        if k > L:
            gw[: k - L] = 0
        gb = None if bias is None else g.sum((0, 1)).to(bias.dtype)
        # (gx sums the taps' products in fp32; this is its one rounding to the input's dtype)
        return gx.transpose(1, 2).to(x.dtype), gw.t().to(weight.dtype), gb, None, None


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv. x [b, d, L], weight [d, k], bias [d]; taps that would reach into an
    earlier document (per ``seq_idx`` [b, L]) are dropped, so the conv restarts at each document.
    Accumulated in fp32 (fp64 for fp64 inputs); returns x's dtype."""
    if activation not in ("silu", "swish", None):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of 'silu', 'swish', None")
    return _CausalConv1d.apply(x, weight, bias, seq_idx, activation is not None)
