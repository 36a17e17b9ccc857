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
    return torch.mul(a, b, out=torch.empty(broadcast_shape(a, b), dtype=dtype, device=a.device))


def broadcast_shape(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """The shape of ``a * b`` (two broadcastable tensors): ``torch.broadcast_shapes`` without its
    general checks, which cost more than a small product itself."""
    n = max(a.dim(), b.dim())
    sa = [1] * (n - a.dim()) + list(a.shape)
    sb = [1] * (n - b.dim()) + list(b.shape)
    return [x if y == 1 else y for x, y in zip(sa, sb)]


_MASKS: dict[tuple, torch.Tensor] = {}


def tril_mask(size: int, diagonal: int, device: torch.device, inverted: bool = False) -> torch.Tensor:
    """``torch.tril(ones(size, size, bool), diagonal)`` (``inverted``: its negation), built once
    per size, diagonal and device: the causal masks every forward of the scan would build anew
    (a compiled block builds its own)."""
    def build():
        mask = torch.tril(torch.ones(size, size, device=device, dtype=torch.bool), diagonal=diagonal)
        return ~mask if inverted else mask

    if torch.compiler.is_compiling():
        return build()
    key = (size, diagonal, torch.device(device), inverted)
    mask = _MASKS.get(key)
    if mask is None:  # a plain tensor even when first built under inference mode (decoding)
        with torch.inference_mode(False), torch.no_grad():
            mask = _MASKS[key] = build()
    return mask


def silu_grad(x: torch.Tensor) -> torch.Tensor:
    """d silu(x) / dx = sigmoid(x) * (1 + x * (1 - sigmoid(x))), for hand-written backwards."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))

