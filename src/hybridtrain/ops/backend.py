"""Backend tuning: the choices that depend on the hardware a run computes on, kept out of the
model and loss code. Figures are from the project's 2-core AMD EPYC (torch's CPU build, oneDNN).

The recipe calls :func:`configure_backend` once per process, when it knows the device and the
compute dtype. Model and loss code only call :func:`pad_rows` / :func:`unpad_rows` (and read
:func:`settings`), which leave tensors alone until the backend is configured for CPU low
precision. What is tuned, with its recipe key:

* **GEMM row alignment** (:func:`pad_rows`). Where a GEMM's row count changes every step (the
  tokens routed to an expert, the label tokens of the loss), the rows are padded with zeros to a
  multiple of :data:`CPU_LOWP_ROW_MULTIPLE`. torch's CPU bf16/fp16 GEMMs are oneDNN kernels built
  and cached per shape: unaligned, every new count builds a kernel (time) and the cache grows for
  thousands of steps (~20 MB per step with 8 experts). Multiples of 64 keep the shapes few enough
  that live memory stays flat (16 still grew ~2 MB per step at 4 x 512 tokens) and were as fast
  or faster on the 48M MoE (0.41 vs 0.43-0.46 s per bf16 step). 1 (no padding) elsewhere.
* **glibc allocator** (``training.cpu_allocator``, :func:`configure_cpu_allocator`).
* **``training.dtype: auto``** (:func:`auto_dtype`, ``training.cpu_bf16``).
* **the ``auto`` loss chunk** (``training.loss_chunk_size: auto``, :func:`auto_chunk_size`).
* **FSDP2's all-gather buffer on CPU** (:attr:`BackendSettings.fsdp_free_all_gather`): with
  synchronous CPU collectives nothing overlaps an all-gather, so each FSDP2 unit's all-gather
  output is freed right after its copy-out (``distributed.fsdp.free_all_gather_after_copy_out``)
  instead of being kept until the next unit's all-gather; on GPUs FSDP2's default overlap stays.
* **grouped expert GEMMs on CUDA** (``training.grouped_mm``): bf16 experts through one
  ``torch.nn.functional.grouped_mm`` per projection (no host sync) instead of a loop over experts;
  :func:`disable_grouped_mm` turns it off for the process where the kernel fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import time
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

__all__ = [
    "BackendSettings", "configure_backend", "settings", "using", "disable_grouped_mm",
    "pad_rows", "unpad_rows", "configure_cpu_allocator", "cpu_bf16_flags", "cpu_has_native_bf16",
    "auto_dtype", "auto_chunk_size", "CPU_LOWP_ROW_MULTIPLE", "CPU_BF16_MIN_HIDDEN",
]

CPU_LOWP_ROW_MULTIPLE = 64
CPU_BF16_MIN_HIDDEN = 256
AUTO_CHUNK_LOGITS = 1 << 25
ALLOCATOR_CHOICES = ("auto", "heap", "system")


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """What :func:`configure_backend` chose for this process. The defaults tune nothing."""

    gemm_row_multiple: int = 1  # rows of varying-count GEMM operands are padded to this multiple
    grouped_mm: bool = True  # CUDA bf16 experts: torch grouped_mm (else a loop over experts)
    cpu_allocator: str = "system"  # in effect: heap, system, or "system (not glibc)"
    fsdp_free_all_gather: bool = False  # FSDP2 units free their all-gather output after copy-out


_settings = BackendSettings()


def settings() -> BackendSettings:
    return _settings


def configure_backend(device: torch.device | str, dtype: torch.dtype, *, cpu_allocator: str = "auto",
                      grouped_mm: bool = True) -> BackendSettings:
    """Tunes this process for training on ``device`` with compute ``dtype`` (the resolved
    ``training.dtype``); ``cpu_allocator`` / ``grouped_mm``: the ``training.`` keys of those
    names. The allocator setting is process-wide and not undone. Returns the settings in effect."""
    global _settings
    if not isinstance(grouped_mm, bool):
        raise ValueError(f"training.grouped_mm: {grouped_mm!r} is not true or false")
    device = torch.device(device)
    lowp_cpu = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    _settings = BackendSettings(gemm_row_multiple=CPU_LOWP_ROW_MULTIPLE if lowp_cpu else 1,
                                grouped_mm=grouped_mm,
                                cpu_allocator=configure_cpu_allocator(cpu_allocator, device),
                                fsdp_free_all_gather=device.type == "cpu")
    log.info("backend: %s", _settings)
    return _settings


@contextlib.contextmanager
def using(new: BackendSettings):
    """Runs a block with ``new`` in effect (tests, benchmarks comparing settings in one process);
    the allocator is not touched."""
    global _settings
    old, _settings = _settings, new
    try:
        yield new
    finally:
        _settings = old


def disable_grouped_mm(reason: str) -> None:
    """Turns grouped expert GEMMs off for the rest of the process (e.g. a GPU or torch build
    without the kernel), with a warning giving ``reason``."""
    global _settings
    if _settings.grouped_mm:
        warnings.warn(f"{reason}; using the per-expert loop from now on", stacklevel=2)
        _settings = dataclasses.replace(_settings, grouped_mm=False)


# -- GEMM row alignment -------------------------------------------------------------------------
def pad_rows(x: torch.Tensor, value: float | int = 0) -> torch.Tensor:
    """``x`` with rows (dim 0) of ``value`` appended up to the configured GEMM row multiple;
    ``x`` itself when no padding is due. Undo with :func:`unpad_rows` on the GEMM's output."""
    pad = -x.shape[0] % _settings.gemm_row_multiple
    if not pad:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad), value=value)


def unpad_rows(y: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of ``y`` (``y`` itself when it has ``n``: no slice in the graph)."""
    return y if y.shape[0] == n else y[:n]


# -- glibc allocator ----------------------------------------------------------------------------
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_BYTES = 1 << 30


def configure_cpu_allocator(mode: str, device: torch.device | str) -> str:
    """Applies ``training.cpu_allocator`` for a run on ``device``; returns what is in effect:
    ``heap``, ``system``, or ``system (not glibc)`` where the C library has no ``mallopt``.

    glibc serves every block above its mmap threshold (at most 32 MiB, adjusted at run time) with
    a fresh ``mmap`` and unmaps it on free. A CPU training step allocates and frees such blocks
    all the time (logit chunks, SSD decay blocks, bf16 copies of activations), so each one costs
    page faults, kernel page zeroing and an ``munmap`` (a TLB shootdown across the threads),
    again every step. ``heap`` turns mmap off for allocations (``M_MMAP_MAX = 0``) and trims the
    heap only above 1 GiB free at its top (``M_TRIM_THRESHOLD``), so freed blocks are mostly
    reused. 48M MoE (2 threads, 4 x 512 tokens): bf16 step 1.28 s -> 0.68 s, page faults per
    step ~115k -> ~44k, peak RSS about the same; fp32 steps (matmul-bound) do not change. The
    cost is resident memory: what is freed stays with the process, so peak RSS can be higher
    where few large blocks dominate. ``auto`` = ``heap`` when training on CPU, else ``system``
    (glibc's defaults, untouched). Process-wide and not undone."""
    if mode not in ALLOCATOR_CHOICES:
        raise ValueError(f"training.cpu_allocator: {mode!r} is not one of {', '.join(ALLOCATOR_CHOICES)}")
    if mode == "auto":
        mode = "heap" if torch.device(device).type == "cpu" else "system"
    if mode == "system":
        return mode
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("training.cpu_allocator=heap: no glibc mallopt here; the system allocator is used")
        return "system (not glibc)"
    log.info("training.cpu_allocator=heap: glibc mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB "
             "(large CPU tensors reuse freed heap memory instead of fresh page-faulted mmaps)")
    return "heap"


# -- training.dtype: auto -----------------------------------------------------------------------
# x86 (/proc/cpuinfo "flags") and Arm ("Features") names of native bf16 dot-product support
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


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
def _detect_cpu_bf16() -> tuple[bool, str]:
    flags = cpu_bf16_flags()
    if flags is not None:
        if flags:
            return True, f"CPU flags {', '.join(sorted(flags))}"
        return False, "the CPU has no avx512_bf16 / amx_bf16 (no native bf16 matmul)"
    speedup = _probe_bf16_speedup()
    if speedup >= 1.3:
        return True, f"CPU flags unknown; a bf16 matmul is {speedup:.1f}x faster than fp32"
    return False, f"CPU flags unknown; a bf16 matmul is only {speedup:.1f}x as fast as fp32"


def cpu_has_native_bf16(setting: bool | str = "auto") -> tuple[bool, str]:
    """(whether bf16 matmuls are fast on this CPU, the reason). ``setting`` is
    ``training.cpu_bf16``: true/false say so; ``auto`` reads the CPU flags, or where they cannot
    be read (not Linux) times a probe (bf16 must beat fp32 by 1.3x; done once per process)."""
    if isinstance(setting, bool):
        return setting, f"training.cpu_bf16={str(setting).lower()}"
    if setting != "auto":
        raise ValueError(f"training.cpu_bf16: {setting!r} is not one of auto, true, false")
    return _detect_cpu_bf16()


def auto_dtype(device: torch.device | str, hidden_size: int | None = None,
               cpu_bf16: bool | str = "auto") -> tuple[torch.dtype, str]:
    """``training.dtype: auto`` -> (the compute dtype on ``device``, the reason).

    bf16 on CUDA when the GPU supports it, and on CPUs with native bf16 matmul
    (:func:`cpu_has_native_bf16` of ``cpu_bf16``), fp32 otherwise. On CPU also only for models of
    ``hidden_size >=`` :data:`CPU_BF16_MIN_HIDDEN` (None: not considered): below it the per-op
    costs of casts and small kernels outweigh the faster matmuls (4 x 256-token steps of the mixed
    tiny model: hidden 96 bf16 is 0.89x fp32, 192 0.99x, 256 1.27x, 384 1.49x; the 48M MoE at
    hidden 512 2.1x). No timing when the CPU flags are known, so a resumed run picks the same."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA device with bf16 support"
        return torch.float32, "this CUDA device has no bf16 support"
    if device.type != "cpu":
        return torch.float32, f"no bf16 auto-selection for {device.type}"
    native, why = cpu_has_native_bf16(cpu_bf16)
    if not native:
        return torch.float32, why
    if hidden_size is not None and hidden_size < CPU_BF16_MIN_HIDDEN:
        return torch.float32, (f"{why}, but hidden_size {hidden_size} < {CPU_BF16_MIN_HIDDEN}: too "
                               "narrow for bf16 to pay off on CPU")
    return torch.bfloat16, why


# -- the auto loss chunk ------------------------------------------------------------------------
def auto_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk for ``loss_chunk_size: auto``: about 2^25 logits (128 MiB in fp32) per
    chunk, a multiple of 64 tokens, at least 64. Large enough for full-speed GEMMs, small enough
    that the per-chunk buffers neither spill far out of cache nor churn the allocator: 16 x 512
    tokens of the 48M MoE (vocabulary 32000) took 7-9 s per bf16 step with 4096-token chunks
    (glibc returned the 0.5 GiB buffers and page-faulted them in again every step) and 5.3 s
    with 1024; at 4 x 512 tokens 1024 was as fast as 4096 with 10 % less memory."""
    return max(64, AUTO_CHUNK_LOGITS // max(vocab_size, 1) // 64 * 64)
