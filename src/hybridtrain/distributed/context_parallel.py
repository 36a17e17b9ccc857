"""Context parallelism: one sequence over the ``cp`` ranks of a group, in contiguous slices.

::

    shard_batch(batch, rank, size, length=None) -> dict   # this rank's slice of a collated batch
    shard_batches(batches, rank, size)      # ... of several, one padded length on every rank
    ContextParallel(group)                                  # this rank's place in the cp group
    gather_sequence(x, dim, cp)         # all-gather along the sequence (backward: reduce-scatter)
    halo_from_previous(x, width, dim, cp)   # the ``width`` positions before this rank's slice
    pass_states(state, decay, cp)       # the state entering this rank's slice (a recurrence)

Rank ``r`` holds positions ``[r·L/cp, (r+1)·L/cp)`` of every row. Slices are contiguous (no
zig-zag) because recurrent layers hand one state from slice to slice: with contiguous slices a
layer sends one state and one halo per rank, whatever the sequence length; a causal-attention
load balance (zig-zag) would need a second state chain and gives nothing to layers that are not
attention. Labels are shifted before sharding (the collator's ``labels[t]`` is the target of
``input_ids[t]``), so every slice computes its own part of the loss; counts and sums are then
taken over the data-parallel × context-parallel group.

Every cross-rank op is an autograd function: backward sends the gradients the other way (the
halo's gradient back to the previous rank, a state's gradient to the rank that produced it,
the gathered sequence's gradient reduce-scattered). ``ContextParallel.bytes_sent`` counts the
bytes each kind of op sent from this rank in eager blocks (benchmarks read it).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

import torch
import torch.distributed as dist

from hybridtrain.data.batch import IGNORE_INDEX
from hybridtrain.data.micro_batches import position_ids_from_cu_seqlens

__all__ = ["ContextParallel", "shard_batch", "shard_batches", "unshard_rows", "gather_sequence", "halo_from_previous",
           "pass_states"]

_DROP = ("cu_seqlens", "max_seqlen", "num_tokens", "num_label_tokens")


class ContextParallel:
    """This rank's coordinates in a context-parallel process group, and the bytes it sent."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.bytes_sent: Counter = Counter()

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, size={self.size})"

    def _count(self, kind: str, t: torch.Tensor) -> None:
        """Count an eager exchange; a compiled block counts none (dynamo refuses a Python side
        effect inside a checkpointed block)."""
        if not torch.compiler.is_compiling():
            self.bytes_sent[kind] += t.numel() * t.element_size()

    def send(self, t: torch.Tensor, to: int, kind: str, tag: int) -> None:
        self._count(kind, t)
        dist.send(t.contiguous(), group=self.group, group_dst=to, tag=tag)

    def recv(self, like: torch.Tensor, frm: int, tag: int) -> torch.Tensor:
        t = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(t, group=self.group, group_src=frm, tag=tag)
        return t


# -- batches ----------------------------------------------------------------------------------
def _positions(batch: Mapping[str, Any], B: int, L: int) -> torch.Tensor:
    pos = batch.get("position_ids")
    if pos is not None:
        return pos.expand(B, L) if pos.dim() == 2 else pos.view(1, L).expand(B, L)
    if batch.get("cu_seqlens") is not None:
        return position_ids_from_cu_seqlens(batch["cu_seqlens"], B, L)
    return torch.arange(L, device=batch["input_ids"].device).expand(B, L)


def shard_batch(batch: Mapping[str, Any], rank: int, size: int, length: int | None = None
                ) -> dict[str, Any]:
    """Context-parallel rank ``rank``'s slice of a collated batch: ``input_ids``, ``labels``,
    ``position_ids`` and ``attention_mask`` cut along the sequence into ``size`` contiguous
    slices. Rows are first right-padded to ``length`` (default: the batch's), rounded up to a
    multiple of ``size`` (pad tokens, labels ignored, positions continuing the last document,
    so nothing real changes). ``cu_seqlens`` (flattened over the whole rows) becomes the
    ``position_ids`` it implies; ``num_tokens``/``num_label_tokens`` are those of the slice."""
    ids = batch["input_ids"]
    B, L = ids.shape
    n = max(L, length or 0)
    n = -(-n // size) * size
    pad = n - L
    pos = _positions(batch, B, L)
    real = batch.get("attention_mask")
    real = torch.ones_like(ids) if real is None else real
    cols = {"input_ids": (ids, 0), "labels": (batch["labels"], IGNORE_INDEX),
            "attention_mask": (real, 0)}
    out = {k: v for k, v in batch.items() if k not in _DROP and k not in cols}
    if pad:
        step = torch.arange(1, pad + 1, device=pos.device)
        pos = torch.cat([pos, pos[:, -1:] + step], dim=1)
    chunk = n // size
    sl = slice(rank * chunk, (rank + 1) * chunk)
    out["position_ids"] = pos[:, sl].contiguous()
    for k, (t, fill) in cols.items():
        if pad:
            t = torch.cat([t, t.new_full((B, pad), fill)], dim=1)
        out[k] = t[:, sl].contiguous()
    out["num_tokens"] = out["attention_mask"].sum()
    out["num_label_tokens"] = (out["labels"] != IGNORE_INDEX).sum()
    return out


def unshard_rows(x: torch.Tensor, group) -> torch.Tensor:
    """The whole rows ``[B, size * chunk]`` of every rank's slice ``x`` ``[B, chunk]`` (the
    contiguous slices of :func:`shard_batch`) over the context-parallel ``group``."""
    size = dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather(out, x.contiguous(), group)
    return out.view(size, *x.shape).transpose(0, 1).reshape(x.shape[0], -1, *x.shape[2:])


def shard_batches(batches: list[Mapping[str, Any]], rank: int, size: int) -> list[dict[str, Any]]:
    """:func:`shard_batch` of every batch, all padded to the longest row of every rank's batches
    (one all-reduce): slices must line up across ranks, and a pipeline runs one length per step
    (padding a slice on the right would put pad tokens inside the sequence)."""
    length = max(b["input_ids"].shape[1] for b in batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([length], device=batches[0]["input_ids"].device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        length = int(t)
    return [shard_batch(b, rank, size, length) for b in batches]


# -- collectives with autograd ----------------------------------------------------------------
def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, cp):
        ctx.dim, ctx.cp = dim, cp
        xs = x.movedim(dim, 0).contiguous()
        out = xs.new_empty((cp.size * xs.shape[0],) + tuple(xs.shape[1:]))
        cp._count("gather", xs)
        _all_gather(out, xs, cp.group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, g):
        cp = ctx.cp
        gs = g.movedim(ctx.dim, 0).contiguous()
        out = gs.new_empty((gs.shape[0] // cp.size,) + tuple(gs.shape[1:]))
        cp._count("gather_grad", gs)
        _reduce_scatter(out, gs, cp.group)
        return out.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, cp: ContextParallel) -> torch.Tensor:
    """The whole sequence from every rank's slice ``x`` (concatenated along ``dim`` in rank
    order); backward reduce-scatters the gradient back to the slices. Under ``torch.compile``
    the same exchange as a functional collective (traceable; not counted in ``bytes_sent``)."""
    if torch.compiler.is_compiling():
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        xs = x.movedim(dim, 0).contiguous()
        return all_gather_tensor_autograd(xs, 0, cp.group).movedim(0, dim)
    return _GatherSequence.apply(x, dim, cp)


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tail, cp):
        ctx.cp = cp
        if cp.rank + 1 < cp.size:
            cp.send(tail, cp.rank + 1, "halo", tag=11)
        if cp.rank == 0:
            return torch.zeros_like(tail)
        return cp.recv(tail, cp.rank - 1, tag=11)

    @staticmethod
    def backward(ctx, g):
        cp = ctx.cp
        if cp.rank > 0:
            cp.send(g, cp.rank - 1, "halo_grad", tag=12)
        if cp.rank + 1 < cp.size:
            return cp.recv(g, cp.rank + 1, tag=12), None
        return torch.zeros_like(g), None


def halo_from_previous(x: torch.Tensor, width: int, dim: int, cp: ContextParallel) -> torch.Tensor:
    """The ``width`` positions (along ``dim``) before this rank's slice: the end of the previous
    rank's slice, zeros before the sequence start. Backward returns their gradient to the ranks
    they came from. One send per rank; a slice shorter than ``width`` (a short row over many
    ranks) takes its halo from the ends of all earlier slices (an all-gather of ``width`` or
    fewer positions per rank)."""
    n = x.shape[dim]
    if n >= width and torch.compiler.is_compiling():  # traceable: every rank's tail, all-gathered
        tails = _gathered(x.narrow(dim, n - width, width), "halo", cp)
        return _own(torch.cat([torch.zeros_like(tails[:1]), tails[:-1]]), cp)  # rank r's at r
    if n >= width:
        return _Halo.apply(x.narrow(dim, n - width, width), cp)
    before = gather_sequence(x, dim, cp).narrow(dim, 0, cp.rank * n)  # every earlier position
    missing = width - before.shape[dim]
    if missing > 0:
        shape = list(x.shape)
        shape[dim] = missing
        before = torch.cat([x.new_zeros(shape), before], dim=dim)
    return before.narrow(dim, before.shape[dim] - width, width)


class _PassStates(torch.autograd.Function):
    """E_0 = 0, E_{r+1} = S_r + G_r · E_r, one hop per rank (a chain over the cp ranks)."""

    @staticmethod
    def forward(ctx, state, decay, cp):
        ctx.cp = cp
        enter = torch.zeros_like(state) if cp.rank == 0 else cp.recv(state, cp.rank - 1, tag=13)
        if cp.rank + 1 < cp.size:
            cp.send(state + decay * enter, cp.rank + 1, "state", tag=13)
        ctx.save_for_backward(decay, enter)
        ctx.decay_shape = decay.shape
        return enter

    @staticmethod
    def backward(ctx, g_enter):
        cp = ctx.cp
        decay, enter = ctx.saved_tensors
        if cp.rank + 1 < cp.size:
            g_next = cp.recv(enter, cp.rank + 1, tag=14)  # dLoss/dE_{r+1}, all of it
        else:
            g_next = torch.zeros_like(enter)
        if cp.rank > 0:
            cp.send(g_enter + decay * g_next, cp.rank - 1, "state_grad", tag=14)
        g_decay = g_next * enter
        dims = [i for i, (a, b) in enumerate(zip(ctx.decay_shape, g_decay.shape)) if a == 1 and b != 1]
        if dims:
            g_decay = g_decay.sum(dims, keepdim=True)
        return g_next, g_decay, None


def pass_states(state: torch.Tensor, decay: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The state entering this rank's slice of a linear recurrence ``S_t = a_t S_{t-1} + u_t``.

    ``state``: this slice's final state started from zero; ``decay`` (broadcastable to it,
    same number of dims): the product of the slice's ``a_t`` (zero where the slice restarts the
    recurrence, e.g. at a document start). Returns ``E_r = S_{r-1} + G_{r-1} E_{r-1}``
    (``E_0 = 0``): each rank receives one state from the previous rank and sends one to the
    next -- bytes independent of the sequence length. Backward sends the gradient of the
    entering state back along the chain."""
    assert decay.dim() == state.dim(), (decay.shape, state.shape)
    if torch.compiler.is_compiling():  # traceable: every rank's state and decay, all-gathered
        both = _gathered(torch.stack([state, decay.expand_as(state)]), "state", cp)  # one exchange
        enters = [torch.zeros_like(state)]  # every rank's, as the chain passes them
        for r in range(cp.size - 1):
            enters.append(both[r, 0] + both[r, 1] * enters[-1])
        return _own(torch.stack(enters), cp)
    return _PassStates.apply(state, decay, cp)


def _own(per_rank: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``per_rank[cp.rank]``, taken by an index tensor: every rank traces the same graph, in
    which the gradient of every entry depends on the output's gradient. (A rank that read a
    constant instead -- rank 0's zero halo or state -- would leave its all-gather's
    reduce-scatter a value of the forward alone, which AOT autograd then runs in that rank's
    forward while the other ranks run it in backward: the ranks hang.)"""
    index = torch.full((1,), cp.rank, dtype=torch.long, device=per_rank.device)
    return per_rank.index_select(0, index).squeeze(0)


def _gathered(x: torch.Tensor, kind: str, cp: ContextParallel) -> torch.Tensor:
    """[cp.size, *x.shape]: ``x`` of every rank (a functional all-gather, traceable by
    ``torch.compile``; backward reduce-scatters the gradients to their ranks). The compiled
    form of the point-to-point exchanges (dynamo does not trace send/recv): ``cp.size`` times
    the bytes of one hop, for the few small tensors a halo or a state is."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    cp._count(kind, x)
    return all_gather_tensor_autograd(x.contiguous()[None], 0, cp.group)
