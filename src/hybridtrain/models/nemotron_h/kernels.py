"""The one dispatch point between the pure-PyTorch Mamba2 path and the optional CUDA kernels
(``causal_conv1d`` and ``mamba_ssm``, extra ``hybridtrain[cuda]``).

``training.mamba_kernels`` (``ops.backend.settings().mamba_kernels``) chooses: ``auto`` -> the
kernels where they import, for CUDA tensors; ``True`` -> always (a missing package raises);
``False`` -> the PyTorch path. Both paths take the same arguments, including ``seq_idx`` for
packed documents, and compute the same function.

The kernels are looked up by module name when first needed (:func:`kernel`), so a test can stand
fake modules in ``sys.modules`` (and call :func:`forget_kernels`). The calls below follow the
releases people install: mamba_ssm 2.2.2 - 2.3.x (2.2.0/2.2.1's SSD backward returns too few
gradients) and causal_conv1d 1.4 - 1.6; ``tests/unit/test_mamba_kernel_contracts.py`` holds
their signatures. ``selective_state_update`` reads ``dt_bias.stride()`` and ``D.stride()``
unconditionally in every one of them: both are always tensors here.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F

from hybridtrain.ops import backend

from .numerics import fp32_region
from .recurrent import conv_step_torch, ssd_step_torch
from .ssd import causal_conv1d_torch, ssd_chunked

log = logging.getLogger(__name__)

# name -> (module, attribute, package to install)
KERNELS = {
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update", "causal-conv1d"),
    "mamba_chunk_scan_combined": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined",
                                  "mamba-ssm"),
    "selective_state_update": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update",
                               "mamba-ssm"),
}
_AUTOTUNED = {"mamba_chunk_scan_combined"}  # Triton kernels that autotune on first use
_announced: set[str] = set()


@functools.cache
def kernel(name: str):
    """The kernel function ``name`` (a key of :data:`KERNELS`), or None where its package does
    not import (not installed, or a CUDA build that fails to load)."""
    module, attr, _ = KERNELS[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or a broken CUDA build
        log.debug("%s unavailable: %s", name, e)
        return None


def forget_kernels() -> None:
    """Look the kernels up again on next use (after installing one, or in tests)."""
    kernel.cache_clear()
    _announced.clear()


def kernels_available() -> dict[str, bool]:
    return {name: kernel(name) is not None for name in KERNELS}


def _use(name: str, x: torch.Tensor):
    """The kernel to call for ``x`` under ``training.mamba_kernels``, or None (PyTorch path)."""
    mode = backend.settings().mamba_kernels
    if mode is False or (mode == "auto" and not x.is_cuda):
        return None
    fn = kernel(name)
    if fn is None and mode is True:
        raise ValueError(f"training.mamba_kernels is true but {KERNELS[name][0]}.{KERNELS[name][1]} "
                         f"does not import; pip install {KERNELS[name][2]} (or 'hybridtrain[cuda]') "
                         "or set training.mamba_kernels to auto")
    if fn is not None and name not in _announced:
        _announced.add(name)
        log.info("Mamba2: %s from %s", name, KERNELS[name][0])
        if name in _AUTOTUNED:
            log.warning("mamba_ssm Triton kernels autotune on first use (can take ~1-2 min per new "
                        "sequence shape); later steps reuse the tuned configurations")
    return fn


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_idx: torch.Tensor | None
) -> torch.Tensor:
    """SiLU(causal depthwise conv) over x [b, d, L]; weight [d, k]."""
    fn = _use("causal_conv1d_fn", x)
    channel_last_ok = x.shape[1] % 8 == 0  # the kernel's channel-last layout needs d % 8 == 0
    if fn is None or not 2 <= weight.shape[-1] <= 4 or (seq_idx is not None and not channel_last_ok):
        return causal_conv1d_torch(x, weight, bias, seq_idx, activation="silu")
    if bias is not None:  # the kernel wants the bias in the weight's dtype, contiguous
        bias = bias.to(weight.dtype).contiguous()
    if channel_last_ok:  # [b, L, d] memory (in_proj's output already is), strides multiples of 8
        if not (x.stride(1) == 1 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0):
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif x.stride(2) != 1:
        x = x.contiguous()
    if seq_idx is not None:  # (only in the channel-last layout)
        seq_idx = seq_idx.to(torch.int32).contiguous()
    return fn(x, weight, bias, seq_idx=seq_idx, activation="silu")


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
    fn = _use("mamba_chunk_scan_combined", x)
    if fn is not None:
        if seq_idx is not None:
            seq_idx = seq_idx.to(torch.int32).contiguous()
        return fn(
            x, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=tuple(dt_limit), seq_idx=seq_idx, initial_states=initial_state,
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
    fn = _use("causal_conv1d_update", x)
    if fn is None:
        return conv_step_torch(x, conv_state, weight, bias)
    # the kernel keeps a window of the k - 1 previous inputs as its state, as here; it wants x in
    # the state's dtype and the bias in the weight's
    if bias is not None:
        bias = bias.to(weight.dtype).contiguous()
    return fn(x.to(conv_state.dtype), conv_state, weight, bias, activation="silu").to(x.dtype)


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
        fn = _use("selective_state_update", x)
        if fn is None:
            return ssd_step_torch(state, x, dt, A, B, C, D)
        h, p, n = state.shape[1:]
        # dt already has its bias, softplus and clamp (the kernel has no clamp): a zero dt_bias
        # (a tensor: every release reads its strides) and dt_softplus=False. Per-head values
        # broadcast over head_dim (stride 0: the kernel's tied-head_dim path).
        per_head = lambda t: t[:, None].expand(h, p)  # noqa: E731
        y = fn(
            state, x.float(), dt[..., None].expand(-1, -1, p), A.float()[:, None, None].expand(h, p, n),
            B.float(), C.float(), D=per_head(D.float()), z=None,
            dt_bias=per_head(torch.zeros(h, dtype=torch.float32, device=state.device)), dt_softplus=False,
        )
        return y.float()
