"""fp32 islands under mixed precision, and the SiLU derivative shared by the hand-written
backwards.

Under ``torch.autocast(bf16)`` every matmul / einsum / linear runs in bf16, even when its inputs
were explicitly taken to fp32. The few places whose numerics need fp32 (the MoE router, the SSD
scan) run inside :func:`fp32_region`, which switches autocast off for the device of a tensor;
they then take their inputs to fp32 themselves. Outside autocast it does nothing.
"""

from __future__ import annotations

import contextlib

import torch


def fp32_region(t: torch.Tensor):
    """A context in which autocast is off for ``t``'s device (a no-op when it is not on)."""
    device_type = t.device.type
    if device_type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in when ``t`` is its input: autocast's when autocast is
    on for ``t``'s device, else ``t``'s own. Producers write their output in it directly instead
    of leaving a full-size copy to autocast."""
    device_type = t.device.type
    if device_type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def mul_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, inplace: bool = False) -> torch.Tensor:
    """``a * b`` computed in a's and b's promoted dtype, as a contiguous ``dtype`` tensor; where
    ``dtype`` is narrower, rounded as it is stored (one pass: the values of ``(a * b).to(dtype)``
    without a full-size fp32 product beside its bf16 copy). ``inplace``: into ``a`` (contiguous)
    where the dtypes agree."""
    if dtype == torch.promote_types(a.dtype, b.dtype):
        return a.mul_(b) if inplace else (a * b).contiguous()
    if torch.compiler.is_compiling():  # (the compiler fuses the two; dynamo traces no out=)
        return (a * b).to(dtype, memory_format=torch.contiguous_format)
    return torch.mul(a, b, out=torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=dtype, device=a.device))


def silu_grad(x: torch.Tensor) -> torch.Tensor:
    """d silu(x) / dx = sigmoid(x) * (1 + x * (1 - sigmoid(x))), for hand-written backwards."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))

