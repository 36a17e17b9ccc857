"""Triton kernels on CPU tensors: the stand-ins Triton's interpreter needs on a CPU build of torch.

With ``TRITON_INTERPRET=1`` in the environment before ``triton`` is imported, Triton runs its
kernels in Python on CPU tensors (slowly), so mamba_ssm's SSD and state-update kernels and
Liger's fused linear cross-entropy -- the kernels GPU users run -- can be checked on a CPU
(``hybridtrain finetune ... --training.mamba_kernels=true --training.fused_loss=liger`` and the
tests). Three things those packages call have no CPU answer, the interpreter computes one
wrong and one in vain; :func:`activate` stands in for them, only where ``TRITON_INTERPRET=1``
and torch has no CUDA device:

* Triton's autotuner times each configuration on a GPU timer the interpreter lacks ("0 active
  drivers"): a configuration "times" as the number of elements of its blocks, so the one with
  the smallest blocks is taken (the interpreter's cost grows with the block, and any
  configuration computes the same function; 2.5x faster than the first listed, mamba_ssm's
  128x256x64 blocks, on the tiny shapes of the tests).
* ``torch.cuda.device(None)`` (mamba_ssm enters ``torch.cuda.device(x.device.index)``, None for
  a CPU tensor) fails on a CPU build: it is a no-op for None, as its docstring says it is.
* ``torch.cuda.get_device_properties(...)`` (mamba_ssm's backward sizes its grid by
  ``multi_processor_count``) asserts on a CPU build: it answers with a one-processor device.
* ``tl.dot`` of bfloat16 operands: the interpreter holds a bfloat16 tensor as its ``uint16``
  bit patterns, and ``InterpreterBuilder.create_dot`` converts only 8-bit float operands before
  its ``np.matmul`` (``triton/runtime/interpreter.py``, line 631 in 3.7.1; the same in 3.6.0 and
  3.9.0; triton-lang/triton#11584, "not supported yet"), so it multiplies the bit patterns:
  ~1e10 for operands of order 1. mamba_ssm's SSD computes its chunk states (``x^T B``), ``C
  B^T`` and ``C`` times the states with ``tl.dot`` on bfloat16 x, B and C (what
  ``training.dtype: bfloat16`` gives it), and returned ~5e9. The stand-in takes bfloat16 operands (and accumulator) to float32 first,
  as a GPU does: exact bfloat16 products summed in float32. (Loads, stores and casts of
  bfloat16 are right, but a float32 -> bfloat16 cast truncates where a GPU rounds to nearest:
  within one bfloat16 ulp. mamba_ssm's SSD and state update do no other arithmetic on bfloat16
  values.)
* Integer overflow checks: Triton widens every integer ``+``, ``-``, ``*`` of a kernel to int64
  and compares it with the type's range (``sanitize_overflow``) for a ``device_assert`` that,
  without ``debug``, is dropped (``semantic.device_assert``). A GPU build compiles the dead
  checks away; the interpreter, run op by op, computes them: more than half of the time of
  mamba_ssm's SSD forward and backward. With ``debug`` off (the interpreter's default) the
  stand-in turns ``sanitize_overflow`` off in the interpreter's options: same results, no check
  lost.

This is the one module of the project that replaces attributes of other packages at run time;
nothing else does, and nothing here acts without the interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types

import torch

__all__ = ["interpreting", "activate"]


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter in this process (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _CpuDevice(torch.cuda.device):
    """``torch.cuda.device`` that does nothing for ``None`` (a CPU tensor's device index)."""

    def __init__(self, device):
        self.idx = None if device is None else torch.cuda._get_device_index(device, optional=True)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx is not None:
            super().__enter__()

    def __exit__(self, *exc):
        if self.idx is not None:
            return super().__exit__(*exc)
        return False


def _cpu_device_properties(device=None):
    return types.SimpleNamespace(name="CPU (Triton interpreter)", multi_processor_count=1, gcnArchName="",
                                 major=0, minor=0, total_memory=0)


def _untimed_bench(self, *args, config, **meta):
    size = float(math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool)))
    return [size, size, size]


def _dot_in_float32(create_dot):
    """``InterpreterBuilder.create_dot`` with bfloat16 operands and accumulator taken as float32
    (their values, not their bit patterns); the result in the accumulator's dtype."""
    import triton.language as tl

    @functools.wraps(create_dot)
    def dot(self, a, b, d, *args, **kwargs):
        def f32(h):
            return self.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h

        out = create_dot(self, f32(a), f32(b), f32(d), *args, **kwargs)
        return self.cast_impl(out, tl.bfloat16) if d.dtype.scalar == tl.bfloat16 else out

    return dot


@functools.cache
def activate() -> bool:
    """Puts the stand-ins in place where ``TRITON_INTERPRET=1`` and there is no CUDA device;
    returns whether it did (once per process; a no-op elsewhere)."""
    if not interpreting() or torch.cuda.is_available():
        return False
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    Autotuner._bench = _untimed_bench
    interpreter.InterpreterBuilder.create_dot = _dot_in_float32(interpreter.InterpreterBuilder.create_dot)
    options = interpreter.interpreter_builder.options
    if not options.debug:
        interpreter.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)
    torch.cuda.device = _CpuDevice
    torch.cuda.get_device_properties = _cpu_device_properties
    return True
