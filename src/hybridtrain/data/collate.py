"""Collators: lists of examples -> batches of tensors.

::

    PaddingCollator(pad_token_id, pad_to_multiple_of=1, max_length=None)   # unpacked examples
    PackedCollator()                                                         # PackedDataset rows
    build_collator(dataset, pad_to_multiple_of=1)                            # picks one

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


class PackedCollator:
    def __call__(self, rows: Sequence[dict]) -> dict:
        L = int(rows[0]["input_ids"].shape[0])
        for r in rows:
            if int(r["input_ids"].shape[0]) != L:
                raise ValueError("packed rows in one batch must have the same pack_size")
        cu = []
        for k, r in enumerate(rows):
            c = r["cu_seqlens"].to(torch.int64)
            assert int(c[0]) == 0 and int(c[-1]) == L, "a packed row's cu_seqlens must span it"
            cu.append(c[:-1] + k * L)
        cu.append(torch.tensor([len(rows) * L], dtype=torch.int64))
        cu_seqlens = torch.cat(cu)
        labels = torch.stack([r["labels"] for r in rows])
        return {
            "input_ids": torch.stack([r["input_ids"] for r in rows]),
            "labels": labels,
            "position_ids": torch.stack([r["position_ids"] for r in rows]),
            "attention_mask": torch.stack([r["attention_mask"] for r in rows]),
            "cu_seqlens": cu_seqlens.to(torch.int32),
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
            "num_tokens": torch.tensor(sum(int(r["num_tokens"]) for r in rows), dtype=torch.long),
            "num_label_tokens": (labels != IGNORE_INDEX).sum(),
        }


def build_collator(dataset: TokenDataset, pad_to_multiple_of: int = 1,
                   pad_token_id: int | None = None):
    """The dataset's own ``collator()`` when it has one (:class:`CollatesItself`),
    ``PackedCollator`` for a ``PackedDataset``, else a ``PaddingCollator`` with the dataset's
    ``pad_token_id`` (or the one given)."""
    if isinstance(dataset, CollatesItself):
        return dataset.collator()
    if isinstance(dataset, PackedDataset):
        return PackedCollator()
    if pad_token_id is None and not isinstance(dataset, TokenDataset):
        raise ValueError("build_collator needs pad_token_id (the dataset does not carry one: "
                         "hybridtrain.data.contract.TokenDataset)")
    pad = pad_token_id if pad_token_id is not None else dataset.pad_token_id
    return PaddingCollator(pad, pad_to_multiple_of=pad_to_multiple_of)
