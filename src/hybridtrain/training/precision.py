"""Mixed precision: which dtype a run computes in, the autocast context, and the export dtype.

Strategy: **fp32 master weights and optimizer state, bf16 compute under
``torch.autocast``**. The parameters are never stored in bf16 during training; autocast runs
each matmul / conv / attention in bf16 on bf16 copies of its operands, while the residual
stream, the gradients, the gradient norm and the AdamW update stay fp32. The numerically
sensitive parts stay fp32 inside the model whatever the mode (router logits, sigmoid, correction
bias and top-k; the SSD scan's dt / A / exp / cumsum and state accumulation; RMSNorm and gated
group-norm statistics: the models' fp32 regions), and so do the log-softmax /
cross-entropy (``ops/loss.py``).

The alternative, bf16 parameters with separate fp32 master copies in the optimizer, was
measured on the 2-core CPU (``benchmarks/bf16_vs_fp32.py --strategies``, ~48M MoE, 512 tokens,
one thread): within 4 % of autocast's speed (2.20x vs 2.12x fp32), but its bf16 residual stream
drifts: after 5 steps its loss is 0.114 away from fp32's, autocast's 0.0014; and it needs an
extra weight copy plus a trainer/optimizer/checkpoint rewrite.
On GPUs under FSDP2 the ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gives
bf16 compute copies of the fp32 shards for free; autocast on top of it is harmless.

``training.dtype``:

* ``auto``: bf16 where it pays off on the device, fp32 otherwise; the rule and its measurements
  are hardware tuning and live in :func:`hybridtrain.ops.backend.auto_dtype` (``cpu_bf16``:
  ``training.cpu_bf16``, whether this CPU's bf16 matmuls are fast; ``auto`` detects it). The
  choice and its reason are logged.
* ``float32`` / ``bfloat16``: as asked. ``float16`` is refused: it needs dynamic loss scaling,
  which hybridtrain does not implement.

``checkpoint.save_dtype`` (HF exports): ``auto`` writes the dtype the weights were loaded from
(a bf16 Hub checkpoint comes back as bf16; a model built from scratch as its parameter dtype),
or ``float32`` / ``bfloat16`` / ``float16``. The sharded ``step_N/`` training checkpoints always
hold the fp32 masters and optimizer state (exact resume).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from hybridtrain.ops.backend import auto_dtype, cpu_has_native_bf16

logger = logging.getLogger(__name__)

__all__ = [
    "parse_dtype",
    "resolve_dtype",
    "autocast_dtype",
    "autocast_context",
    "resolve_save_dtype",
]

_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """``'bf16'``, ``'bfloat16'``, ``'torch.bfloat16'``, ``torch.bfloat16`` ... -> the dtype."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).lower().removeprefix("torch.")
    if name not in _NAMES:
        raise ValueError(f"{key}: unknown dtype {value!r}; use one of auto, float32, bfloat16")
    return _NAMES[name]


# -- training dtype -----------------------------------------------------------------------------
def resolve_dtype(name: str | torch.dtype, device: torch.device | str,
                  hidden_size: int | None = None, cpu_bf16: bool | str = "auto") -> torch.dtype:
    """``training.dtype`` -> the compute dtype on ``device`` (see the module docstring).
    ``hidden_size``: the model's, for ``auto`` on CPU (None: not considered); ``cpu_bf16``:
    ``training.cpu_bf16``."""
    device = torch.device(device)
    if not isinstance(name, torch.dtype) and str(name).lower() == "auto":
        dtype, why = auto_dtype(device, hidden_size, cpu_bf16)
        logger.info("training.dtype=auto -> %s on %s (%s); parameters and optimizer state stay "
                    "float32", str(dtype).removeprefix("torch."), device.type, why)
        return dtype
    dtype = parse_dtype(name, "training.dtype")
    if dtype == torch.float16:
        raise ValueError(
            "training.dtype=float16 needs dynamic loss scaling, which hybridtrain does not "
            "implement; use bfloat16 (GPUs from Ampere on, CPUs with avx512_bf16/AMX) or float32")
    if dtype == torch.bfloat16 and device.type == "cpu":
        native, why = cpu_has_native_bf16(cpu_bf16)
        if not native:
            logger.warning("training.dtype=bfloat16 on a CPU without native bf16 matmul (%s): "
                           "expect it to be slower than float32", why)
    return dtype


def autocast_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to autocast to (None: run as stored, i.e. fp32)."""
    return None if dtype == torch.float32 else dtype


def autocast_context(dtype: torch.dtype | None, device: torch.device | str):
    """``torch.autocast(device, dtype)`` for a lower-precision ``dtype``, else a no-op context.
    Wrap the forward pass and the loss (not ``backward``, not the optimizer step)."""
    device = torch.device(device)
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


# -- export dtype -------------------------------------------------------------------------------
def resolve_save_dtype(name: str | torch.dtype | None, model: torch.nn.Module | None = None
                       ) -> torch.dtype:
    """``checkpoint.save_dtype`` -> the dtype of the HF export. ``auto``/None: the dtype the
    model's weights were loaded from (``model.checkpoint_dtype``, set by ``from_pretrained``),
    else the dtype of its floating-point parameters."""
    if name is None or (not isinstance(name, torch.dtype) and str(name).lower() == "auto"):
        loaded = model.checkpoint_dtype if model is not None else None
        if loaded is not None:
            return loaded
        if model is not None:
            for p in model.parameters():
                if p.is_floating_point():
                    return p.dtype
        return torch.float32
    return parse_dtype(name, "checkpoint.save_dtype")
