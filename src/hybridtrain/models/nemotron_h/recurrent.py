"""One-token steps of the Mamba2 mixer in pure PyTorch (cached decoding): the causal conv over a
window of the previous inputs and the recurrent form of the SSD scan (``ssd.ssd_reference``'s
update). O(1) work and memory per token. The CUDA kernels behind ``kernels.conv_step`` /
``kernels.ssd_step`` compute the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_step_torch(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(depthwise conv) of one token x [b, d] over ``conv_state`` [b, d, k - 1] (the previous
    k - 1 inputs, oldest first; shifted in place). Accumulated in fp32 and rounded to x's dtype
    before the activation, as ``ssd.causal_conv1d_torch``."""
    window = torch.cat([conv_state, x.to(conv_state.dtype)[:, :, None]], dim=-1)  # [b, d, k]
    conv_state.copy_(window[:, :, 1:])
    cdt = torch.promote_types(x.dtype, torch.float32)
    out = (_as(window, cdt) * _as(weight, cdt)).sum(-1)
    if bias is not None:
        out += _as(bias, cdt)
    return F.silu(_as(out, x.dtype))


def ssd_step_torch(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """S = exp(dt A) S + dt x B^T; y = S C + D x for one token. state [b, h, p, n] fp32 (updated
    in place); x [b, h, p]; dt [b, h] (after softplus and clamp); A [h]; B, C [b, g, n], head
    ``i`` reading group ``i // (h / g)``. Returns y [b, h, p] in fp32.

    B and C broadcast over the heads of their group (no repeat per head); the update and the
    read-out are elementwise passes over the state (on CPU a fraction of the time of ``bmm`` /
    ``einsum``, whose products here have one column)."""
    b, h, p, n = state.shape
    g = B.shape[1]
    cdt = state.dtype
    x, dt = _as(x, cdt), _as(dt, cdt)
    decay = torch.exp(dt * _as(A, cdt))  # [b, h]
    state.mul_(decay[:, :, None, None])
    s = state.view(b, g, h // g, p, n)  # a group's heads
    s.addcmul_((dt[:, :, None] * x).view(b, g, h // g, p, 1), _as(B, cdt).view(b, g, 1, 1, n))
    y = (s * _as(C, cdt).view(b, g, 1, 1, n)).sum(-1).view(b, h, p)
    return y if D is None else y.addcmul_(_as(D, cdt)[:, None], x)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatch when it already is (one-token steps: many tiny ops)."""
    return t if t.dtype == dtype else t.to(dtype)
