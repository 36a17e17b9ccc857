"""Collators: lists of examples -> batches of tensors.

::

    PaddingCollator(pad_token_id, pad_to_multiple_of=1, max_length=None)   # unpacked examples
    PackedCollator(padding_free=False)                                       # PackedDataset rows
    build_collator(dataset, pad_to_multiple_of=1, padding_free=False)        # picks one

Every batch has ``input_ids``, ``labels`` (shifted; -100 = no loss), ``position_ids`` (all
``[B, L]`` long) and the 0-dim long tensors ``num_tokens`` (non-padding tokens) and
``num_label_tokens`` (labels that are not -100; normalise the summed loss by this).

Unpacked batches (``PaddingCollator``) are right-padded to the longest example, rounded up to
``pad_to_multiple_of`` (or to ``max_length``), and add ``attention_mask`` ``[B, L]``.

Packed batches (``PackedCollator``) add ``attention_mask`` (1 on document tokens; documents are
separated by ``cu_seqlens``, not by it) and ``cu_seqlens``: int32, flattened over the ``B * L`` tokens of
the batch (row ``r`` offset by ``r * L``), so ``cu_seqlens[-1] == B * L``; every document and every
row's trailing padding is a segment of its own. ``position_ids`` restart at 0 in every segment.
``max_seqlen`` (an int) is the longest segment.

Padding-free packed batches (``PackedCollator(padding_free=True)``, ``packing.padding_free``)
are one row ``[1, T]``: the documents of every row, in order, without the rows' trailing
padding, so no pad token goes through the model (a document's own padding to
``pad_to_multiple_of`` stays). ``T`` changes from batch to batch; the model sees the same
documents, each attending and scanning only itself, so every token's loss is the padded batch's
up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import IGNORE_INDEX
from .contract import CollatesItself, TokenDataset
from .packing import PackedDataset


def _as_list(x) -> list[int]:
    return x.tolist() if torch.is_tensor(x) else list(x)


class PaddingCollator:
    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 1, max_length: int | None = None):
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be positive, got {pad_to_multiple_of}")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def __call__(self, examples: Sequence[dict]) -> dict:
        rows = []
        for ex in examples:
            ids, labels = _as_list(ex["input_ids"]), _as_list(ex["labels"])
            mask = _as_list(ex["attention_mask"]) if "attention_mask" in ex else [1] * len(ids)
            rows.append((ids, labels, mask))
        longest = max(len(r[0]) for r in rows)
        if self.max_length is not None:
            if longest > self.max_length:
                raise ValueError(
                    f"an example has {longest} tokens, more than max_length={self.max_length}"
                )
            width = self.max_length
        else:
            m = self.pad_to_multiple_of
            width = -(-longest // m) * m
        B = len(rows)
        input_ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((B, width), dtype=torch.long)
        for b, (ids, lab, mask) in enumerate(rows):
            n = len(ids)
            input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
            labels[b, :n] = torch.tensor(lab, dtype=torch.long)
            attention_mask[b, :n] = torch.tensor(mask, dtype=torch.long)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "position_ids": torch.arange(width, dtype=torch.long).expand(B, width).clone(),
            "num_tokens": attention_mask.sum(),
            "num_label_tokens": (labels != IGNORE_INDEX).sum(),
        }


_ROW_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def _documents_end(row: dict, cu: torch.Tensor) -> int:
    """Where ``row``'s documents end: the start of its trailing padding segment (the last
    segment, when its first token is padding), else the row's length."""
    last = int(cu[-2])
    return last if len(cu) > 2 and int(row["attention_mask"][last]) == 0 else int(cu[-1])


class PackedCollator:
    """Packed rows -> a batch ``[B, pack_size]``, or with ``padding_free`` one row ``[1, T]`` of
    their documents (module docstring)."""

    def __init__(self, padding_free: bool = False):
        self.padding_free = padding_free

    def __call__(self, rows: Sequence[dict]) -> dict:
        L = int(rows[0]["input_ids"].shape[0])
        for r in rows:
            if int(r["input_ids"].shape[0]) != L:
                raise ValueError("packed rows in one batch must have the same pack_size")
        cu, ends, offset = [], [], 0
        for r in rows:
            c = r["cu_seqlens"].to(torch.int64)
            assert int(c[0]) == 0 and int(c[-1]) == L, "a packed row's cu_seqlens must span it"
            end = _documents_end(r, c) if self.padding_free else L
            cu.append(c[c < end] + offset)
            ends.append(end)
            offset += end
        cu.append(torch.tensor([offset], dtype=torch.int64))
        cu_seqlens = torch.cat(cu)
        if self.padding_free:
            cols = {k: torch.cat([r[k][:e] for r, e in zip(rows, ends)])[None] for k in _ROW_KEYS}
        else:
            cols = {k: torch.stack([r[k] for r in rows]) for k in _ROW_KEYS}
        labels = cols["labels"]
        return {
            **cols,
            "cu_seqlens": cu_seqlens.to(torch.int32),
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
            "num_tokens": torch.tensor(sum(int(r["num_tokens"]) for r in rows), dtype=torch.long),
            "num_label_tokens": (labels != IGNORE_INDEX).sum(),
        }


def build_collator(dataset: TokenDataset, pad_to_multiple_of: int = 1,
                   pad_token_id: int | None = None, padding_free: bool = False):
    """The dataset's own ``collator()`` when it has one (:class:`CollatesItself`),
    ``PackedCollator(padding_free)`` for a ``PackedDataset``, else a ``PaddingCollator`` with the
    dataset's ``pad_token_id`` (or the one given). ``padding_free`` is for packed rows only."""
    if padding_free and not isinstance(dataset, PackedDataset):
        raise ValueError(f"packing.padding_free: true joins the documents of packed text rows; the "
                         f"training set here ({type(dataset).__name__}) has no such rows (packing "
                         "off, or a dataset with its own collator such as images): set "
                         "packing.padding_free: false")
    if isinstance(dataset, CollatesItself):
        return dataset.collator()
    if isinstance(dataset, PackedDataset):
        return PackedCollator(padding_free)
    if pad_token_id is None and not isinstance(dataset, TokenDataset):
        raise ValueError("build_collator needs pad_token_id (the dataset does not carry one: "
                         "hybridtrain.data.contract.TokenDataset)")
    pad = pad_token_id if pad_token_id is not None else dataset.pad_token_id
    return PaddingCollator(pad, pad_to_multiple_of=pad_to_multiple_of)
