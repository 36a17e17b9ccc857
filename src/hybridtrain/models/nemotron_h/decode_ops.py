"""The projections and norms of a decoding step (the mixers' ``step`` methods and the loop's
final norm and head): the layers' own math, called without their module hooks, in the few-row
product forms ``ops.backend`` chooses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.distributed.utils import local_tensor
from hybridtrain.ops import backend

from .norms import RMSNorm


def plain_linear(lin: nn.Module) -> bool:
    """An ``nn.Linear`` running ``nn.Linear.forward`` (not a LoRA layer; FSDP2's wrapper class
    keeps the forward) on a plain, not tensor-parallel, weight."""
    return (isinstance(lin, nn.Linear) and type(lin).forward is nn.Linear.forward
            and local_tensor(lin.weight) is lin.weight)


def linear(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` for the few rows of a decoding step: a plain ``nn.Linear`` as
    :func:`hybridtrain.ops.backend.few_rows_linear` (no module call: the LM head is part of an
    FSDP2 unit whose hooks must not run here, see :func:`norm`); else ``lin``'s forward (LoRA,
    tensor-parallel)."""
    if plain_linear(lin):
        return backend.few_rows_linear(x, lin.weight, lin.bias)
    return lin(x)


def norm(module: RMSNorm, x: torch.Tensor, step: bool = True) -> torch.Tensor:
    """``module(x)`` in a decoding step (``step``; else the prompt's prefill); in a step of an fp32
    model torch's fused ``rms_norm`` (the same function in one kernel instead of six for the one
    row). A plain (not tensor-parallel) norm
    runs without its module call: the final norm is part of an FSDP2 unit whose hooks must not
    run here (FSDP2 wants a forward through the root first; the caller gathered the weights)."""
    x = x if x.dtype == module.weight.dtype else x.to(module.weight.dtype)
    if (not isinstance(module, RMSNorm) or type(module).forward is not RMSNorm.forward
            or local_tensor(module.weight) is not module.weight):
        return module(x)
    if step and x.dtype == torch.float32:
        return F.rms_norm(x, module.weight.shape, module.weight, module.eps)
    return module.normalize(x)
