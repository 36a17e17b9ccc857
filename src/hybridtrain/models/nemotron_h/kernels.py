"""The one dispatch point between the pure-PyTorch Mamba2 path and the optional CUDA kernels
(``causal_conv1d`` and ``mamba_ssm``, extra ``hybridtrain[cuda]``).

The kernels are used when they import and the tensors are on CUDA, unless disabled with
:func:`set_kernels_enabled` or, when that was not called, the environment variable
``HYBRIDTRAIN_MAMBA_KERNELS=0`` (read at each call). Both paths take the same arguments,
including ``seq_idx`` for packed documents, and compute the same function.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .numerics import fp32_region
from .recurrent import conv_step_torch, ssd_step_torch
from .ssd import causal_conv1d_torch, ssd_chunked

try:  # pragma: no cover - not installed on CPU machines
    from causal_conv1d import causal_conv1d_fn as _causal_conv1d_fn
except Exception:  # ImportError, or a broken CUDA build
    _causal_conv1d_fn = None
try:  # pragma: no cover
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as _mamba_chunk_scan_combined
except Exception:
    _mamba_chunk_scan_combined = None
try:  # pragma: no cover
    from causal_conv1d import causal_conv1d_update as _causal_conv1d_update
except Exception:
    _causal_conv1d_update = None
try:  # pragma: no cover
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as _selective_state_update
except Exception:
    _selective_state_update = None

_enabled: bool | None = None  # None: as HYBRIDTRAIN_MAMBA_KERNELS says (default on)


def set_kernels_enabled(enabled: bool | None) -> None:
    """Turn the CUDA kernels on or off for this process (None: back to the environment's say)."""
    global _enabled
    _enabled = None if enabled is None else bool(enabled)


def kernels_enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get("HYBRIDTRAIN_MAMBA_KERNELS", "1").lower() not in ("0", "false")


def kernels_available() -> dict[str, bool]:
    return {"causal_conv1d": _causal_conv1d_fn is not None, "mamba_ssm": _mamba_chunk_scan_combined is not None,
            "causal_conv1d_update": _causal_conv1d_update is not None,
            "selective_state_update": _selective_state_update is not None}


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_idx: torch.Tensor | None
) -> torch.Tensor:
    """SiLU(causal depthwise conv) over x [b, d, L]; weight [d, k]."""
    if x.is_cuda and _causal_conv1d_fn is not None and kernels_enabled():  # pragma: no cover
        if seq_idx is not None:
            # the kernel's seq_idx path wants channel-last memory; in_proj output already is
            x = x if x.stride(1) == 1 else x.transpose(1, 2).contiguous().transpose(1, 2)
            seq_idx = seq_idx.to(torch.int32).contiguous()
        return _causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    return causal_conv1d_torch(x, weight, bias, seq_idx, activation="silu")


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    seq_idx: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
):
    """y = SSD(x, softplus(dt + dt_bias) clamped to dt_limit, A, B, C) + D x.

    x [b, L, h, p], dt [b, L, h] (raw projection), A [h], B/C [b, L, g, n]. Returns [b, L, h, p]
    (and the final state [b, h, p, n], fp32, when ``return_final_state``); ``initial_state``
    [b, h, p, n] is the state before the first token."""
    if x.is_cuda and _mamba_chunk_scan_combined is not None and kernels_enabled():  # pragma: no cover
        if seq_idx is not None:
            seq_idx = seq_idx.to(torch.int32).contiguous()
        return _mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=dt_limit, seq_idx=seq_idx, initial_states=initial_state,
            return_final_states=return_final_state,
        )
    with fp32_region(dt):  # softplus(dt + dt_bias) and the scan in fp32 (see ssd_chunked)
        return ssd_chunked(x, discretize_dt(dt, dt_bias, dt_limit), A, B, C, chunk_size, D=D,
                           seq_idx=seq_idx, initial_state=initial_state,
                           return_final_state=return_final_state)


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """The scan's step size: softplus(dt + dt_bias) clamped to ``dt_limit``, in fp32 (fp64 for
    fp64 inputs)."""
    cdt = torch.promote_types(dt.dtype, torch.float32)
    with fp32_region(dt):
        return F.softplus(dt.to(cdt) + dt_bias.to(cdt)).clamp(min=dt_limit[0], max=dt_limit[1])


def conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """One token of SiLU(causal depthwise conv): x [b, d], the window of the previous inputs
    ``conv_state`` [b, d, k - 1] (updated in place). Returns [b, d] in x's dtype."""
    if x.is_cuda and _causal_conv1d_update is not None and kernels_enabled():  # pragma: no cover
        # the kernel keeps a window of the k - 1 previous inputs as its state, as here
        return _causal_conv1d_update(x, conv_state, weight, bias, activation="silu")
    return conv_step_torch(x, conv_state, weight, bias)


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """One token of the scan: ``state`` [b, h, p, n] fp32 (updated in place), x [b, h, p], dt
    [b, h] (raw projection), A [h], B/C [b, g, n]. Returns y [b, h, p] fp32, as :func:`ssd_scan`."""
    with fp32_region(dt):
        dt = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_limit[0], max=dt_limit[1])
        if x.is_cuda and _selective_state_update is not None and kernels_enabled():  # pragma: no cover
            h, p, n = state.shape[1:]
            # dt already has its bias, softplus and clamp (the kernel has no clamp)
            y = _selective_state_update(
                state, x.float(), dt[..., None].expand(-1, -1, p), A.float()[:, None, None].expand(h, p, n),
                B.float(), C.float(), D=D.float()[:, None].expand(h, p), dt_softplus=False,
            )
            return y.float()
        return ssd_step_torch(state, x, dt, A, B, C, D)
