"""AdamW with weight-decay param groups, and gradient clipping (in place, before the step)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn


logger = logging.getLogger(__name__)

# Parameters named like this never get weight decay (Mamba's SSM parameters, norms, biases).
NO_DECAY_NAMES = ("A_log", "D", "dt_bias", "bias")
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """True for 1-D (and 0-D) tensors, biases, norm weights and Mamba's A_log / D / dt_bias."""
    if param.ndim < 2:
        return True
    parts = name.split(".")
    if parts[-1] in NO_DECAY_NAMES:
        return True
    return any("norm" in p.lower() for p in parts[:-1])


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Groups over the trainable parameters: with and without weight decay, each split into
    plain tensors and DTensors when a model holds both (tensor parallelism without FSDP: the
    fused / foreach kernels take one kind per call)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        groups.setdefault((is_no_decay(name, p), isinstance(p, DTensor)), []).append(p)
    if not groups:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    return [{"params": groups[k], "weight_decay": 0.0 if k[0] else float(weight_decay)}
            for k in sorted(groups)]


def _fused_supported(params: Iterable[torch.Tensor]) -> bool:
    for p in params:
        if p.device.type not in ("cuda", "cpu") or not p.is_floating_point():
            return False
    return True


def build_optimizer(
    model: nn.Module,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    betas: tuple[float, float] | list[float] = (0.9, 0.999),
    eps: float = 1e-8,
    implementation: str = "auto",
    name: str = "adamw",
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over :func:`param_groups`.

    ``implementation``: ``auto`` (fused where the params' devices support it, else foreach),
    ``fused``, ``foreach`` or ``for_loop``.
    """
    if name.lower() != "adamw":
        raise ValueError(f"optimizer.name={name!r}: only 'adamw' is supported")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"optimizer.implementation={implementation!r} is not one of {IMPLEMENTATIONS}"
        )
    groups = param_groups(model, weight_decay)
    params = [p for g in groups for p in g["params"]]
    kwargs = dict(lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps))
    if implementation == "auto":
        implementation = "fused" if _fused_supported(params) else "foreach"
    if implementation == "fused":
        if not _fused_supported(params):
            raise ValueError(
                "optimizer.implementation='fused' needs floating-point parameters on cpu or cuda; "
                "use 'foreach'"
            )
        kwargs["fused"] = True
    elif implementation == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    opt = torch.optim.AdamW(groups, **kwargs)
    n_decay = sum(p.numel() for g in groups if g["weight_decay"] for p in g["params"])
    logger.info(
        "AdamW (%s): %d params with weight decay %.3g, %d without",
        implementation, n_decay, weight_decay, sum(p.numel() for p in params) - n_decay,
    )
    return opt
