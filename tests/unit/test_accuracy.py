"""Teacher-forced answer / token accuracy of validation batches."""

import torch

from hybridtrain.data.batch import IGNORE_INDEX as X
from hybridtrain.training.accuracy import answer_counts


def _logits(pred, vocab=8):
    return torch.nn.functional.one_hot(torch.tensor(pred), vocab).float()


def test_rows_are_answers():
    labels = torch.tensor([[X, 1, 2, X], [X, X, 3, X], [X, X, X, X]])
    pred = [[0, 1, 2, 0], [0, 0, 4, 0], [0, 0, 0, 0]]
    got = answer_counts(_logits(pred), {"labels": labels})
    assert got.tolist() == [1, 2, 2, 3]


def test_packed_documents_are_answers():
    labels = torch.tensor([[X, 1, X, X, 2, X, 5, X]])
    cu = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    pred = [[0, 1, 0, 0, 3, 0, 5, 0]]
    got = answer_counts(_logits(pred), {"labels": labels, "cu_seqlens": cu})
    assert got.tolist() == [2, 3, 2, 3]
