"""QLoRA's frozen 4-bit base: the weights under the LoRA adapters stored as torchao's NF4.

``quantize_base(model)`` (:mod:`hybridtrain.peft.lora`; ``peft.base_quant: nf4``, after ``apply_lora``)
turns every frozen weight LoRA could adapt into an ``NF4Tensor`` parameter (``requires_grad=False``,
same name): 4-bit NormalFloat codes in blocks of 64 with double-quantised (int8) block scales.
Which weights: every linear layer but ``lm_head`` and every stacked-experts module (the spec's
``expert_modules``), adapted or not; experts are held by a :class:`LoRAExperts` (one without
adapters where LoRA left them out) as ``[E * out, in]``, each expert a row block of its own.
Everything else (router, norms, conv, embeddings, ``lm_head``) stays as loaded, and so does a
weight whose block count does not fit the scale blocks (:func:`scaler_block`, :func:`splits`);
:func:`quantize_weights` logs one summary line with the counts and why layers stay.

On a model built on the meta device the NF4 parameters are meta too (nothing allocated);
:func:`packer` then fills them while the checkpoint streams in, in row chunks of at most
:data:`QUANT_CHUNK` weights (:func:`quantize_rows`: ``to_nf4``'s result, without its working set).
Compute dequantises a weight per use (torchao's ``linear_nf4``; one expert at a time for experts).
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hybridtrain.distributed.materialize import local_region

__all__ = ["BASE_QUANT_CHOICES", "NF4_BLOCK", "require_torchao", "scaler_block", "is_nf4",
           "quantize_weights", "row_chunks", "quantize_rows", "packer", "dense", "nf4_bytes"]

logger = logging.getLogger(__name__)

BASE_QUANT_CHOICES = ("nf4",)
NF4_BLOCK = 64  # weights per 4-bit block (one absmax scale each)
SCALER_BLOCKS = (256, 128, 64, 32, 16, 8)  # block scales per int8 double-quantisation group
SHARD_GRAIN = 8  # scale blocks per tensor preferably a multiple of this (FSDP2 splits)


def require_torchao():
    """torchao's NF4 module, or a ValueError that says how to install it."""
    try:
        return importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    except ImportError as e:
        raise ValueError("peft.base_quant: nf4 needs torchao (pip install 'hybridtrain[quant]', "
                         f"torchao>=0.18): {e}") from e


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) is an NF4 tensor."""
    t = getattr(t, "_local_tensor", t)
    return type(t).__name__ == "NF4Tensor"


def scaler_block(numel: int, experts: int = 1) -> int | None:
    """The scale-block size for a weight of ``numel`` elements (``experts`` stacked ones): the
    largest of 256, 128, ... 8 that divides each expert's count of 64-weight blocks, preferring
    one that leaves a multiple of 8 scale blocks (so that FSDP2 can split the tensor over 2, 4
    or 8 ranks: the choice never depends on the layout); None when none divides (the layer stays
    unquantised)."""
    if numel % (experts * NF4_BLOCK):
        return None
    blocks = numel // NF4_BLOCK
    fits = [s for s in SCALER_BLOCKS if (blocks // experts) % s == 0]
    return next((s for s in fits if blocks % (s * SHARD_GRAIN) == 0), fits[0] if fits else None)


def splits(numel: int, rows: int, sbs: int, shards: int) -> bool:
    """Whether FSDP2 can split an NF4 tensor into ``shards`` row blocks of whole scale blocks."""
    return rows % shards == 0 and (numel // NF4_BLOCK) % (sbs * shards) == 0


def quantize_weights(weights: Iterable[tuple[str, nn.Module, str, int | None]], method: str = "nf4",
                     shards: int = 1) -> dict[str, list[str]]:
    """Store each frozen weight ``(name, owning module, attribute, experts or None)`` in NF4 where
    its blocks allow (in place, meta device included); ``shards``: the FSDP shard degree the
    weights will be split over (rows). Returns ``{"nf4": names, "kept": ["name (why)", ...]}``."""
    if method not in BASE_QUANT_CHOICES:
        raise ValueError(f"peft.base_quant must be null or one of {BASE_QUANT_CHOICES}, got {method!r}")
    nf4 = require_torchao()
    done, kept = [], []
    for name, mod, attr, experts in weights:
        w = getattr(mod, attr)
        if is_nf4(w):
            continue
        rows = w.numel() // w.shape[-1]
        sbs = scaler_block(w.numel(), experts or 1)
        if sbs is None or not splits(w.numel(), rows, sbs, shards):
            unit = w.numel() // (experts or 1)
            why = (f"{unit} weights{' per expert' if experts else ''}: not a multiple of "
                   f"{NF4_BLOCK} x {SCALER_BLOCKS[-1]}" if sbs is None
                   else f"does not split into {shards} FSDP shards of whole scale blocks")
            kept.append(f"{name} ({why})")
            continue
        w2 = w.detach().reshape(rows, w.shape[-1])
        q = _meta_nf4(nf4, w2, sbs) if w2.is_meta else quantize_rows(
            (w2[r] for r in row_chunks(w2.shape)), w2.numel(), w2.shape, sbs, w2.dtype, w2.device)
        setattr(mod, attr, nn.Parameter(q, requires_grad=False))
        done.append(name)
    leaves = Counter(n.rsplit(".", 2)[-2] if n.endswith(".weight") else n.rsplit(".", 1)[-1]
                     for n in done)
    logger.info("peft.base_quant nf4: %d base weights in NF4 (%s); %d linear/expert weights stay "
                "as loaded%s; so do the router, norms, conv, embeddings and lm_head (no linear "
                "layers LoRA adapts)",
                len(done), ", ".join(f"{k} x{v}" for k, v in sorted(leaves.items())), len(kept),
                (": " + "; ".join(kept[:6]) + (" ..." if len(kept) > 6 else "")) if kept else "")
    return {"nf4": done, "kept": kept}


def _meta_nf4(nf4, w: torch.Tensor, sbs: int) -> torch.Tensor:
    """The NF4 tensor ``to_nf4(w)`` makes, on the meta device, built from its parts' shapes
    (``to_nf4`` itself walks a meta tensor in 1M-element chunks: a minute for a 30B model)."""
    blocks = w.numel() // NF4_BLOCK
    meta = dict(device="meta")
    return nf4.nf4_constructor(
        nf4.SubclassTensorArgs(w.size(), w.stride(), w.storage_offset(), w.dtype, w.device, False),
        NF4_BLOCK, blocks, sbs, torch.empty(blocks, dtype=torch.int8, **meta),
        torch.empty(blocks // sbs, dtype=w.dtype, **meta), torch.empty((), dtype=w.dtype, **meta),
        torch.empty(w.numel() // 2, dtype=torch.uint8, **meta), torch.empty(16, dtype=w.dtype, **meta))


QUANT_CHUNK = 2**15  # weights quantised at once (torchao's nearest-code search: 64 B each)


def row_chunks(shape: tuple[int, ...], chunk: int | None = None) -> Iterator[tuple[slice, ...]]:
    """Regions of a weight of ``shape`` (``[out, in]``, or stacked experts ``[E, out, in]``: one
    expert at a time) that tile it in order, each whole rows of at most ``chunk`` weights (at
    least one row) and a multiple of :data:`NF4_BLOCK` weights."""
    *experts, rows, cols = shape
    chunk = chunk or QUANT_CHUNK
    grain = NF4_BLOCK // math.gcd(cols, NF4_BLOCK)  # rows per whole number of blocks
    step = max(grain, chunk // cols // grain * grain)
    for e in range(experts[0] if experts else 1):
        lead = (slice(e, e + 1),) if experts else ()
        for r in range(0, rows, step):
            yield (*lead, slice(r, min(r + step, rows)), slice(0, cols))


@torch.no_grad()
def quantize_rows(chunks: Iterable[torch.Tensor], numel: int, shape: tuple[int, int],
                  scaler_block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``to_nf4`` of the weight whose flattened row-major parts ``chunks`` yields in order
    (each a multiple of :data:`NF4_BLOCK` weights), equal to it bit for bit, holding one chunk
    at a time besides the result: NF4's codes depend on each 64-weight block's absmax only, and
    its double quantisation on the tensor-wide mean of those absmaxes, computed once from all of
    them at the end (torchao's own ``double_quantize_scalers`` over the absmaxes as blocks of 1:
    the absmax of one non-negative value is that value). ``to_nf4`` itself holds ~5 bytes per
    weight of the whole tensor and a 64 MiB nearest-code search (1M weights x 16 codes, twice)."""
    nf4 = require_torchao()
    NF4 = nf4.NF4Tensor
    table = _codebook(dtype, device).clone()  # each NF4 tensor owns its table, as to_nf4's do
    codes = torch.empty(numel // 2, dtype=torch.uint8, device=device)
    absmax = torch.empty(numel // NF4_BLOCK, dtype=dtype, device=device)
    at = 0
    for part in chunks:
        part = part.to(device=device, dtype=dtype).reshape(-1)
        n = part.numel()
        assert n % NF4_BLOCK == 0 and at + n <= numel, (n, at, numel)
        absmax[at // NF4_BLOCK:(at + n) // NF4_BLOCK] = nf4.get_block_absmax(part, NF4_BLOCK)
        codes[at // 2:(at + n) // 2] = NF4.convert_to_norm_float_weight(part, n // NF4_BLOCK,
                                                                        NF4_BLOCK, table)
        at += n
        del part
    assert at == numel, (at, numel)
    scalers, factor, mean = NF4.double_quantize_scalers(absmax, 1, scaler_block_size)
    del absmax
    blocks = numel // NF4_BLOCK
    meta = nf4.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, device, False)
    return nf4.nf4_constructor(meta, NF4_BLOCK, blocks, scaler_block_size, scalers, factor, mean,
                               codes, table)


@functools.cache
def _codebook(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torchao's 16 NF4 code values in ``dtype`` on ``device`` (those of a two-block tensor)."""
    return require_torchao().to_nf4(torch.arange(2 * NF4_BLOCK, dtype=dtype, device=device),
                                    NF4_BLOCK, 2).nf4


def packer(shapes: dict[str, tuple[int | None, int, int]]):
    """``pack(name, param, source)`` for :func:`~hybridtrain.distributed.materialize.materialize`:
    an NF4 parameter's new local tensor, quantised from its whole source tensor read in bounded
    row chunks (:func:`row_chunks`, :func:`quantize_rows`; ``source(region)`` reads it in the
    unquantised shape, e.g. stacked experts ``[E, out, in]``: one expert at a time). The whole
    tensor is quantised first, so every layout holds the same codes; then this rank's rows are
    kept. ``shapes``: {name: (experts or None, rows, cols)} of the NF4 weights."""

    @torch.no_grad()
    def pack(name: str, param: torch.Tensor, source) -> torch.Tensor:
        experts, rows, cols = shapes[name]
        logical = (experts, rows // experts, cols) if experts else (rows, cols)
        local = getattr(param, "_local_tensor", param)
        q = quantize_rows((source(region) for region in row_chunks(logical)), rows * cols,
                          (rows, cols), local.scaler_block_size, param.dtype, local.device)
        if local is param:
            return q
        mine = local_region(param)[0]
        size = mine.stop - mine.start
        return q if size == rows else q.split(size)[mine.start // size]

    return pack


def dense(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The NF4 tensor ``t`` (whole, not a shard) dequantised to its dtype, in ``shape``."""
    return getattr(t, "_local_tensor", t).get_original_weight().reshape(shape)


def nf4_bytes(numel: int, scaler_block_size: int = 256) -> float:
    """Bytes an NF4 weight of ``numel`` elements holds: 4-bit codes, one int8 scale per 64
    weights, one bf16 factor per scale block (and a mean)."""
    blocks = numel / NF4_BLOCK
    return numel / 2 + blocks + 2 * blocks / scaler_block_size + 2
