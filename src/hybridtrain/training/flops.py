"""Peak throughput of a device and MFU (a model's FLOPs come from its spec's ``batch_flops``)."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridtrain.config.dtypes import short_dtype_name, to_torch_dtype

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Peak throughput
# ---------------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU from NVIDIA's data sheets. fp32 is the non-tensor
# FMA rate (what a matmul gets with TF32 off); tf32 the tensor-core rate.
_GPU_PEAKS = {
    #               bf16    fp16    tf32   fp32
    "B200":        (2250.0, 2250.0, 1100.0, 80.0),   # HGX B200, 1000 W
    "H200 NVL":    (835.5, 835.5, 417.5, 60.0),
    "H200":        (989.4, 989.4, 494.7, 67.0),      # SXM
    "H100 NVL":    (835.5, 835.5, 417.5, 60.0),
    "H100 PCIe":   (756.0, 756.0, 378.0, 51.0),
    "H100":        (989.4, 989.4, 494.7, 67.0),      # SXM
    "A100":        (312.0, 312.0, 156.0, 19.5),      # SXM and PCIe
}
_DTYPE_COLUMN = {"bf16": 0, "fp16": 1, "tf32": 2, "fp32": 3}

# The matmul a CPU run's MFU is measured against, once per run: on 2 cores a 1024 x 1024 fp32
# matmul reaches the 2048 one's TFLOP/s within noise, in a seventh of the time (2026-11-28).
CPU_PEAK_MATMUL_SIZE = 1024


def _dtype_name(dtype) -> str:
    """The column name: ``bf16`` / ``fp16`` / ``fp32`` (any dtype alias), or ``tf32``."""
    name = "tf32" if str(dtype).lower() == "tf32" else short_dtype_name(dtype)
    if name is None:
        raise ValueError(f"peak_tflops: unsupported dtype {dtype!r}; use bf16, fp16, tf32 or fp32")
    return name


def gpu_peak_tflops(device_name: str, dtype) -> float | None:
    """Table lookup by CUDA device name (e.g. "NVIDIA H100 80GB HBM3"); None when unknown."""
    col = _DTYPE_COLUMN[_dtype_name(dtype)]
    name = device_name.upper()
    for key, peaks in _GPU_PEAKS.items():
        if all(part.upper() in name for part in key.split()):
            return peaks[col]
    return None


def peak_tflops(device: torch.device | str, dtype) -> float | None:
    """Peak dense matmul TFLOP/s of one device for ``dtype``.

    CUDA: the data-sheet figure for A100 / H100 / H200 / B200 (fp32 reads as tf32 when
    ``torch.backends.cuda.matmul.allow_tf32`` is on); None for an unknown GPU. CPU: a measured
    matmul peak (:func:`measure_matmul_peak` of ``CPU_PEAK_MATMUL_SIZE``, cached per process).
    """
    device = torch.device(device)
    name = _dtype_name(dtype)
    if device.type == "cuda":
        if name == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            name = "tf32"
        gpu = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(gpu, name)
        if peak is None:
            logger.warning("no peak TFLOP/s known for %r; MFU will not be reported", gpu)
        return peak
    if device.type == "cpu":
        return measure_matmul_peak("fp32" if name == "tf32" else name, n=CPU_PEAK_MATMUL_SIZE)
    return None


@functools.lru_cache(maxsize=None)
def _measure(dtype_name: str, n: int, iters: int, device: str, threads: int) -> float:
    dtype = to_torch_dtype(dtype_name)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=g).to(dtype)
    b = torch.randn(n, n, device=dev, generator=g).to(dtype)
    for _ in range(2):
        a @ b
    best = math.inf
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def measure_matmul_peak(dtype="bf16", n: int = 2048, iters: int = 10, device="cpu") -> float:
    """Best TFLOP/s of an ``n x n`` matmul in ``dtype`` over ``iters`` timed runs (after two warm-up
    runs), with the current number of torch threads. Cached per (dtype, n, iters, device, threads)."""
    name = _dtype_name(dtype)
    if name == "tf32":
        raise ValueError("measure_matmul_peak: measure fp32 (with TF32 on or off) instead of tf32")
    return _measure(name, n, iters, str(torch.device(device)), torch.get_num_threads())


def mfu(tflops_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved / peak TFLOP/s (None when the peak is unknown)."""
    if not peak:
        return None
    return tflops_per_device / peak


@dataclass(frozen=True)
class Throughput:
    """The FLOP rate of training steps: ``flops_fn(micro_batch)`` counts the whole model's
    training FLOPs on a collated micro-batch (its spec's count); with ``peak_tflops`` (per
    device) the rate is also given as MFU."""

    flops_fn: Callable[[dict], float]
    peak_tflops: float | None = None

    def flops(self, micro_batches: Sequence[dict]) -> float:
        return sum(self.flops_fn(mb) for mb in micro_batches)

    def rates(self, flops: float, seconds: float, world_size: int) -> tuple[float, float | None]:
        """(TFLOP/s per device, MFU or None) of ``flops`` done by ``world_size`` devices."""
        tflops = flops / seconds / world_size / 1e12
        return tflops, mfu(tflops, self.peak_tflops)
