"""Auxiliary training losses that reach the gradient without changing the reported loss.

A model with extra objectives (predicting tokens further ahead, balancing its experts) computes
each term's *sum* in its forward and hands them to :meth:`AuxiliaryLoss.attach` together with its
main loss: the value returned is the main loss unchanged (the logged ``loss``, every parity
figure and validation stay the language-model loss), and backward sends each term the gradient
``weight / count``, where ``count`` is the term's normaliser over the whole global batch (e.g.
the number of positions with a target at that depth, over all micro-batches and data-parallel
ranks). This is Megatron's ``MTPLossAutoScaler`` scheme, with the normaliser known before the
first forward as the main loss's is.

The trainer drives one step::

    aux.counts(batch)           # per micro-batch, before any forward: [T] normaliser parts
    aux.begin_step(global)      # the all-reduced counts: sets the gradient scales
    ... forward / backward: the model calls aux.attach(loss, terms) ...
    aux.step_sums()             # [T] this rank's detached term sums (to all-reduce)
    aux.record(sums, counts)    # {name: value} for the step's record

Outside a step (evaluation, generation, ``begin_step`` never called) ``attach`` returns the main
loss and adds nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class _AttachGradient(torch.autograd.Function):
    """Returns ``loss``; backward gives each term the fixed gradient ``scales[k]``."""

    @staticmethod
    def forward(ctx, loss, scales, *terms):
        ctx.scales = scales
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in terms]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = [torch.full(shape, float(s), dtype=dtype, device=device)
                 for (shape, dtype, device), s in zip(ctx.shapes, ctx.scales)]
        return (grad, None, *grads)


class AuxiliaryLoss:
    """``names``: the terms' record keys; ``weights``: each term's weight in the objective;
    ``count(batch)``: a micro-batch's normaliser of each term, a float64 tensor [T];
    ``averages``: further record keys, each the mean of the values of some terms (by index)."""

    def __init__(self, names: Sequence[str], weights: Sequence[float],
                 count: Callable[[dict], torch.Tensor],
                 averages: dict[str, Sequence[int]] | None = None):
        assert len(names) == len(weights)
        self.names, self.weights, self.count_fn = tuple(names), tuple(float(w) for w in weights), count
        self.averages = dict(averages or {})
        self._scales: list[float] | None = None
        self._sums: torch.Tensor | None = None

    @property
    def num_terms(self) -> int:
        return len(self.names)

    def counts(self, batch: dict) -> torch.Tensor:
        return self.count_fn(batch).to(torch.float64).cpu()

    def begin_step(self, global_counts: torch.Tensor) -> None:
        counts = [float(c) for c in global_counts]
        self._scales = [w / c if c > 0 else 0.0 for w, c in zip(self.weights, counts)]
        self._sums = None

    def end_step(self) -> None:
        self._scales = None

    @property
    def active(self) -> bool:
        return self._scales is not None and torch.is_grad_enabled()

    def attach(self, loss: torch.Tensor, terms: Sequence[torch.Tensor],
               at: Sequence[int] | None = None) -> torch.Tensor:
        """``loss`` with the terms' gradients attached (see the module docstring). ``loss`` may be
        any tensor (a pipeline stage before the last attaches its part of a term to its output:
        backward passes the output's gradient on); ``at``: the indices of ``terms`` among the
        objective's (None: all of them, in order)."""
        if not self.active:
            return loss
        at = list(range(self.num_terms) if at is None else at)
        assert len(at) == len(terms), (at, len(terms))
        sums = torch.stack([t.detach().float().reshape(()) for t in terms])
        sums = torch.zeros(self.num_terms, dtype=sums.dtype, device=sums.device).index_add_(
            0, torch.tensor(at, device=sums.device), sums)
        self._sums = sums if self._sums is None else self._sums + sums.to(self._sums.device)
        return _AttachGradient.apply(loss, [self._scales[i] for i in at], *terms)

    def step_sums(self, device: torch.device | str) -> torch.Tensor:
        """This rank's term sums of the step (zeros where no forward attached any)."""
        if self._sums is None:
            return torch.zeros(self.num_terms, dtype=torch.float64, device=device)
        return self._sums.to(device, torch.float64)

    def record(self, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float | None]:
        """The step's values: each term's sum over its count (None without a count)."""
        values = [float(s) / float(c) if float(c) > 0 else None for s, c in zip(sums, counts)]
        out = {n: v for n, v in zip(self.names, values)}
        for key, terms in self.averages.items():
            known = [values[i] for i in terms if values[i] is not None]
            out[key] = sum(known) / len(known) if known else None
        return out

    @property
    def summary_names(self) -> list[str]:
        """The record keys a progress line shows: the averages, and the terms not averaged."""
        averaged = {i for terms in self.averages.values() for i in terms}
        return list(self.averages) + [n for i, n in enumerate(self.names) if i not in averaged]
