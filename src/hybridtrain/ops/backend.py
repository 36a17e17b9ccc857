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
* **oneDNN's GEMM kernel caches** (``hybridtrain.config.dist_env.gemm_kernel_cache_defaults``).
  Those kernels, built per shape even where rows are aligned (per-document attention,
  per-expert counts, token counts of unpacked rows), are cached by oneDNN and ideep, 1024
  entries each by default, 0.6-1.5 MB per entry of both. The process defaults bound each cache
  to 128 entries (the environment or ``dist_env`` decides instead): set by the CLI before torch
  is imported, and by ``training.builder.build`` for a library user, which takes effect if no
  oneDNN operation ran in the process before (environment variables: ops/ reads none of them).
  ``hybridtrain plan`` counts the bound for CPU bf16/fp16 runs where those GEMMs are oneDNN's
  (``cpu_gemm_kernels``, :func:`cpu_gemm_kernels_cached`: on a CPU without AVX-512 torch runs
  bf16 GEMMs in its own loops, which cache nothing).
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
* **the linear cross-entropy's implementation** (``training.fused_loss``, :func:`resolve_fused_loss`):
  ``torch`` (the chunked PyTorch loop of ``ops.loss``), ``compiled`` (its chunk functions under
  ``torch.compile``), ``liger`` (Liger-Kernel's fused linear cross-entropy, a Triton kernel);
  ``auto`` -> liger on CUDA where it imports, else compiled on CUDA, torch elsewhere.
* **the Mamba kernels** (``training.mamba_kernels``): ``auto`` -> the ``mamba_ssm`` /
  ``causal_conv1d`` kernels for CUDA tensors where they import; ``true`` -> always (a missing
  package is an error); ``false`` -> the PyTorch path.
* **fp32 CPU decoding forms** (:func:`cpu_decode_forms`, :func:`few_rows_linear`,
  :func:`transposed_head`): the product forms MKL runs fastest for a step's few rows, the fused
  Mamba2 step and the host-grouped MoE step, where a decoding step runs eagerly in fp32 on CPU.
* **decoding as one CUDA graph** (:func:`decode_graph`): a step captured once and replayed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.util
import logging
import time
import warnings

import torch
import torch.nn.functional as F

from hybridtrain.ops import liger_loader, triton_interpret
from hybridtrain.ops.flash_varlen import flash_ops, flash_varlen

log = logging.getLogger(__name__)

__all__ = [
    "BackendSettings", "configure_backend", "settings", "using", "disable_grouped_mm",
    "pad_rows", "unpad_rows", "configure_cpu_allocator", "cpu_bf16_flags", "cpu_has_native_bf16",
    "auto_dtype", "auto_chunk_size", "resolve_fused_loss", "CPU_LOWP_ROW_MULTIPLE", "CPU_BF16_MIN_HIDDEN",
    "FUSED_LOSS_CHOICES", "cpu_decode_forms", "few_rows_linear", "transposed_head", "decode_graph",
    "grouped_experts", "register_kernel_paths", "kernel_paths", "kernel_paths_line",
]

CPU_LOWP_ROW_MULTIPLE = 64
CPU_BF16_MIN_HIDDEN = 256
AUTO_CHUNK_LOGITS = 1 << 25
AUTO_CHUNK_LOGITS_CUDA = 1 << 28
ALLOCATOR_CHOICES = ("auto", "heap", "system")
FUSED_LOSS_CHOICES = ("auto", "torch", "compiled", "liger")


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """What :func:`configure_backend` chose for this process. The defaults tune nothing."""

    gemm_row_multiple: int = 1  # rows of varying-count GEMM operands are padded to this multiple
    grouped_mm: bool = True  # CUDA bf16 experts: torch grouped_mm (else a loop over experts)
    cpu_allocator: str = "system"  # in effect: heap, system, or "system (not glibc)"
    fused_loss: str = "torch"  # the linear cross-entropy: torch, compiled or liger
    mamba_kernels: bool | str = "auto"  # mamba_ssm / causal_conv1d: auto (CUDA tensors), True, False
    cpu_decode_forms: bool = True  # eager fp32 CPU decoding: the forms measured fastest there
    decode_graph: bool = True  # CUDA decoding: the step captured once as a CUDA graph, replayed
    fsdp_free_all_gather: bool = False  # FSDP2 units free their all-gather output after copy-out


_settings = BackendSettings()


def settings() -> BackendSettings:
    return _settings


def configure_backend(device: torch.device | str, dtype: torch.dtype, *, cpu_allocator: str = "auto",
                      grouped_mm: bool | str = "auto", fused_loss: str = "auto",
                      mamba_kernels: bool | str = "auto") -> BackendSettings:
    """Tunes this process for training on ``device`` with compute ``dtype`` (the resolved
    ``training.dtype``); ``cpu_allocator`` / ``grouped_mm`` / ``fused_loss`` / ``mamba_kernels``:
    the ``training.`` keys of those names. The allocator setting is process-wide and not undone.
    Returns the settings in effect."""
    global _settings
    if grouped_mm not in (True, False, "auto"):
        raise ValueError(f"training.grouped_mm: {grouped_mm!r} is not one of auto, true, false")
    if mamba_kernels not in (True, False, "auto"):
        raise ValueError(f"training.mamba_kernels: {mamba_kernels!r} is not one of auto, true, false")
    device = torch.device(device)
    if mamba_kernels is True and device.type != "cuda" and not triton_interpret.interpreting():
        raise ValueError(f"training.mamba_kernels: true needs a CUDA device (this run computes on "
                         f"{device.type}), or TRITON_INTERPRET=1 in the environment to run the Triton "
                         "kernels on the CPU (slow: for checking them); set it to auto or false")
    lowp_cpu = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    check_slow_paths(device, dtype, grouped_mm)
    _settings = BackendSettings(gemm_row_multiple=CPU_LOWP_ROW_MULTIPLE if lowp_cpu else 1,
                                grouped_mm=grouped_mm is not False,
                                cpu_allocator=configure_cpu_allocator(cpu_allocator, device),
                                fused_loss=resolve_fused_loss(fused_loss, device),
                                mamba_kernels=mamba_kernels,
                                fsdp_free_all_gather=device.type == "cpu")
    log.info("backend: %s", _settings)
    log.info(kernel_paths_line(kernel_paths(device)))
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


# -- no silent slow path --------------------------------------------------------------------------
FLASH_ATTN_FLOOR = "2.7"  # the cuda extra's floor (flash_attn_varlen_func with these arguments)


def slow_paths(device: torch.device | str, dtype: torch.dtype) -> dict[str, str]:
    """The slow forms a CUDA run on ``device`` in ``dtype`` would fall back to, each {setting:
    what happens and the fix}; empty elsewhere (on a CPU these forms are the expected ones)."""
    if torch.device(device).type != "cuda":
        return {}
    found = {}
    if not hasattr(F, "grouped_mm"):
        found["grouped_mm"] = (
            f"torch {torch.__version__} has no torch.nn.functional.grouped_mm: MoE experts run as a "
            "loop over experts (a host sync per MoE layer) and, in compiled blocks, every expert "
            "over every row, masked (about num_experts / top_k times the expert FLOPs); install "
            "torch>=2.9 (pip install 'hybridtrain[cuda]')")
    elif dtype != torch.bfloat16:
        found["grouped_mm"] = (
            f"training.dtype {dtype}: torch grouped_mm runs bf16 only, so MoE experts run as a loop "
            "over experts (eager) or every expert over every row, masked (compiled blocks); set "
            "training.dtype: bf16")
    if flash_varlen() is None:
        found["flash_attn"] = (
            "flash-attn is not installed (or does not import): attention over packed rows runs one "
            "scaled_dot_product_attention per document (eager; the document boundaries read on the "
            "host per layer) and flex_attention in compiled blocks (not flash-attn's varlen kernel); install "
            f"flash-attn>={FLASH_ATTN_FLOOR} (pip install 'hybridtrain[cuda]')")
    return found


def check_slow_paths(device: torch.device | str, dtype: torch.dtype,
                     grouped_mm: bool | str = "auto") -> dict[str, str]:
    """Warns once per process for each of :func:`slow_paths`, naming the package and the fix;
    ``training.grouped_mm: true`` refuses where it cannot run (``false``: the loop is chosen)."""
    found = slow_paths(device, dtype)
    if grouped_mm is False:
        found.pop("grouped_mm", None)
    if grouped_mm is True and "grouped_mm" in found:
        raise ValueError(f"training.grouped_mm: true, but {found['grouped_mm']}; or set it to auto "
                         "to accept the fallback")
    for key, why in found.items():
        if key not in _warned_slow:
            _warned_slow.add(key)
            log.warning("slow path: %s", why)
    return found


_warned_slow: set[str] = set()


def disable_grouped_mm(reason: str) -> None:
    """Turns grouped expert GEMMs off for the rest of the process (e.g. a GPU or torch build
    without the kernel), with a warning giving ``reason``."""
    global _settings
    if _settings.grouped_mm:
        warnings.warn(f"{reason}; using the per-expert loop from now on", stacklevel=2)
        _settings = dataclasses.replace(_settings, grouped_mm=False)


def grouped_experts(x: torch.Tensor, widths: tuple[int, ...] = ()) -> bool:
    """Whether the experts' GEMMs over the sorted token rows ``x`` (in the compute dtype) run as
    one ``torch.nn.functional.grouped_mm`` per projection (offsets on the device, no host sync):
    ``grouped_mm`` is on, the kernel is there, and ``x`` is bf16 (the CUDA kernel's dtype) on
    CUDA or in a block being compiled, or fp32 in an eager CPU forward with rows of 16-byte
    multiples (``x``'s and the other ``widths`` of the projections; torch's CPU kernel: one GEMM
    per expert on the same rows as the loop's, the same values without the loop's host count and
    per-expert ops). Else a loop over the experts' row counts (eager) or every expert over every
    row, masked (compiled fp32)."""
    if not (_settings.grouped_mm and hasattr(F, "grouped_mm")):
        return False
    if torch.compiler.is_compiling():
        return x.dtype == torch.bfloat16
    if x.is_cuda:
        return x.dtype == torch.bfloat16
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] > 0
            and all(n * x.dtype.itemsize % 16 == 0 for n in (x.shape[-1], *widths)))


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


_ONEDNN_DTYPE_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported",
                        torch.float16: "_is_mkldnn_fp16_supported"}


def cpu_gemm_kernels_cached(dtype: torch.dtype) -> bool:
    """Whether this process's CPU GEMMs in ``dtype`` are oneDNN's, which builds and caches a
    kernel per shape (bounded by ``config/dist_env.py``; ``hybridtrain plan`` counts the bound):
    bf16 / fp16 where torch finds oneDNN kernels for them on this CPU -- bf16 with AVX-512 or
    AMX, fp16 with AVX512-FP16 or AMX-FP16, as capped by ``ONEDNN_MAX_CPU_ISA``. Elsewhere
    (a CPU without AVX-512, fp32) torch runs them in its own loops or Intel MKL, which cache
    none. Asked of torch itself (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, the check its
    matmul makes), so the answer is the machine's."""
    if dtype not in _ONEDNN_DTYPE_CHECKS or not (torch.backends.mkldnn.is_available()
                                                 and torch.backends.mkldnn.enabled):
        return False
    name = _ONEDNN_DTYPE_CHECKS[dtype]
    try:
        check = getattr(torch.ops.mkldnn, name)
    except (AttributeError, RuntimeError) as e:
        raise RuntimeError(f"torch {torch.__version__} has no torch.ops.mkldnn.{name} (torch "
                           "2.13 has): hybridtrain cannot tell whether its CPU GEMMs are "
                           "oneDNN's") from e
    return bool(check())


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


# -- the linear cross-entropy's implementation --------------------------------------------------
def resolve_fused_loss(mode: str, device: torch.device | str) -> str:
    """``training.fused_loss`` -> ``torch``, ``compiled`` or ``liger`` for a run on ``device``.
    ``auto``: liger on CUDA where a usable ``liger_kernel`` imports (an installed one that is
    not, e.g. older than the signature ``ops.liger`` calls: a warning and compiled), else
    compiled on CUDA (no fp32 logits chunk in memory: the chunk's softmax and gradient fuse into
    one or two kernels), torch elsewhere (on CPU the eager chunk loop is as fast and
    bit-identical to earlier runs). ``liger`` needs a usable ``liger_kernel`` (extra
    ``hybridtrain[cuda]``; on a CPU under ``TRITON_INTERPRET=1``)."""
    if mode not in FUSED_LOSS_CHOICES:
        raise ValueError(f"training.fused_loss: {mode!r} is not one of {', '.join(FUSED_LOSS_CHOICES)}")
    if mode in ("torch", "compiled") or (mode == "auto" and torch.device(device).type != "cuda"):
        return "torch" if mode == "auto" else mode
    problem = liger_loader.problem()
    if mode == "liger" and problem:
        raise ValueError(f"training.fused_loss: liger, but {problem}; set it to auto, compiled or torch")
    if mode == "liger" or problem is None:
        return "liger"
    if importlib.util.find_spec("liger_kernel") is not None:
        log.warning("training.fused_loss=auto: the compiled loss instead of Liger's, because %s", problem)
    return "compiled"


# -- where each kernel comes from ---------------------------------------------------------------
_kernel_path_sources: list = []


def register_kernel_paths(fn) -> None:
    """A model family's kernel dispatch registers ``fn(device) -> {part: where it comes from}``
    (it may refuse a run, ``ValueError``, or warn about a fallback); :func:`kernel_paths` asks it."""
    if fn not in _kernel_path_sources:
        _kernel_path_sources.append(fn)


def kernel_paths(device: torch.device | str | None = None) -> dict[str, str]:
    """Which implementation each part of a step runs on ``device`` under :func:`settings`:
    the registered model kernels (Nemotron-H: ``ssd``, ``state_update``, ``conv``), then
    ``loss`` and ``attention``; each value says where it comes from (package, version,
    module, or the PyTorch path and why)."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    paths: dict[str, str] = {}
    for fn in _kernel_path_sources:
        paths.update(fn(device))
    paths["loss"] = _loss_path()
    paths["attention"] = _attention_path(device)
    paths["experts"] = _experts_path(device)
    return paths


def kernel_paths_line(paths: dict[str, str]) -> str:
    """``kernel paths: ssd=...; state_update=...; ...`` (the line a run logs and ``benchmark`` prints)."""
    return "kernel paths: " + "; ".join(f"{part}={where}" for part, where in paths.items())


def _loss_path() -> str:
    impl = _settings.fused_loss
    if impl == "liger":
        return liger_loader.describe() + (", Triton interpreter" if triton_interpret.interpreting() else "")
    if impl == "compiled":
        return "PyTorch chunked loss, chunk functions under torch.compile (hybridtrain.ops.loss)"
    return "PyTorch chunked loss (hybridtrain.ops.loss)"


def _experts_path(device: torch.device) -> str:
    """The experts' GEMMs as :func:`grouped_experts` chooses them on ``device``."""
    loop = "a loop over experts (eager), every expert over every row, masked (compiled blocks)"
    if not (_settings.grouped_mm and hasattr(F, "grouped_mm")):
        return loop
    if device.type == "cuda":
        return "torch grouped_mm (bf16; else the loop over experts eager, masked dense compiled)"
    return ("torch grouped_mm (fp32 eager with rows of 16-byte multiples, bf16 in compiled blocks); "
            f"else {loop}")


def _attention_path(device: torch.device) -> str:
    if device.type == "cuda":
        if flash_ops() is not None:
            return ("flash_attn varlen (bf16/fp16; eager, and in compiled blocks as the custom op "
                    "hybridtrain::flash_document_attention)")
        if flash_varlen() is not None:
            return ("flash_attn varlen (eager), flex_attention (compiled blocks; fallback: this flash-attn "
                    f"registers no torch.library ops, install flash-attn>={FLASH_ATTN_FLOOR})")
        return ("scaled_dot_product_attention per document (eager), flex_attention (compiled blocks; "
                "fallback: flash-attn is not installed)")
    return "scaled_dot_product_attention per document (eager), masked SDPA (compiled blocks)"


# -- the auto loss chunk ------------------------------------------------------------------------
def auto_chunk_size(vocab_size: int, device_type: str = "cpu") -> int:
    """Tokens per chunk for ``loss_chunk_size: auto``: about 2^25 logits (128 MiB in fp32) per
    chunk, a multiple of 64 tokens, at least 64. Large enough for full-speed GEMMs, small enough
    that the per-chunk buffers neither spill far out of cache nor churn the allocator: 16 x 512
    tokens of the 48M MoE (vocabulary 32000) took 7-9 s per bf16 step with 4096-token chunks
    (glibc returned the 0.5 GiB buffers and page-faulted them in again every step) and 5.3 s
    with 1024; at 4 x 512 tokens 1024 was as fast as 4096 with 10 % less memory.

    On CUDA about 2^28 logits (2048 tokens at 131k; 0.5 GiB in bf16): each chunk reads and
    writes the fp32 weight gradient once (2.8 GB for a 131k x 2688 head, ~1 ms of HBM time), so
    256-token chunks spent ~30 ms of an H100 step on it alone."""
    budget = AUTO_CHUNK_LOGITS_CUDA if device_type == "cuda" else AUTO_CHUNK_LOGITS
    return max(64, budget // max(vocab_size, 1) // 64 * 64)


# -- decoding -----------------------------------------------------------------------------------
# A decoding step multiplies a few rows by every weight, and there the form of the product
# matters on CPU: one row runs fastest against a transposed copy of the weight; MKL's fp32
# x @ W^T (nn.Linear) costs about one row's time up to 3 rows and twice that from 4, where
# W @ x^T is as fast or faster. Measured on 2026-12-06 (torch 2.13, the suite's Xeon with
# AVX-512, one thread, thread CPU ms per product, weights streamed from memory):
#   rows                        1     2     3     4     8
#   LM head [32000, 512]
#     x @ W^T                 6.5   7.2   9.1  15.8  21.9
#     W @ x^T                 6.6  18.2  18.5  20.7  15.2
#     x @ (W^T)c              4.9   9.5   9.6  10.9  12.2   ((W^T)c: the copy, made once)
#   Mamba in_proj [4640, 1024]
#     x @ W^T                 1.5   1.8   1.8   3.3   4.9
#     W @ x^T                 1.5   3.5   3.7   3.2   3.8
# (An earlier torch measured x @ W^T at 2-8 rows twice as slow as W @ x^T; the speculative
# decoding's verification, 2-4 rows, reads every weight in this form.)
FEW_ROWS_LINEAR_MAX = 3  # up to this many rows x @ W^T, more: W @ x^T
TRANSPOSED_HEAD_MAX_ROWS = 1  # the LM head against its transposed copy up to this many rows ...
TRANSPOSED_HEAD_MIN_STEPS = 64  # ... when this many decoding steps are left to amortise the copy


def cpu_decode_forms(x: torch.Tensor, fp32: bool = True) -> bool:
    """Whether a decoding step over ``x`` takes the eager CPU forms (the product forms below and
    the fused Mamba2 step, measured for fp32: ``fp32``; the MoE step grouped on the host, for any
    dtype: ``fp32=False``): ``cpu_decode_forms`` is on, ``x`` is on CPU (fp32 outside autocast
    where ``fp32``), and the step is not being compiled (the CPU forms read a few ints on the
    host; a compiled or captured step takes the device forms)."""
    if not (_settings.cpu_decode_forms and x.device.type == "cpu" and not torch.compiler.is_compiling()):
        return False
    return not fp32 or (x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the few rows of a decoding step: W @ x^T for more than
    ``FEW_ROWS_LINEAR_MAX`` rows where :func:`cpu_decode_forms` holds (see the table above),
    else ``F.linear``."""
    rows = x.numel() // x.shape[-1]
    if rows <= FEW_ROWS_LINEAR_MAX or not cpu_decode_forms(x):
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()  # (the next ops want rows)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], y.shape[-1])


def transposed_head(x: torch.Tensor, steps: int) -> bool:
    """Whether the LM head of a decoding of ``steps`` steps over rows like ``x`` [b, H] runs
    against a transposed copy of its weight (one row or two, fp32 CPU, long enough to pay)."""
    return (x.shape[0] <= TRANSPOSED_HEAD_MAX_ROWS and steps >= TRANSPOSED_HEAD_MIN_STEPS
            and cpu_decode_forms(x))


def decode_graph(device: torch.device | str) -> bool:
    """Whether decoding on ``device`` captures its step once as a CUDA graph and replays it."""
    return _settings.decode_graph and torch.device(device).type == "cuda"
