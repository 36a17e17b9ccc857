"""Lines of a text file as a hybridtrain dataset: each non-empty line is one document, every
token after the first trained on. It keeps only the required part of the data contract
(``len``, ``[i]``, ``pad_token_id``); hybridtrain packs and pads it."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class LinesDataset:
    def __init__(self, docs: list[list[int]], pad_token_id: int):
        self.docs, self.pad_token_id = docs, pad_token_id

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.docs[i]
        return {"input_ids": torch.tensor(ids, dtype=torch.long),
                "labels": torch.tensor(ids[1:] + [IGNORE_INDEX], dtype=torch.long)}


def build_lines_dataset(path: str, tokenizer, seq_length: int = 128) -> LinesDataset:
    """Every non-empty line of ``path``, tokenized and cut to ``seq_length`` tokens."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    docs = [tokenizer.encode(line, add_special_tokens=False)[:seq_length] for line in lines]
    return LinesDataset([d for d in docs if len(d) > 1], tokenizer.pad_token_id)
