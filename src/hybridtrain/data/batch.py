"""The batch every collator returns and the trainer and models read.

::

    IGNORE_INDEX = -100                  # a label that is not trained on
    MODEL_INPUT_KEYS = ("position_ids", "cu_seqlens", "pixel_values", "image_grid")
    Batch                                # the keys, as a TypedDict (hybridtrain.data.contract)
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
from typing import Any

from hybridtrain.data.contract import Batch
from hybridtrain.ops.labels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "MODEL_INPUT_KEYS", "Batch", "model_inputs", "count_label_tokens",
           "count_tokens"]

# Batch keys the model's forward takes besides ``input_ids``; the others (labels, attention_mask,
# counts) stay with the trainer.
MODEL_INPUT_KEYS = ("position_ids", "cu_seqlens", "pixel_values", "image_grid")


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
