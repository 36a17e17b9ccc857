"""Bytes a rank really holds: local shards of parameters, gradients and optimizer state (what
``hybridtrain plan`` predicts)."""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: summed local tensor bytes on this rank."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_nbytes(v) for state in optimizer.state.values()
                         for v in state.values() if torch.is_tensor(v)),
    }


def planned_bytes(plan, rank: int) -> dict[str, float]:
    r = plan.ranks[rank]
    return {"params": r.params, "grads": r.grads, "optimizer": r.optimizer}


def assert_close_10pct(got: dict, want: dict, what: str) -> None:
    for k in ("params", "grads", "optimizer"):
        assert got[k] > 0, (what, k, got)
        assert abs(want[k] - got[k]) <= 0.10 * got[k], (what, k, got, want)


def held_at_optimizer_step(b, trainer, steps: int = 2) -> dict[str, int]:
    """:func:`held_bytes` just before the optimizer step of the last of ``steps`` training steps
    (the trainer drops the gradients after each step; the state exists from the second on)."""
    from tests.helpers import parity as pu

    seen = []
    handle = b.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(held_bytes(b.model, opt)))
    try:
        pu.train(b, trainer, steps=steps)
    finally:
        handle.remove()
    return seen[-1]
