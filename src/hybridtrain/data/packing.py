"""Sequence packing: several documents per row, attention and Mamba state kept per document.

::

    pack_dataset(dataset, pack_size, pad_token_id=None, pad_to_multiple_of=1) -> PackedDataset
    pack_sequences(docs, pack_size, pad_token_id, pad_to_multiple_of=1) -> list[row]
    first_fit_decreasing(sizes, capacity) -> list[list[int]]   # bins of document indices

``dataset`` is a ``TokenizedDataset`` (its padding is ignored) or any sequence of dicts with
``input_ids`` and shifted ``labels`` (and optionally ``attention_mask`` marking padding to strip).
``docs`` is a list of ``(input_ids, labels)``.

Documents go into rows of ``pack_size`` tokens by first-fit-decreasing. Each row is a dict:

- ``input_ids``, ``labels``, ``position_ids``: ``[pack_size]`` long tensors; ``position_ids``
  restart at 0 at every document;
- ``cu_seqlens``: int32 ``[num_segments + 1]``, from 0 to ``pack_size``: the document boundaries,
  with the row's leftover space (pad tokens, labels -100) as a last segment of its own;
- ``attention_mask``: 1 on document tokens, 0 on padding (it does not separate documents --
  ``cu_seqlens`` does);
- ``num_tokens`` (document tokens, no padding) and ``num_label_tokens``: ints;
- ``doc_ids``: the source indices of the documents in the row, in order.

Labels are already shifted per document (``labels[t]`` is a token of the same document, and the
last token of every document has -100), so no label crosses a document boundary. With
``pad_to_multiple_of=N`` every document is padded (pad tokens, labels -100, positions continuing)
to a multiple of ``N`` tokens (context parallelism needs no such padding) and ``pack_size`` must
be a multiple of ``N``. A document longer than ``pack_size`` is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridtrain.config.keys import recipe_key

from .batch import IGNORE_INDEX
from .contract import KnowsLengths, PacksItself, TokenDataset

_PACK = recipe_key("pack_size")


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into ``sizes``) by first-fit-decreasing, O(n log n).

    Documents are taken longest first (ties by index) and each goes into the first bin, in
    opening order, with room for it; bins are found with a max segment tree of free space.
    """
    n = len(sizes)
    for i, s in enumerate(sizes):
        if s > capacity:
            raise ValueError(
                f"document {i} has {s} tokens, more than {_PACK}={capacity}; raise {_PACK} "
                f"or cut documents with {recipe_key('seq_length')} <= {_PACK}"
            )
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (-sizes[i], i))
    size = 1
    while size < n:
        size *= 2
    tree = [0] * (2 * size)
    for b in range(n):
        tree[size + b] = capacity
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    bins: list[list[int]] = []
    for i in order:
        s = sizes[i]
        if s <= 0:
            continue
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        tree[node] -= s
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def build_row(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pack_size: int,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
) -> dict:
    """One packed row from ``docs`` (``(input_ids, labels)`` each), in the given order."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    mask: list[int] = []
    cu = [0]
    num_tokens = num_label_tokens = 0
    for d_ids, d_labels in docs:
        n = len(d_ids)
        assert len(d_labels) == n and n > 0
        if d_labels[-1] != IGNORE_INDEX:
            raise ValueError(
                "the last token of a document has a label; labels must be shifted within each "
                "document (labels[t] = input_ids[t+1], -100 on the last token)"
            )
        padded = _round_up(n, pad_to_multiple_of)
        ids.extend(d_ids)
        ids.extend([pad_token_id] * (padded - n))
        labels.extend(d_labels)
        labels.extend([IGNORE_INDEX] * (padded - n))
        pos.extend(range(padded))
        mask.extend([1] * n + [0] * (padded - n))
        cu.append(cu[-1] + padded)
        num_tokens += n
        num_label_tokens += sum(1 for x in d_labels if x != IGNORE_INDEX)
    used = cu[-1]
    assert used <= pack_size, (used, pack_size)
    if used < pack_size:
        ids.extend([pad_token_id] * (pack_size - used))
        labels.extend([IGNORE_INDEX] * (pack_size - used))
        pos.extend(range(pack_size - used))
        mask.extend([0] * (pack_size - used))
        cu.append(pack_size)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(pos, dtype=torch.long),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "attention_mask": torch.tensor(mask, dtype=torch.long),
        "num_tokens": num_tokens,
        "num_label_tokens": num_label_tokens,
    }


def _check(pack_size: int, pad_to_multiple_of: int) -> None:
    pad = recipe_key("pad_to_multiple_of")
    if pack_size < 1:
        raise ValueError(f"{_PACK} must be positive, got {pack_size}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"{pad} must be positive, got {pad_to_multiple_of}")
    if pack_size % pad_to_multiple_of:
        raise ValueError(f"{_PACK}={pack_size} must be a multiple of {pad}={pad_to_multiple_of}")


def pack_sequences(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pack_size: int,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
) -> list[dict]:
    """Pack a list of ``(input_ids, labels)`` documents into rows (see the module docstring)."""
    _check(pack_size, pad_to_multiple_of)
    sizes = [_round_up(len(d[0]), pad_to_multiple_of) for d in docs]
    rows = []
    for b in first_fit_decreasing(sizes, pack_size):
        row = build_row([docs[i] for i in b], pack_size, pad_token_id, pad_to_multiple_of)
        row["doc_ids"] = list(b)
        rows.append(row)
    return rows


def _unpadded(example) -> tuple[list[int], list[int]]:
    ids = example["input_ids"]
    labels = example["labels"]
    ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
    labels = labels.tolist() if torch.is_tensor(labels) else list(labels)
    mask = example.get("attention_mask")
    if mask is not None:
        n = int(sum(mask.tolist() if torch.is_tensor(mask) else mask))
        ids, labels = ids[:n], labels[:n]
    return ids, labels


class PackedDataset(torch.utils.data.Dataset):
    """Rows of packed documents over a source dataset (built lazily per row)."""

    def __init__(self, dataset: TokenDataset, pack_size: int, pad_token_id: int | None = None,
                 pad_to_multiple_of: int = 1):
        _check(pack_size, pad_to_multiple_of)
        if pad_token_id is None:
            if not isinstance(dataset, TokenDataset):
                raise ValueError("pack_dataset needs pad_token_id (the dataset does not carry "
                                 "one: hybridtrain.data.contract.TokenDataset)")
            pad_token_id = dataset.pad_token_id
        self.dataset = dataset
        self.pack_size = pack_size
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self._native = isinstance(dataset, KnowsLengths)
        if self._native:
            lengths = [int(x) for x in dataset.lengths]
        else:
            lengths = [len(_unpadded(dataset[i])[0]) for i in range(len(dataset))]
        self.lengths = lengths
        sizes = [_round_up(n, pad_to_multiple_of) for n in lengths]
        self.bins = first_fit_decreasing(sizes, pack_size)

    def __len__(self) -> int:
        return len(self.bins)

    def _get(self, i: int) -> tuple[list[int], list[int]]:
        return self.dataset.get_unpadded(i) if self._native else _unpadded(self.dataset[i])

    def __getitem__(self, r: int) -> dict:
        b = self.bins[r]
        row = build_row([self._get(i) for i in b], self.pack_size, self.pad_token_id,
                        self.pad_to_multiple_of)
        row["doc_ids"] = list(b)
        return row

    def utilization(self) -> float:
        """Fraction of row tokens that are document tokens."""
        return sum(self.lengths) / max(1, len(self.bins) * self.pack_size)


def pack_dataset(dataset: TokenDataset, pack_size: int, pad_token_id: int | None = None,
                 pad_to_multiple_of: int = 1) -> TokenDataset:
    """``PackedDataset(dataset, pack_size, pad_token_id, pad_to_multiple_of)``, or the
    dataset's own ``pack(pack_size, pad_to_multiple_of)`` when it has one
    (:class:`~hybridtrain.data.contract.PacksItself`: rows that carry more than tokens, e.g.
    images)."""
    if isinstance(dataset, PacksItself):
        return dataset.pack(pack_size, pad_to_multiple_of)
    return PackedDataset(dataset, pack_size, pad_token_id, pad_to_multiple_of)
