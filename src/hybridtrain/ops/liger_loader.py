"""Finding Liger-Kernel's fused linear cross-entropy for :mod:`hybridtrain.ops.liger` (the call)
and :mod:`hybridtrain.ops.backend` (``training.fused_loss``): imported when first asked for
(under Triton's interpreter with its stand-ins, :mod:`hybridtrain.ops.triton_interpret`), and
checked against the positional arguments the call passes."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect

from hybridtrain.ops import triton_interpret

# the positional arguments :func:`linear_cross_entropy` passes (``LigerFusedLinearCrossEntropyFunction
# .forward`` after ``ctx``; releases before chunk_mem_const take fewer: a TypeError at the first loss)
POSITIONAL = ("_input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale",
              "label_smoothing", "reduction", "softcap", "return_z_loss", "accum_dtype", "use_token_scaling",
              "return_token_accuracy", "return_predicted_tokens", "ce_impl", "ce_mode", "chunk_mem_const")
FIX = "pip install 'liger-kernel>=0.8.5' (extra hybridtrain[cuda])"


@functools.cache
def fused_function():
    triton_interpret.activate()  # (only under TRITON_INTERPRET=1 without a GPU)
    return importlib.import_module("liger_kernel.ops.fused_linear_cross_entropy").LigerFusedLinearCrossEntropyFunction


def version() -> str | None:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def signature_problem(forward) -> str | None:
    """Why ``forward`` (a ``LigerFusedLinearCrossEntropyFunction.forward``) cannot take the call
    :func:`linear_cross_entropy` makes, or None."""
    names = [p.name for p in inspect.signature(forward).parameters.values()][1:]  # (after ctx)
    if tuple(names[:len(POSITIONAL)]) != POSITIONAL:
        return (f"its LigerFusedLinearCrossEntropyFunction takes ({', '.join(names)}), not the "
                f"({', '.join(POSITIONAL)}) hybridtrain calls")
    return None


@functools.cache
def problem() -> str | None:
    """Why Liger's fused linear cross-entropy cannot be used here (not installed, does not
    import, or a release whose signature differs from the call), with the fix; None if it can."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger-kernel is not installed; {FIX}"
    try:
        fn = fused_function()
    except Exception as e:  # ImportError, a broken triton
        return f"liger-kernel {version()} does not import ({type(e).__name__}: {e}); {FIX}"
    why = signature_problem(fn.forward)
    return None if why is None else f"liger-kernel {version()}: {why}; {FIX}"


def describe() -> str:
    return f"liger-kernel {version()} LigerFusedLinearCrossEntropyFunction (Triton)"
