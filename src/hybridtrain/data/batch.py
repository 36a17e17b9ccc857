"""The batch every collator returns and the trainer and models read.

::

    IGNORE_INDEX = -100                  # a label that is not trained on
    MODEL_INPUT_KEYS = ("position_ids", "cu_seqlens", "pixel_values", "image_grid")
    Batch                                # the keys, as a TypedDict
    model_inputs(batch) -> dict          # the keyword arguments of the model's forward
    count_label_tokens(batch) -> int     # labels that are not IGNORE_INDEX
    count_tokens(batch) -> int           # tokens that are not padding

Labels are already shifted: ``labels[t]`` is the target of position ``t`` (``input_ids[t + 1]``
when that token is trained on, else ``IGNORE_INDEX``), and the last token of every document has
``IGNORE_INDEX``, so no label crosses a document boundary. This module imports nothing heavy
(no torch, datasets or transformers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from hybridtrain.ops.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["IGNORE_INDEX", "MODEL_INPUT_KEYS", "Batch", "model_inputs", "count_label_tokens",
           "count_tokens"]

# Batch keys the model's forward takes besides ``input_ids``; the others (labels, attention_mask,
# counts) stay with the trainer.
MODEL_INPUT_KEYS = ("position_ids", "cu_seqlens", "pixel_values", "image_grid")


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


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``model(batch["input_ids"], **model_inputs(batch))``: the
    :data:`MODEL_INPUT_KEYS` the batch holds (a ``None`` value counts as absent)."""
    return {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}


def count_label_tokens(batch: Mapping[str, Any]) -> int:
    """Labels that are not :data:`IGNORE_INDEX` (the tokens the loss is summed over)."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def count_tokens(batch: Mapping[str, Any]) -> int:
    """Tokens that are not padding: ``num_tokens``, else the ``attention_mask`` sum, else all."""
    if "num_tokens" in batch:
        return int(batch["num_tokens"])
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return batch["input_ids"].numel()
