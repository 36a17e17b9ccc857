"""QLoRA's frozen 4-bit base: the weights under the LoRA adapters stored as torchao's NF4.

``quantize_base(model)`` (``peft.base_quant: nf4``; after :func:`~hybridtrain.peft.lora.apply_lora`)
turns every frozen weight LoRA could adapt into an ``NF4Tensor`` parameter (``requires_grad=False``,
same name): 4-bit NormalFloat codes in blocks of 64 with double-quantised (int8) block scales.
Which weights: every linear layer but ``lm_head`` and every stacked-experts module (the spec's
``expert_modules``), adapted or not; experts are held by a :class:`LoRAExperts` (one without
adapters where LoRA left them out) as ``[E * out, in]``, each expert a row block of its own.
Everything else (router, norms, conv, embeddings, ``lm_head``) stays as loaded, and so does a
weight whose block count does not fit the scale blocks (:func:`scaler_block`, :func:`splits`);
:func:`quantize_base` logs one summary line with the counts and why layers stay.

On a model built on the meta device the NF4 parameters are meta too (nothing allocated);
:func:`packer` then fills them while the checkpoint streams in, one bf16 tensor at a time.
Compute dequantises a weight per use (torchao's ``linear_nf4``; one expert at a time for experts).
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["BASE_QUANT_CHOICES", "NF4_BLOCK", "require_torchao", "scaler_block", "is_nf4",
           "quantize_base", "packer", "base_quant_of", "dense_shapes", "dense", "dequantized", "nf4_bytes"]

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


def _base_weights(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, int | None]]:
    """(name, owning module, attribute, experts) of every frozen base weight LoRA could adapt
    (every linear layer but ``lm_head``, every stacked-experts module: experts, None for a
    linear layer), adapted or not."""
    from hybridtrain.distributed.activation_checkpoint import state_dict_name
    from hybridtrain.peft.lora import EXCLUDED_LINEARS, LoRAExperts

    for name, mod in model.named_modules():
        pre = f"{state_dict_name(name)}." if name else ""
        if isinstance(mod, LoRAExperts):
            for proj in ("up_proj", "down_proj"):
                yield pre + proj, mod, proj, mod.num_experts
        elif isinstance(mod, nn.Linear) and name.split(".")[-1] not in EXCLUDED_LINEARS:
            yield pre + "weight", mod, "weight", None


def quantize_base(model: nn.Module, method: str = "nf4", shards: int = 1) -> dict[str, list[str]]:
    """Store every frozen linear and experts weight LoRA could adapt (adapted or not) in NF4 (in place, meta
    device included); ``shards``: the FSDP shard degree the weights will be split over (rows).
    Returns ``{"nf4": names, "kept": ["name (why)", ...]}``."""
    if method not in BASE_QUANT_CHOICES:
        raise ValueError(f"peft.base_quant must be null or one of {BASE_QUANT_CHOICES}, got {method!r}")
    nf4 = require_torchao()
    from hybridtrain.peft.lora import frozen_experts

    frozen_experts(model)  # experts without adapters compute from NF4 too
    done, kept = [], []
    for name, mod, attr, experts in _base_weights(model):
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
        q = _meta_nf4(nf4, w2, sbs) if w2.is_meta else nf4.to_nf4(w2, NF4_BLOCK, sbs)
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


def packer(model: nn.Module):
    """``pack(name, param, source)`` for :func:`~hybridtrain.distributed.materialize.materialize`:
    an NF4 parameter's new local tensor, quantised from its whole source tensor (``source(region)``
    reads it in the unquantised shape, e.g. stacked experts ``[E, out, in]``). The whole tensor
    is quantised first, so every layout holds the same codes; then this rank's rows are kept."""
    shapes = {name: (experts, *getattr(mod, attr).shape) for name, mod, attr, experts in _base_weights(model)}

    @torch.no_grad()
    def pack(name: str, param: torch.Tensor, source) -> torch.Tensor:
        experts, rows, cols = shapes[name]
        logical = (experts, rows // experts, cols) if experts else (rows, cols)
        full = source(tuple(slice(0, n) for n in logical))
        local = getattr(param, "_local_tensor", param)
        full = full.to(device=local.device, dtype=param.dtype).reshape(rows, cols).contiguous()
        q = require_torchao().to_nf4(full, local.block_size, local.scaler_block_size)
        del full
        if local is param:
            return q
        from hybridtrain.distributed.materialize import local_region

        mine = local_region(param)[0]
        size = mine.stop - mine.start
        return q if size == rows else q.split(size)[mine.start // size]

    return pack


def base_quant_of(model: nn.Module) -> str | None:
    """``"nf4"`` when ``model`` holds an NF4 base weight, else None."""
    return "nf4" if dense_shapes(model) else None


def dense_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """{name: unquantised shape} of ``model``'s NF4 base weights (stacked experts ``[E, out, in]``)."""
    out = {}
    for name, mod, attr, experts in _base_weights(model):
        w = getattr(mod, attr)
        if is_nf4(w):
            out[name] = torch.Size((experts, w.shape[0] // experts, w.shape[1]) if experts else w.shape)
    return out


def dense(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The NF4 tensor ``t`` (whole, not a shard) dequantised to its dtype, in ``shape``."""
    return getattr(t, "_local_tensor", t).get_original_weight().reshape(shape)


def dequantized(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (the model's names, whole tensors) with every NF4 base weight dequantised
    (:func:`dense`)."""
    shapes = dense_shapes(model)
    return {n: dense(t, shapes[n]) if n in shapes else t for n, t in state_dict.items()}


def nf4_bytes(numel: int, scaler_block_size: int = 256) -> float:
    """Bytes an NF4 weight of ``numel`` elements holds: 4-bit codes, one int8 scale per 64
    weights, one bf16 factor per scale block (and a mean)."""
    blocks = numel / NF4_BLOCK
    return numel / 2 + blocks + 2 * blocks / scaler_block_size + 2
