"""``dist_env``: environment variables from the recipe, set before CUDA / process-group init.

.. code-block:: yaml

    dist_env:
      torch_nccl_use_comm_nonblocking: true     # -> TORCH_NCCL_USE_COMM_NONBLOCKING=1
      pytorch_alloc_conf: expandable_segments:True   # -> PYTORCH_ALLOC_CONF=...
      nccl_debug: WARN

Keys are upper-cased; ``true``/``false`` become ``1``/``0``; numbers their text. A variable that
is already set in the environment wins (the launcher or user knows better) and is reported once
per process. ``null`` is an error -- it is never exported as the string "None".

Then the process defaults (:func:`apply_process_defaults`) fill what neither the environment nor
the recipe set: the OpenMP wait policy, chosen by :func:`omp_wait_policy` from what the cores are
doing when the command starts. Spinning threads (libgomp's default: a bounded spin, then sleep;
``ACTIVE``: spin) are fastest on cores of their own, but compete with the thread that has work
whenever other jobs share the cores; ``PASSIVE`` threads sleep between parallel regions at once.
squad_tiny's 30 steps on 2 cores: on idle cores ``PASSIVE`` took 2.1-2.5x the time of
``ACTIVE`` (2026-11-28); beside other jobs ``ACTIVE`` took 5-8x the time of ``PASSIVE``
(``benchmarks/thread_policy.py``, docs/performance.md). So ``PASSIVE`` is set only when the
cores are oversubscribed -- other processes' busy cores (sampled over 0.2 s from
``/proc/stat``) plus this launch's threads exceed the cores -- and libgomp's default is kept
otherwise. ``OMP_WAIT_POLICY`` in the environment or ``dist_env`` decides instead.

The process defaults also bound the two caches in which torch's CPU oneDNN GEMMs (bf16 / fp16
matmuls on a CPU with AVX-512 or AMX) keep the kernels they build per shape: oneDNN's primitive cache
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's cache of their descriptors
(``LRU_CACHE_CAPACITY``), 1024 entries each by default, to :data:`GEMM_KERNEL_CACHE_ENTRIES`
each (:func:`gemm_kernel_cache_defaults`; the environment or ``dist_env`` decides instead).
An entry of both is 0.6-1.5 MB, whatever the weight's size (AMX brgemm kernels, torch 2.13.0,
2026-11-28), and a new one is built for every new row count: rows of varying length or
per-expert counts make new shapes every step, so a CPU bf16 rank grew toward ~1 GB of kernels
(the 48M MoE built 361 over 12 steps and ~12 more per step; LoRA on 4 FSDP ranks ~100 MB in
two steps). A step of the 48M MoE uses 125-150 shapes, and its bf16 step (4 x 512 tokens) took
the same time with the bound as with torch's caches (``benchmarks/bf16_vs_fp32.py
--kernel-caches``: 1.00x best step, 1.03x median); with no cache every GEMM call builds its
kernel (1-10 ms against a 1 ms GEMM). ``LRU_CACHE_CAPACITY=0`` crashes torch: the smallest
meaningful value is 1.

The CLI applies both right after loading the recipe, before importing torch. Call
``apply_dist_env(cfg.dist_env)`` yourself when driving hybridtrain from Python, before
``torch.cuda`` or ``torch.distributed`` are used.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from typing import Any, Callable, Mapping, MutableMapping

from hybridtrain.config.errors import ConfigError

__all__ = ["dist_env_vars", "apply_dist_env", "apply_process_defaults", "omp_wait_policy",
           "busy_cores", "gemm_kernel_cache_defaults", "gemm_kernel_cache_entries",
           "GEMM_KERNEL_CACHE_ENTRIES", "GEMM_KERNEL_CACHE_VARS", "GEMM_KERNEL_BYTES"]

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REPORTED: set[str] = set()  # variables already reported as "set in the environment"

# oneDNN's primitive cache and ideep's descriptor cache: entries each (module docstring)
GEMM_KERNEL_CACHE_ENTRIES = 128
GEMM_KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
GEMM_KERNEL_BYTES = 1 << 20  # one cached shape in both (what ``plan`` counts per entry)



def _default_where(section: Mapping) -> Callable[[str], str]:
    where = getattr(section, "where", None)
    if callable(where):
        return lambda key: where(key)
    return lambda key: "dist_env"


def dist_env_vars(section: Mapping[str, Any] | None,
                  where: Callable[[str], str] | None = None) -> dict[str, str]:
    """The variables a ``dist_env`` section asks for: ``{"NAME": "value"}`` (validated)."""
    if not section:
        return {}
    where = where or _default_where(section)
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key, value in section.items():
        if not isinstance(key, str) or not _NAME_RE.match(key):
            raise ConfigError(f"dist_env key {key!r} ({where(str(key))}) is not a valid "
                              f"environment variable name (letters, digits, _)")
        if value is None:
            raise ConfigError(
                f"dist_env.{key} is null ({where(key)}); give it a value (true/false, a "
                f"number or a string) or remove the key -- null is never exported")
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (int, float, str)):
            text = str(value)
        else:
            raise ConfigError(f"dist_env.{key} must be a string, number or boolean, got "
                              f"{type(value).__name__} {value!r} ({where(key)})")
        name = key.upper()
        if name in out:
            raise ConfigError(f"dist_env.{key} and dist_env.{origin[name]} both set {name} "
                              f"({where(key)}); keep one")
        out[name] = text
        origin[name] = key
    return out


def apply_dist_env(section: Mapping[str, Any] | None,
                   environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Export the section's variables into ``environ`` (default ``os.environ``).

    Returns the variables actually set. A variable already present keeps its value; if that
    differs from the recipe's, a warning says so (once per variable per process).
    """
    environ = os.environ if environ is None else environ
    wanted = dist_env_vars(section)
    applied: dict[str, str] = {}
    for name, value in wanted.items():
        current = environ.get(name)
        if current is None:
            environ[name] = value
            applied[name] = value
            continue
        if name in _REPORTED:
            continue
        _REPORTED.add(name)
        if current != value:
            logger.warning("dist_env: %s is already set in the environment to %r; keeping it "
                           "(the recipe asks for %r)", name, current, value)
        else:
            logger.debug("dist_env: %s already set to %r", name, current)
    if applied:
        logger.info("dist_env: set %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
        _warn_if_too_late()
    return applied


def _warn_if_too_late() -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        late = torch.cuda.is_initialized() or (torch.distributed.is_available()
                                               and torch.distributed.is_initialized())
    except Exception:  # noqa: BLE001 - a best-effort diagnostic only
        return
    if late:
        logger.warning("dist_env was applied after CUDA or the process group was initialised; "
                       "some variables may have no effect")


def busy_cores(window_s: float = 0.2) -> float | None:
    """Cores kept busy by other processes: the machine's busy time over ``window_s`` seconds
    (``/proc/stat``) less this process's own; ``None`` where ``/proc/stat`` cannot be read."""
    def sample() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        own = os.times()
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return sum(ticks[:8]) - idle, sum(ticks[:8]), own.user + own.system

    try:
        busy0, total0, own0 = sample()
        time.sleep(window_s)
        busy1, total1, own1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    cores = os.cpu_count() or 1
    busy = (busy1 - busy0) / (total1 - total0) * cores  # cores busy over the window
    return max(0.0, busy - (own1 - own0) / window_s)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def omp_wait_policy(environ: Mapping[str, str], local_processes: int = 1,
                    others: float | None = None, cores: int | None = None) -> str | None:
    """``"PASSIVE"`` when the cores this process may use are oversubscribed: ``others`` (the
    cores other processes keep busy, default :func:`busy_cores`, else the 1-minute load
    average) plus ``local_processes`` x threads (``OMP_NUM_THREADS``; 1 per launched worker,
    else one per core) exceed the cores by more than half a core; ``None`` (libgomp's default)
    otherwise."""
    cores = cores or _cores()
    if others is None:
        others = busy_cores()
    if others is None:
        others = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = int(environ.get("OMP_NUM_THREADS") or (1 if local_processes > 1 else cores))
    demand = others + local_processes * threads
    return "PASSIVE" if demand > cores + 0.5 else None


def gemm_kernel_cache_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Bound oneDNN's per-shape GEMM kernel caches (:data:`GEMM_KERNEL_CACHE_VARS`) to
    :data:`GEMM_KERNEL_CACHE_ENTRIES` entries each where ``environ`` (default ``os.environ``)
    does not set them; returns what was set. oneDNN and ideep read the variables when they build
    their first kernel, so with ``os.environ`` this takes effect until the process's first
    oneDNN operation (a CPU bf16 matmul, a convolution), also after ``import torch``."""
    environ = os.environ if environ is None else environ
    applied = {name: str(GEMM_KERNEL_CACHE_ENTRIES) for name in GEMM_KERNEL_CACHE_VARS
               if name not in environ}
    environ.update(applied)
    return applied


def gemm_kernel_cache_entries(environ: Mapping[str, str] | None = None) -> int:
    """The CPU GEMM kernels oneDNN keeps at most in a process started with ``environ`` (default
    ``os.environ``) once the process defaults are applied: the smaller of the two caches'
    bounds (torch's default, 1024, for one set to something else than an integer)."""
    environ = os.environ if environ is None else environ
    values = []
    for name in GEMM_KERNEL_CACHE_VARS:
        value = environ.get(name, str(GEMM_KERNEL_CACHE_ENTRIES))
        values.append(int(value) if value.strip().isdigit() else 1024)
    return min(values)


def apply_process_defaults(environ: MutableMapping[str, str] | None = None,
                           local_processes: int = 1, others: float | None = None
                           ) -> dict[str, str]:
    """Set ``OMP_WAIT_POLICY`` by :func:`omp_wait_policy` and the GEMM kernel cache bounds
    (:func:`gemm_kernel_cache_defaults`) where ``environ`` (default ``os.environ``) lacks them;
    returns what was set. ``local_processes``: the processes this command runs on the node
    (``--nproc-per-node``). Call after :func:`apply_dist_env` (a recipe's value wins) and before
    ``import torch`` (libgomp reads its variables once, when it loads; with ``os.environ`` after
    that, only the cache bounds are set)."""
    if environ is None:
        environ = os.environ
        if "torch" in sys.modules:  # libgomp has read its variables: nothing to choose
            return gemm_kernel_cache_defaults(environ)
    applied = gemm_kernel_cache_defaults(environ)
    if "OMP_WAIT_POLICY" in environ:
        return applied
    policy = omp_wait_policy(environ, local_processes, others)
    if policy is None:
        return applied
    environ["OMP_WAIT_POLICY"] = policy
    logger.info("OMP_WAIT_POLICY=%s: the cores are shared with other busy processes (set "
                "OMP_WAIT_POLICY yourself to choose)", policy)
    return {**applied, "OMP_WAIT_POLICY": policy}
