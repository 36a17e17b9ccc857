"""Mixed precision: which dtype a run computes in, the autocast context, and the export dtype.

Strategy (issue 7): **fp32 master weights and optimizer state, bf16 compute under
``torch.autocast``**. The parameters are never stored in bf16 during training; autocast runs
each matmul / conv / attention in bf16 on bf16 copies of its operands, while the residual
stream, the gradients, the gradient norm and the AdamW update stay fp32. The numerically
sensitive parts stay fp32 inside the model whatever the mode (router logits, sigmoid, correction
bias and top-k; the SSD scan's dt / A / exp / cumsum and state accumulation; RMSNorm and gated
group-norm statistics; see ``models/nemotron_h/numerics.py``), and so do the log-softmax /
cross-entropy (``training/loss.py``).

The alternative, bf16 parameters with separate fp32 master copies in the optimizer, was
measured on the 2-core CPU (``benchmarks/bf16_vs_fp32.py --strategies``, ~48M MoE, 512 tokens,
one thread): within 4 % of autocast's speed (2.20x vs 2.12x fp32), but its bf16 residual stream
drifts: after 5 steps its loss is 0.114 away from fp32's, autocast's 0.0014; and it needs an
extra weight copy plus a trainer/optimizer/checkpoint rewrite.
On GPUs under FSDP2 the ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` gives
bf16 compute copies of the fp32 shards for free; autocast on top of it is harmless.

``training.dtype``:

* ``auto``: bf16 on CUDA (when the GPU supports it) and on CPUs with native bf16 matmul
  (``avx512_bf16`` / ``amx_bf16`` on x86, ``bf16`` on Arm; a short timed matmul probe where the
  flags cannot be read), fp32 otherwise. On CPU also only for models of ``hidden_size >=``
  :data:`CPU_BF16_MIN_HIDDEN`: below it the per-op costs of casts and small kernels outweigh the
  faster matmuls (2-core EPYC, 4 x 256-token steps of the mixed tiny model: hidden 96 bf16 is
  0.89x fp32, 192 0.99x, 256 1.27x, 384 1.49x; the ~48M MoE at hidden 512 2.1x). The rule uses
  no timing when the flags are known, so a resumed run picks the same dtype. The choice and its
  reason are logged.
* ``float32`` / ``bfloat16``: as asked. ``float16`` is refused: it needs dynamic loss scaling,
  which hybridtrain does not implement.

``checkpoint.save_dtype`` (HF exports): ``auto`` writes the dtype the weights were loaded from
(a bf16 Hub checkpoint comes back as bf16; a model built from scratch as its parameter dtype),
or ``float32`` / ``bfloat16`` / ``float16``. The sharded ``step_N/`` training checkpoints always
hold the fp32 masters and optimizer state (exact resume).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "parse_dtype",
    "cpu_bf16_flags",
    "cpu_has_native_bf16",
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
# x86 (/proc/cpuinfo "flags") and Arm ("Features") names of native bf16 dot-product support
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# `auto` on CPU: narrower models train faster in fp32 (see the module docstring)
CPU_BF16_MIN_HIDDEN = 256


def parse_dtype(value: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """``'bf16'``, ``'bfloat16'``, ``'torch.bfloat16'``, ``torch.bfloat16`` ... -> the dtype."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).lower().removeprefix("torch.")
    if name not in _NAMES:
        raise ValueError(f"{key}: unknown dtype {value!r}; use one of auto, float32, bfloat16")
    return _NAMES[name]


# -- CPU capability -----------------------------------------------------------------------------
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The native-bf16 CPU flags present (empty set: none), or None when unknown (no cpuinfo)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    words: set[str] = set()
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(rest.split())
            break  # every core lists the same flags
    return {w for w in _BF16_FLAGS if w in words}


def _probe_bf16_speedup(n: int = 512, k: int = 1024, repeats: int = 3) -> float:
    """fp32 time / bf16 time of an ``n x k @ k x k`` matmul (best of ``repeats``)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, k).to(dtype)
        b = torch.randn(k, k).to(dtype)
        a @ b  # warm-up (oneDNN kernel selection)
        t = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            t = min(t, time.perf_counter() - t0)
        best[dtype] = t
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> tuple[bool, str]:
    """(whether bf16 matmuls are fast on this CPU, the reason). ``HYBRIDTRAIN_CPU_BF16=0/1``
    overrides the detection. Otherwise the CPU flags, or where they cannot be read (not Linux)
    a timed probe (bf16 must beat fp32 by 1.3x)."""
    env = os.environ.get("HYBRIDTRAIN_CPU_BF16")
    if env is not None and env.strip() != "":
        on = env.strip().lower() not in ("0", "false", "no", "off")
        return on, f"HYBRIDTRAIN_CPU_BF16={env}"
    flags = cpu_bf16_flags()
    if flags is not None:
        if flags:
            return True, f"CPU flags {', '.join(sorted(flags))}"
        return False, "the CPU has no avx512_bf16 / amx_bf16 (no native bf16 matmul)"
    speedup = _probe_bf16_speedup()
    if speedup >= 1.3:
        return True, f"CPU flags unknown; a bf16 matmul is {speedup:.1f}x faster than fp32"
    return False, f"CPU flags unknown; a bf16 matmul is only {speedup:.1f}x as fast as fp32"


# -- training dtype -----------------------------------------------------------------------------
def resolve_dtype(name: str | torch.dtype, device: torch.device | str,
                  hidden_size: int | None = None) -> torch.dtype:
    """``training.dtype`` -> the compute dtype on ``device`` (see the module docstring).
    ``hidden_size``: the model's, for ``auto`` on CPU (None: not considered)."""
    device = torch.device(device)
    if not isinstance(name, torch.dtype) and str(name).lower() == "auto":
        if device.type == "cuda":
            if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
                dtype, why = torch.bfloat16, "CUDA device with bf16 support"
            else:
                dtype, why = torch.float32, "this CUDA device has no bf16 support"
        elif device.type == "cpu":
            native, why = cpu_has_native_bf16()
            dtype = torch.bfloat16 if native else torch.float32
            if native and hidden_size is not None and hidden_size < CPU_BF16_MIN_HIDDEN:
                dtype = torch.float32
                why += (f", but hidden_size {hidden_size} < {CPU_BF16_MIN_HIDDEN}: too narrow for "
                        "bf16 to pay off on CPU")
        else:
            dtype, why = torch.float32, f"no bf16 auto-selection for {device.type}"
        logger.info("training.dtype=auto -> %s on %s (%s); parameters and optimizer state stay "
                    "float32", str(dtype).removeprefix("torch."), device.type, why)
        return dtype
    dtype = parse_dtype(name, "training.dtype")
    if dtype == torch.float16:
        raise ValueError(
            "training.dtype=float16 needs dynamic loss scaling, which hybridtrain does not "
            "implement; use bfloat16 (GPUs from Ampere on, CPUs with avx512_bf16/AMX) or float32")
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16()[0]:
        logger.warning("training.dtype=bfloat16 on a CPU without native bf16 matmul (%s): "
                       "expect it to be slower than float32", cpu_has_native_bf16()[1])
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
        loaded = getattr(model, "checkpoint_dtype", None) if model is not None else None
        if loaded is not None:
            return loaded
        if model is not None:
            for p in model.parameters():
                if p.is_floating_point():
                    return p.dtype
        return torch.float32
    return parse_dtype(name, "checkpoint.save_dtype")
