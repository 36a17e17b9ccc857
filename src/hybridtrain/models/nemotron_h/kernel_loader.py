"""Finding the Mamba2 kernels (``mamba_ssm``'s Triton SSD and state update, ``causal_conv1d``'s
CUDA C++ conv) by module name when first needed, for :mod:`.kernels` (the dispatch) and
:mod:`.kernel_ops` (the custom ops that call them). A test can stand fake modules in
``sys.modules`` and call :func:`forget_loaded`.

``import mamba_ssm`` runs a package ``__init__`` that loads its C++ extension
(``selective_scan_cuda``), absent from a ``MAMBA_SKIP_CUDA_BUILD`` install or broken by a wheel
built for another torch; where it fails, the Triton modules are loaded without that
``__init__`` (:func:`_import`), and a later ``import mamba_ssm`` fails as it did before.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import warnings

import torch

from hybridtrain.ops import triton_interpret

log = logging.getLogger(__name__)

MAMBA_SSM_FLOOR = (2, 2, 5)  # the exp clamp (upstream PR #713) and the seq_idx fix (#746)

# name -> (module, attribute, package to install)
KERNELS = {
    "ssd_fwd": ("mamba_ssm.ops.triton.ssd_combined", "_mamba_chunk_scan_combined_fwd", "mamba-ssm"),
    "ssd_bwd": ("mamba_ssm.ops.triton.ssd_combined", "_mamba_chunk_scan_combined_bwd", "mamba-ssm"),
    "selective_state_update": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update",
                               "mamba-ssm"),
    "causal_conv1d_fn": ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update", "causal-conv1d"),
    # causal_conv1d's C++ entry points (releases before 1.5.1: no torch.library ops of their own)
    "conv_fwd_cpp": ("causal_conv1d_cuda", "causal_conv1d_fwd", "causal-conv1d"),
    "conv_bwd_cpp": ("causal_conv1d_cuda", "causal_conv1d_bwd", "causal-conv1d"),
}
TRITON_PACKAGES = {"mamba-ssm"}  # Triton kernels: run on CPU tensors under the interpreter
_loaded: dict = {}  # kernel name -> its function or None; "conv_own_ops" -> bool
_failures: dict[str, str] = {}  # kernel name -> why it does not import
_init_skipped: dict[str, str] = {}  # package -> why its __init__ was not run


def kernel(name: str):
    """The kernel function ``name`` (a key of :data:`KERNELS`), or None where its package does
    not import (not installed, or a CUDA build that fails to load; the reason in
    :data:`_failures`). Looked up once (a dict read afterwards, also while compiling)."""
    if name not in _loaded:
        _loaded[name] = _load(name)
    return _loaded[name]


def _load(name: str):
    module, attr, _ = KERNELS[name]
    try:
        triton_interpret.activate()  # (only under TRITON_INTERPRET=1 without a GPU)
        fn = getattr(_import(module), attr)
    except Exception as e:  # ImportError, or a broken CUDA build
        _failures[name] = f"{type(e).__name__}: {e}"
        log.debug("%s unavailable: %s", name, e)
        return None
    if module.startswith("mamba_ssm."):
        _check_mamba_ssm_version()
    if module == "causal_conv1d":
        _loaded["conv_own_ops"] = hasattr(torch.ops.DaoAILab, "_causal_conv1d_fwd_cpp")
    return fn


def _import(module: str):
    """``importlib.import_module(module)``; for a ``mamba_ssm`` submodule whose package
    ``__init__`` fails (its C++ extension), the submodule loaded under a package shell that
    does not run that ``__init__``, removed again afterwards."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.partition(".")[0]
        spec = importlib.util.find_spec(top) if top == "mamba_ssm" and top not in sys.modules else None
        if spec is None or not spec.submodule_search_locations:
            raise
        shell = importlib.util.module_from_spec(spec)  # the package, its __init__ not executed
        sys.modules[top] = shell
        try:
            mod = importlib.import_module(module)
        finally:
            if sys.modules.get(top) is shell:
                del sys.modules[top]
        _init_skipped[top] = f"{type(e).__name__}: {e}"
        log.info("%s: loaded without the package __init__ (%s)", module, _init_skipped[top])
        return mod


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def mamba_ssm_floor_problem(version: str | None) -> str | None:
    """The NaN risk of a mamba-ssm ``version`` older than 2.2.5, or None."""
    if version is None:
        return None
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    if release >= MAMBA_SSM_FLOOR:
        return None
    return (f"mamba-ssm {version} is older than 2.2.5: its SSD lacks the exp clamp and the seq_idx fix "
            "(upstream PRs #713, #746), so Nemotron-H's large A*dt can give inf/NaN losses; pip install "
            "'mamba-ssm>=2.2.5' (extra hybridtrain[cuda])")


@functools.cache
def _check_mamba_ssm_version() -> None:
    problem = mamba_ssm_floor_problem(package_version("mamba-ssm"))
    if problem:
        log.warning(problem)
        warnings.warn(problem, stacklevel=3)


def conv_has_own_ops() -> bool:
    """Whether the installed causal_conv1d registers ``torch.library`` ops of its own (1.5.1
    and later: ``DaoAILab::_causal_conv1d_fwd_cpp``), so compile traces its functions; before,
    its C++ entry points are wrapped as :mod:`.kernel_ops` ops. (Read when it was loaded.)"""
    return _loaded.get("conv_own_ops", False)


def forget_loaded() -> None:
    """Look the kernels up again on next use (and how their packages loaded)."""
    _loaded.clear()
    _failures.clear()
    _init_skipped.clear()
