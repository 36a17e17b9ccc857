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
    cdt = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat([conv_state.to(cdt), x.to(cdt)[:, :, None]], dim=-1)  # [b, d, k]
    out = (window * weight.to(cdt)).sum(-1)
    if bias is not None:
        out = out + bias.to(cdt)
    conv_state.copy_(window[:, :, 1:])
    return F.silu(out.to(x.dtype))


def ssd_step_torch(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """S = exp(dt A) S + dt x B^T; y = S C + D x for one token. state [b, h, p, n] fp32 (updated
    in place); x [b, h, p]; dt [b, h] (after softplus and clamp); A [h]; B, C [b, g, n], head
    ``i`` reading group ``i // (h / g)``. Returns y [b, h, p] in fp32."""
    h = x.shape[1]
    cdt = state.dtype
    x, dt = x.to(cdt), dt.to(cdt)
    Bh = B.to(cdt).repeat_interleave(h // B.shape[1], dim=1)  # [b, h, n]
    Ch = C.to(cdt).repeat_interleave(h // C.shape[1], dim=1)
    decay = torch.exp(dt * A.to(cdt))  # [b, h]
    state.mul_(decay[:, :, None, None]).add_((dt[:, :, None] * x)[..., None] * Bh[:, :, None, :])
    y = torch.einsum("bhpn,bhn->bhp", state, Ch)
    return y if D is None else y + D.to(cdt)[None, :, None] * x
