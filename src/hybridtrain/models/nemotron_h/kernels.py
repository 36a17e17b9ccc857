"""The one dispatch point between the pure-PyTorch Mamba2 path and the optional kernels
(``mamba_ssm``'s Triton SSD and state update, ``causal_conv1d``'s CUDA C++ conv; extra
``hybridtrain[cuda]``).

``training.mamba_kernels`` (``ops.backend.settings().mamba_kernels``) chooses: ``auto`` -> the
kernels where they import, for CUDA tensors (a CUDA run without them warns, naming the package,
the reason and the fix); ``True`` -> always (a kernel that does not import refuses the run; on
a CPU mamba_ssm's Triton kernels run under Triton's interpreter, ``TRITON_INTERPRET=1``, and
the conv, CUDA C++ only, takes the PyTorch path); ``False`` -> the PyTorch path. Both paths
take the same arguments, including ``seq_idx`` for packed documents, and compute the same
function. :func:`paths` says which one each part runs (``ops.backend.kernel_paths``).

The kernels are reached through ``torch.library`` custom ops (:mod:`.kernel_ops`), so a
compiled block stays one graph. :mod:`.kernel_loader` finds them by module name when first
needed (also where ``import mamba_ssm`` fails on its C++ extension), so a test can stand fake
modules in ``sys.modules`` (and call :func:`forget_kernels`).

The calls follow the releases people install: mamba_ssm 2.2.2 - 2.3.x (2.2.0/2.2.1's SSD
backward returns too few gradients; before 2.2.5 a warning: no exp clamp nor seq_idx fix,
upstream PRs #713 and #746) and causal_conv1d 1.4 - 1.6; ``tests/unit/test_mamba_kernel_contracts.py``
holds their signatures. ``selective_state_update`` reads ``dt_bias.stride()`` and ``D.stride()``
unconditionally in every one of them: both are always tensors here.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from hybridtrain.ops import backend, triton_interpret

from . import kernel_ops
from .kernel_loader import (KERNELS, TRITON_PACKAGES, _failures, _init_skipped, conv_has_own_ops,  # noqa: F401
                            forget_loaded, kernel, mamba_ssm_floor_problem, package_version)
from .numerics import fp32_region
from .mamba_step import conv_step_torch, ssd_step_torch
from .ssd import causal_conv1d_torch, ssd_chunked

log = logging.getLogger(__name__)

# the parts :func:`paths` reports -> the kernels each needs
PARTS = {"ssd": ("ssd_fwd", "ssd_bwd"), "state_update": ("selective_state_update",),
         "conv": ("causal_conv1d_fn", "causal_conv1d_update")}
_AUTOTUNED = {"ssd_fwd"}  # Triton kernels that autotune on first use
_announced: set[str] = set()

def forget_kernels() -> None:
    """Look the kernels up again on next use (after installing one, or in tests)."""
    forget_loaded()
    _announced.clear()


def kernels_available() -> dict[str, bool]:
    return {name: kernel(name) is not None for name in KERNELS}


def _missing(name: str) -> str:
    module, attr, package = KERNELS[name]
    return (f"{module}.{attr} does not import ({_failures.get(name, 'not installed')}); "
            f"pip install {package}" + (">=2.2.5" if package == "mamba-ssm" else "")
            + " (or 'hybridtrain[cuda]')")


def _use(name: str, x: torch.Tensor):
    """The kernel to call for ``x`` under ``training.mamba_kernels``, or None (PyTorch path)."""
    mode = backend.settings().mamba_kernels
    if mode is False or (mode == "auto" and not x.is_cuda):
        return None
    fn = kernel(name)
    if fn is None:
        if mode is True and (x.is_cuda or KERNELS[name][2] in TRITON_PACKAGES):
            raise ValueError(f"training.mamba_kernels is true but {_missing(name)}, or set "
                             "training.mamba_kernels to auto")
        if x.is_cuda and name not in _announced and not torch.compiler.is_compiling():
            _announced.add(name)
            log.warning("Mamba2 runs %s on the PyTorch path: %s", name, _missing(name))
        return None
    if name not in _announced and not torch.compiler.is_compiling():
        _announced.add(name)
        log.info("Mamba2: %s from %s", name, KERNELS[name][0])
        if name in _AUTOTUNED:
            log.warning("mamba_ssm Triton kernels autotune on first use (can take ~1-2 min per new "
                        "sequence shape); later steps reuse the tuned configurations")
    return fn


def paths(device: torch.device) -> dict[str, str]:
    """Where the SSD, the decoding state update and the conv come from in a run on ``device``
    under ``training.mamba_kernels``. Refuses (``ValueError``) where ``true`` asks for a kernel
    that does not import; warns where ``auto`` on CUDA falls back to PyTorch."""
    mode = backend.settings().mamba_kernels
    if mode is True or (mode == "auto" and device.type == "cuda"):
        for name in KERNELS:  # looked up now, not first inside a block being compiled
            kernel(name)
    out = {}
    for part, names in PARTS.items():
        package = KERNELS[names[0]][2]
        triton = package in TRITON_PACKAGES
        if mode is False:
            out[part] = "PyTorch (training.mamba_kernels=false)"
            continue
        if device.type != "cuda" and (mode == "auto" or not triton):
            why = "auto: kernels for CUDA tensors" if mode == "auto" else f"{package} is CUDA C++ only"
            out[part] = f"PyTorch ({why})"
            continue
        missing = [n for n in names if kernel(n) is None]
        if missing:
            if mode is True:
                raise ValueError(f"training.mamba_kernels is true but {_missing(missing[0])}, or set "
                                 "training.mamba_kernels to auto")
            log.warning("training.mamba_kernels=auto on %s: Mamba2's %s runs on the PyTorch path (slower: "
                        "0.9x the kernel path's step on an H100) because %s", device.type, part,
                        _missing(missing[0]))
            out[part] = f"PyTorch ({package} does not import)"
            continue
        out[part] = _describe(part, names[0], device)
    return out


def _describe(part: str, name: str, device: torch.device) -> str:
    module, attr, package = KERNELS[name]
    text = f"{package} {package_version(package) or '(version unknown)'} {module}.{attr}"
    top = module.partition(".")[0]
    if top in _init_skipped:
        text += " (package __init__ skipped)"
    if part == "conv":
        text += "" if conv_has_own_ops() else " via hybridtrain::causal_conv1d"
    else:
        text += f" via hybridtrain::{'ssd_scan' if part == 'ssd' else 'ssd_state_update'}"
    if package in TRITON_PACKAGES and triton_interpret.interpreting():
        text += ", Triton interpreter"
    return text


backend.register_kernel_paths(paths)


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
    if conv_has_own_ops():
        return fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    return kernel_ops.causal_conv1d(x, weight, bias, seq_idx)


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
    if _use("ssd_fwd", x) is not None:
        if seq_idx is not None:
            seq_idx = seq_idx.to(torch.int32).contiguous()
        y, final = kernel_ops.ssd_scan(x, dt, A, B, C, D, dt_bias, initial_state, seq_idx, chunk_size,
                                       float(dt_limit[0]), float(dt_limit[1]))
        return (y, final) if return_final_state else y
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
    if conv_has_own_ops():
        return fn(x.to(conv_state.dtype), conv_state, weight, bias, activation="silu").to(x.dtype)
    return kernel_ops.causal_conv1d_update(x.to(conv_state.dtype), conv_state, weight, bias).to(x.dtype)


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
        if _use("selective_state_update", x) is None:
            return ssd_step_torch(state, x, dt, A, B, C, D)
        return kernel_ops.ssd_state_update(state, x, dt, A, B, C, D)
