"""Teacher-forced accuracy of a validation batch: per label token, and per answer (a document
whose every label token is the argmax prediction)."""

from __future__ import annotations

import torch

from hybridtrain.data.batch import IGNORE_INDEX


def answer_counts(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """[correct answers, answers, correct tokens, label tokens] (float64) of ``batch``:
    documents are the packed segments of ``cu_seqlens`` (else one per row); a document
    without label tokens is not an answer."""
    return prediction_counts(logits.argmax(-1), batch)


def prediction_counts(predictions: torch.Tensor, batch: dict) -> torch.Tensor:
    """:func:`answer_counts` of the predicted tokens ``[rows, L]`` (the logits' argmax)."""
    labels = batch["labels"].reshape(-1)
    hit = (predictions.reshape(-1).to(labels.device) == labels) & (labels != IGNORE_INDEX)
    has = labels != IGNORE_INDEX
    B, L = batch["labels"].shape
    if batch.get("cu_seqlens") is not None:
        cu = batch["cu_seqlens"].long()
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device),
                                      cu[1:] - cu[:-1], output_size=B * L)
    else:
        doc = torch.arange(B, device=labels.device).repeat_interleave(L)
    n = int(doc.max()) + 1
    wrong = torch.zeros(n, device=labels.device).index_add_(0, doc, (has & ~hit).float())
    labelled = torch.zeros(n, device=labels.device).index_add_(0, doc, has.float())
    answers = labelled > 0
    return torch.tensor([float((answers & (wrong == 0)).sum()), float(answers.sum()),
                         float(hit.sum()), float(has.sum())], dtype=torch.float64)
