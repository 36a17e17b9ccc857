"""Triton kernels on CPU tensors: the stand-ins Triton's interpreter needs on a CPU build of torch.

With ``TRITON_INTERPRET=1`` in the environment before ``triton`` is imported, Triton runs its
kernels in Python on CPU tensors (slowly), so mamba_ssm's SSD and state-update kernels and
Liger's fused linear cross-entropy -- the kernels GPU users run -- can be checked on a CPU
(``hybridtrain finetune ... --training.mamba_kernels=true --training.fused_loss=liger`` and the
tests). Three things those packages call have no CPU answer, and :func:`activate` stands in for
them, only where ``TRITON_INTERPRET=1`` and torch has no CUDA device:

* Triton's autotuner times each configuration on a GPU timer the interpreter lacks ("0 active
  drivers"): a configuration "times" as the number of elements of its blocks, so the one with
  the smallest blocks is taken (the interpreter's cost grows with the block, and any
  configuration computes the same function; 2.5x faster than the first listed, mamba_ssm's
  128x256x64 blocks, on the tiny shapes of the tests).
* ``torch.cuda.device(None)`` (mamba_ssm enters ``torch.cuda.device(x.device.index)``, None for
  a CPU tensor) fails on a CPU build: it is a no-op for None, as its docstring says it is.
* ``torch.cuda.get_device_properties(...)`` (mamba_ssm's backward sizes its grid by
  ``multi_processor_count``) asserts on a CPU build: it answers with a one-processor device.

This is the one module of the project that replaces attributes of other packages at run time;
nothing else does, and nothing here acts without the interpreter.
"""

from __future__ import annotations

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


@functools.cache
def activate() -> bool:
    """Puts the stand-ins in place where ``TRITON_INTERPRET=1`` and there is no CUDA device;
    returns whether it did (once per process; a no-op elsewhere)."""
    if not interpreting() or torch.cuda.is_available():
        return False
    from triton.runtime.autotuner import Autotuner

    Autotuner._bench = _untimed_bench
    torch.cuda.device = _CpuDevice
    torch.cuda.get_device_properties = _cpu_device_properties
    return True
