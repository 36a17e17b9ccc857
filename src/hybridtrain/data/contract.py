"""The data contract: what a dataset, an example and a batch are.

::

    Example                      # one item of a dataset (a TypedDict)
    Batch                        # what a collator returns (a TypedDict; helpers in hybridtrain.data.batch)
    TokenDataset                 # the dataset every command trains and evaluates on (a Protocol)
    KnowsLengths, PacksItself, CollatesItself, NamesRecords, HasReferences, HoldsImages
                                 # optional parts a dataset may also have (Protocols)
    check_dataset(dataset, where) -> dataset   # ValueError naming what is missing

A dataset is map-style: ``len(dataset)``, ``dataset[i]`` an :class:`Example`, and
``dataset.pad_token_id`` (the id its examples are padded with). That is all a dataset from
outside needs: hybridtrain packs it (:class:`~hybridtrain.data.packing.PackedDataset`) and pads
it (:class:`~hybridtrain.data.collate.PaddingCollator`) itself. A dataset that can do better
declares an optional part by having its methods; generic code asks for a part with
``isinstance(dataset, Part)`` and never probes single attributes.

Datasets from outside the tree register a builder through the entry-point group
``hybridtrain.datasets`` (``name = "package.module:build"``) and a recipe names it as
``dataset: {_target_: hybridtrain.data.registered_dataset, name: NAME, ...}``.

This module imports nothing heavy (no torch, datasets or transformers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Example", "Batch", "TokenDataset", "KnowsLengths", "PacksItself", "CollatesItself",
           "NamesRecords", "HasReferences", "HoldsImages", "check_dataset", "missing_parts"]


class Batch(TypedDict, total=False):
    """A collated batch (``input_ids`` and ``labels`` always; the rest when the collator has them)."""

    input_ids: Tensor          # [B, L] token ids
    labels: Tensor             # [B, L] shifted targets, IGNORE_INDEX where not trained on
    position_ids: Tensor       # [B, L] positions, restarting at 0 for each packed document
    cu_seqlens: Tensor         # packed: [S + 1] int32 segment starts over the B * L tokens
    max_seqlen: int            # packed: the longest segment
    attention_mask: Tensor     # [B, L] 1 on tokens, 0 on padding
    num_label_tokens: Tensor   # scalar: labels that are not IGNORE_INDEX
    num_tokens: Tensor         # scalar: tokens that are not padding
    pixel_values: Tensor       # images: [patches, C * p * p], every image's patches in order
    image_grid: Tensor         # images: [images, 2] patch rows, patch columns of each image


class _ExampleKeys(TypedDict):
    input_ids: Tensor          # [L] long token ids (a list of ints works too)
    labels: Tensor             # [L] shifted targets (see hybridtrain.data.batch), IGNORE_INDEX where not trained on


class Example(_ExampleKeys, total=False):
    """One item of a :class:`TokenDataset` (``input_ids`` and ``labels`` always)."""

    attention_mask: Tensor     # [L] 1 on tokens, 0 on padding (absent: all tokens)
    pixel_values: Tensor       # images: [patches, C * p * p]
    image_grid: Tensor         # images: [images, 2]


@runtime_checkable
class TokenDataset(Protocol):
    """The dataset every command reads: map-style, its items :class:`Example` s."""

    pad_token_id: int

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Example: ...


# -- optional parts ---------------------------------------------------------------------------
@runtime_checkable
class KnowsLengths(Protocol):
    """Packs without reading every example: each example's unpadded length, and its tokens."""

    lengths: Sequence[int]

    def get_unpadded(self, i: int) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of example ``i`` without padding."""
        ...


@runtime_checkable
class PacksItself(Protocol):
    """Its packed rows carry more than tokens (e.g. images): ``pack_dataset`` calls this."""

    def pack(self, pack_size: int, pad_to_multiple_of: int = 1) -> TokenDataset: ...


@runtime_checkable
class CollatesItself(Protocol):
    """Its examples need their own collator (e.g. images): ``build_collator`` calls this."""

    def collator(self) -> Callable[[Sequence[Example]], Batch]: ...


@runtime_checkable
class NamesRecords(Protocol):
    """Names the source record of each example (in evaluation samples); else its index."""

    def record_id(self, i: int) -> str: ...


@runtime_checkable
class HasReferences(Protocol):
    """Every reference answer of each record (SQuAD's several answers), by record id."""

    def reference_answers(self) -> dict[str, list[str]]: ...


@runtime_checkable
class HoldsImages(Protocol):
    """A vision dataset whose text and images a split model reads on different ranks."""

    def item(self, i: int, pixels: bool = True) -> Example: ...

    def image_list(self, i: int) -> list: ...

    def load_pixels(self, images: Sequence) -> Tensor: ...


# -- the check where a dataset is built --------------------------------------------------------
_REQUIRED = ("__len__", "__getitem__", "pad_token_id")


def missing_parts(dataset: Any) -> list[str]:
    """What ``dataset`` lacks of :class:`TokenDataset` and of its first :class:`Example`."""
    missing = [name for name in _REQUIRED if not hasattr(dataset, name)]
    if missing:
        return missing
    if not isinstance(dataset.pad_token_id, int) or isinstance(dataset.pad_token_id, bool):
        return [f"pad_token_id as an int (it is {dataset.pad_token_id!r})"]
    if len(dataset) == 0:
        return ["an example (it is empty)"]
    example = dataset[0]
    if not isinstance(example, Mapping):
        return [f"examples as mappings (item 0 is a {type(example).__name__})"]
    out = [f"example key {k!r}" for k in _ExampleKeys.__annotations__ if k not in example]
    if not out and len(example["input_ids"]) != len(example["labels"]):
        out.append(f"labels as long as input_ids in item 0 ({len(example['labels'])} != "
                   f"{len(example['input_ids'])})")
    return out


def check_dataset(dataset: Any, where: str) -> Any:
    """``dataset`` if it keeps the data contract, else a ``ValueError`` naming ``where`` it was
    built (a recipe section and file) and what it lacks."""
    missing = missing_parts(dataset)
    if missing:
        raise ValueError(
            f"{where}: the dataset ({type(dataset).__module__}.{type(dataset).__qualname__}) "
            f"lacks {', '.join(missing)}; a dataset is map-style, its items dicts with input_ids "
            "and labels, and carries pad_token_id (hybridtrain.data.contract.TokenDataset)")
    return dataset
