"""fp32 islands under mixed precision, the row alignment of CPU low-precision GEMMs, the SiLU
derivative shared by the hand-written backwards, and the base-2 constants of the exp2 paths
(torch's CPU exp2 is ~4x cheaper than exp: 0.14 vs 0.63 ms per 2^20 floats measured here).

Under ``torch.autocast(bf16)`` every matmul / einsum / linear runs in bf16, even when its inputs
were explicitly taken to fp32. The few places whose numerics need fp32 (the MoE router, the SSD
scan) run inside :func:`fp32_region`, which switches autocast off for the device of a tensor;
they then take their inputs to fp32 themselves. Outside autocast it does nothing.
"""

from __future__ import annotations

import contextlib
import math

import torch

LOG2E, LN2 = math.log2(math.e), math.log(2.0)  # exp(x) = 2^(x log2 e); d/dx 2^x = ln 2 * 2^x


def fp32_region(t: torch.Tensor):
    """A context in which autocast is off for ``t``'s device (a no-op when it is not on)."""
    device_type = t.device.type
    if device_type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def silu_grad(x: torch.Tensor) -> torch.Tensor:
    """d silu(x) / dx = sigmoid(x) * (1 + x * (1 - sigmoid(x))), for hand-written backwards."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


CPU_LOWP_ROW_MULTIPLE = 64


def gemm_row_multiple(device: torch.device, dtype: torch.dtype) -> int:
    """Row count to pad a GEMM operand to when its rows vary from step to step (routed tokens,
    label tokens). torch's CPU bf16/fp16 GEMMs are oneDNN kernels built and cached per shape:
    unaligned, every new count builds a kernel (time) and the cache grows for thousands of
    steps (measured ~20 MB per step with 8 experts). Multiples of 64 keep the shapes few enough
    that live memory stays flat (16 still grew ~2 MB per step at 4 x 512 tokens) and were as fast
    or faster on the 48M MoE (0.41 vs 0.43-0.46 s per bf16 step). 1 (no padding) elsewhere."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return CPU_LOWP_ROW_MULTIPLE
    return 1
