"""Shared helpers of the tests/unit/test_data_*.py files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
SQUAD_SUBSET = SHARED_DATA / "squad-v2-dev-subset.json"

_TOKENIZERS: dict[str, object] = {}


def require_squad_subset() -> Path:
    if not SQUAD_SUBSET.is_file():
        pytest.skip(f"reference data not found: {SQUAD_SUBSET} (the ../shared/data folder is absent)")
    return SQUAD_SUBSET


def _training_texts() -> list[str]:
    texts = []
    if SQUAD_SUBSET.is_file():
        doc = json.loads(SQUAD_SUBSET.read_text())
        for art in doc["data"]:
            for par in art["paragraphs"]:
                texts.append(par["context"])
                texts.extend(qa["question"] for qa in par["qas"])
    from hybridtrain.data import synthetic_texts

    texts += synthetic_texts(400, seed=0)
    texts += ["system user assistant tool Hello! How are you? I am fine, thanks."] * 5
    return texts


def bpe_tokenizer(tmp_path_factory, vocab_size: int = 3000):
    """A byte-level BPE trained on the SQuAD subset (when present) and synthetic text; cached."""
    key = f"bpe{vocab_size}"
    if key not in _TOKENIZERS:
        from hybridtrain.data import build_bpe_tokenizer

        out = tmp_path_factory.mktemp("tokenizer")
        _TOKENIZERS[key] = build_bpe_tokenizer(_training_texts(), out, vocab_size=vocab_size)
    return _TOKENIZERS[key]


def label_tokens(example) -> list[int]:
    labels = example["labels"]
    return labels[labels != -100].tolist()
